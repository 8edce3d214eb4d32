//! Per-peer routes: which local device reaches which device of each peer,
//! decided from every rank's addressed devices (all-gathered at start-up),
//! identically on every rank.
//!
//! # The rules
//!
//! * **Links.** Device `d` of rank `a` and device `e` of rank `b` are
//!   directly linked when each one's IPv4 address (the one its RoCE v2 GID
//!   carries) lies in the other's subnet (address and prefix of its netdev).
//! * **Rails.** The links between two ranks are grouped into rails of two
//!   lanes: lane 0 and lane 1 on distinct devices under distinct PCIe roots
//!   on both sides, preferring the same port (PCI function) for both lanes —
//!   a Spark port's two root functions. A link with no such partner is a
//!   rail of one device carrying both lanes (a warning: half the PCIe
//!   bandwidth). At most [`MAX_RAILS`] rails per peer: two cables to one
//!   peer give two rails, and call `seq` goes over rail `seq % rails`
//!   (successive calls, and a long call's successive chunks, alternate
//!   cables; each call still crosses both PCIe roots, which bound a
//!   Spark's bandwidth).
//! * **Canonical order.** Links are considered in the order of the lower
//!   rank's device list, then the higher rank's, so both ends of every link
//!   build the same rails with the same lane numbers.
//! * **Relay.** Ranks with no direct link (the diagonals of a 4-ring) are
//!   reached through a common neighbour: rank `x`'s partial for `y` is
//!   forwarded by the common neighbour `c` of `x` and `y` that comes first
//!   after `x` in rank order (smallest `(c - x) mod N`), which spreads the
//!   forwarding over the neighbours.
//! * **Fallback.** With `ARX_DEVICES` set on any rank (`fixed`), or for a
//!   pair with neither a link nor a common neighbour (routed RoCE v2 fabrics
//!   whose subnets differ, addresses unknown), both ranks use their primary
//!   lanes (the port topology chose alone, as before routes existed): lane
//!   `l` to lane `l`.

use std::net::Ipv4Addr;

use super::ifaddr::network;
use crate::codec::{Reader, Writer};
use crate::error::{Error, Result};

/// Most rails used to one peer.
pub const MAX_RAILS: usize = 2;

/// One addressed device of a rank, as every other rank learns it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortAddr {
    /// RDMA device name.
    pub name: String,
    /// Its PCIe root (the device name for software devices).
    pub root: String,
    /// PCI function (the Spark's port); 0 for software devices.
    pub function: u32,
    /// The IPv4 address of its RoCE v2 GID.
    pub ipv4: Option<Ipv4Addr>,
    /// The prefix length of that address on its netdev.
    pub prefix: Option<u8>,
}

impl PortAddr {
    fn subnet(&self) -> Option<(Ipv4Addr, u8)> {
        Some((network(self.ipv4?, self.prefix?), self.prefix?))
    }
    fn contains(&self, other: &PortAddr) -> bool {
        match (self.subnet(), other.ipv4) {
            (Some((net, p)), Some(a)) => network(a, p) == net,
            _ => false,
        }
    }
    fn describe(&self) -> String {
        match (self.ipv4, self.prefix) {
            (Some(a), Some(p)) => format!("{} {a}/{p}", self.name),
            (Some(a), None) => format!("{} {a}/?", self.name),
            _ => format!("{} (no IPv4)", self.name),
        }
    }
}

/// What a rank tells every rank about its devices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankPorts {
    /// `ARX_DEVICES` chose the devices on this rank.
    pub fixed: bool,
    /// The addressed devices, in discovery order (PCIe root, function).
    pub devices: Vec<PortAddr>,
    /// The primary lanes (indices into `devices`).
    pub primary: [usize; 2],
}

/// "ARXP" little-endian: the ports record's magic.
const PORTS_MAGIC: u32 = 0x5058_5241;
const PORTS_VERSION: u16 = 1;

impl RankPorts {
    /// Little-endian, versioned: magic, version, fixed, primary lanes, then
    /// per device its name, root, function, IPv4 (0: none) and prefix
    /// (255: none).
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::with_capacity(64 + 96 * self.devices.len());
        w.u32(PORTS_MAGIC)
            .u16(PORTS_VERSION)
            .u16(u16::from(self.fixed))
            .u16(self.primary[0] as u16)
            .u16(self.primary[1] as u16)
            .u16(self.devices.len() as u16);
        for d in &self.devices {
            for s in [&d.name, &d.root] {
                w.u16(s.len() as u16).bytes(s.as_bytes());
            }
            w.u32(d.function)
                .u32(d.ipv4.map_or(0, u32::from))
                .u8(d.prefix.unwrap_or(255));
        }
        w.finish()
    }

    /// Decodes `rank`'s record; errors name that rank.
    pub fn decode(rank: usize, b: &[u8]) -> Result<Self> {
        let bad = |what: &str| Error::PeerFailed {
            peer: rank,
            reason: format!("its device/address record is unusable: {what} (another arx build?)"),
        };
        let mut r = Reader::new(b);
        if r.u32() != PORTS_MAGIC || r.u16() != PORTS_VERSION {
            return Err(bad("magic or version"));
        }
        let fixed = r.u16() != 0;
        let primary = [r.u16() as usize, r.u16() as usize];
        let n = r.u16() as usize;
        let mut devices = Vec::with_capacity(n.min(64));
        for _ in 0..n {
            let mut s = || {
                let len = r.u16() as usize;
                String::from_utf8_lossy(r.bytes(len)).into_owned()
            };
            let (name, root) = (s(), s());
            let function = r.u32();
            let ip = r.u32();
            let prefix = r.array::<1>()[0];
            devices.push(PortAddr {
                name,
                root,
                function,
                ipv4: (ip != 0).then(|| Ipv4Addr::from(ip)),
                prefix: (prefix <= 32).then_some(prefix),
            });
            if r.overran() {
                break;
            }
        }
        if r.overran() || devices.is_empty() || primary.iter().any(|&p| p >= devices.len()) {
            return Err(bad("truncated, empty, or primary lanes out of range"));
        }
        Ok(RankPorts {
            fixed,
            devices,
            primary,
        })
    }
}

/// One lane of a rail: this rank's device and the peer's (indices into the
/// two ranks' [`RankPorts::devices`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hop {
    /// This rank's device.
    pub mine: usize,
    /// The peer's device.
    pub theirs: usize,
}

/// How this rank reaches one peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    /// Over its own links: one to [`MAX_RAILS`] rails of two lanes.
    Direct {
        /// `rails[r][lane]`.
        rails: Vec<[Hop; 2]>,
        /// Why (subnet match, fallback, override).
        how: &'static str,
    },
    /// Through a neighbour that forwards this rank's partial to the peer and
    /// the peer's to this rank.
    Relay {
        /// The forwarding rank.
        via: usize,
    },
}

/// Every route of one rank.
#[derive(Debug, Clone)]
pub struct Plan {
    /// `routes[q]`: how to reach rank `q` (`None` for this rank).
    pub routes: Vec<Option<Route>>,
    /// `(from, to)`: partials this rank forwards.
    pub forwards: Vec<(usize, usize)>,
    /// Warnings and decisions, for logs and doctor.
    pub notes: Vec<String>,
}

/// Rails between two ranks, lower rank first: `[(device of a, device of b); 2]`.
type Rails = Vec<[(usize, usize); 2]>;

/// The canonical links between ranks `a < b`: `(device of a, device of b)`.
fn links(a: &RankPorts, b: &RankPorts) -> Vec<(usize, usize)> {
    let mut v = Vec::new();
    for (i, d) in a.devices.iter().enumerate() {
        for (j, e) in b.devices.iter().enumerate() {
            if d.contains(e) && e.contains(d) {
                v.push((i, j));
            }
        }
    }
    v
}

/// Groups the canonical links of `a < b` into rails (see the module docs).
fn rails(a: &RankPorts, b: &RankPorts, links: &[(usize, usize)]) -> Rails {
    let (mut used_a, mut used_b) = (Vec::new(), Vec::new());
    let mut out = Vec::new();
    while out.len() < MAX_RAILS {
        let free = |&&(i, j): &&(usize, usize)| !used_a.contains(&i) && !used_b.contains(&j);
        let Some(&l1) = links.iter().find(free) else {
            break;
        };
        let partner = |same_port: bool| {
            links.iter().copied().find(|&(i, j)| {
                free(&&(i, j))
                    && i != l1.0
                    && j != l1.1
                    && a.devices[i].root != a.devices[l1.0].root
                    && b.devices[j].root != b.devices[l1.1].root
                    && (!same_port
                        || (a.devices[i].function == a.devices[l1.0].function
                            && b.devices[j].function == b.devices[l1.1].function))
            })
        };
        let l2 = partner(true).or_else(|| partner(false)).unwrap_or(l1);
        for l in [l1, l2] {
            used_a.push(l.0);
            used_b.push(l.1);
        }
        out.push([l1, l2]);
    }
    out
}

/// The routes of rank `me` among `all` (every rank's record, in rank order).
/// Pure: every rank computes the same table from the same records.
pub fn plan(all: &[RankPorts], me: usize) -> Result<Plan> {
    let n = all.len();
    if me >= n {
        return Err(Error::InvalidArgument(format!(
            "rank {me} of {n} in route planning"
        )));
    }
    let mut notes = Vec::new();
    let fixed = all.iter().position(|r| r.fixed);
    // Direct links of every pair (lower rank first).
    let mut direct: Vec<Vec<Option<Rails>>> = vec![vec![None; n]; n];
    if fixed.is_none() {
        for a in 0..n {
            for b in a + 1..n {
                let l = links(&all[a], &all[b]);
                let r = rails(&all[a], &all[b], &l);
                if !r.is_empty() {
                    direct[a][b] = Some(r);
                }
            }
        }
    }
    let linked = |x: usize, y: usize| x != y && direct[x.min(y)][x.max(y)].is_some();
    let via = |x: usize, y: usize| {
        (1..n)
            .map(|k| (x + k) % n)
            .find(|&c| c != y && linked(x, c) && linked(c, y))
    };
    let mut routes = vec![None; n];
    let mut forwards = Vec::new();
    for q in (0..n).filter(|&q| q != me) {
        let (lo, hi) = (me.min(q), me.max(q));
        let orient = |(i, j): (usize, usize)| {
            if me == lo {
                Hop { mine: i, theirs: j }
            } else {
                Hop { mine: j, theirs: i }
            }
        };
        routes[q] = Some(if let Some(r) = &direct[lo][hi] {
            Route::Direct {
                rails: r.iter().map(|[a, b]| [orient(*a), orient(*b)]).collect(),
                how: "subnet match",
            }
        } else if let (None, Some(v)) = (fixed, via(me, q)) {
            // Both directions of the pair use the same kind of route.
            Route::Relay { via: v }
        } else {
            let (pa, pb) = (all[lo].primary, all[hi].primary);
            if fixed.is_none() {
                notes.push(format!(
                    "warning: rank {q}: no device of this rank shares a subnet with one of \
                     its ({}; here {}) and no common neighbour relays; using the primary \
                     lanes as on a routed fabric",
                    all[q]
                        .devices
                        .iter()
                        .map(PortAddr::describe)
                        .collect::<Vec<_>>()
                        .join(", "),
                    all[me]
                        .devices
                        .iter()
                        .map(PortAddr::describe)
                        .collect::<Vec<_>>()
                        .join(", ")
                ));
            }
            Route::Direct {
                rails: vec![[orient((pa[0], pb[0])), orient((pa[1], pb[1]))]],
                how: if fixed.is_some() {
                    "ARX_DEVICES on some rank: primary lanes for every peer"
                } else {
                    "no subnet match: primary lanes"
                },
            }
        });
    }
    // Forwarding duties: this rank is the relay of (x, y) for x, y unlinked.
    if fixed.is_none() {
        for x in 0..n {
            for y in (0..n).filter(|&y| y != x && !linked(x, y)) {
                if via(x, y) == Some(me) {
                    forwards.push((x, y));
                }
            }
        }
    }
    if let Some(f) = fixed {
        notes.push(format!(
            "ARX_DEVICES is set on rank {f}: every rank uses its primary lanes for every peer"
        ));
    }
    for (q, r) in routes.iter().enumerate() {
        match r {
            Some(Route::Direct { rails, .. }) => {
                for (k, rail) in rails.iter().enumerate() {
                    if rail[0] == rail[1] {
                        notes.push(format!(
                            "warning: rank {q} rail {k}: one device carries both lanes ({} to \
                             {}): no link on a second PCIe root (address both functions of the \
                             port): about half the bandwidth",
                            all[me].devices[rail[0].mine].name, all[q].devices[rail[0].theirs].name
                        ));
                    }
                }
            }
            Some(Route::Relay { via }) => notes.push(format!(
                "rank {q}: no direct link; partials relayed by rank {via}"
            )),
            None => {}
        }
    }
    Ok(Plan {
        routes,
        forwards,
        notes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dev(name: &str, root: &str, function: u32, ip: [u8; 4], prefix: u8) -> PortAddr {
        PortAddr {
            name: name.into(),
            root: root.into(),
            function,
            ipv4: Some(Ipv4Addr::from(ip)),
            prefix: Some(prefix),
        }
    }

    /// A Spark whose port k root j is on subnet `nets[k][j]` (None: unaddressed),
    /// host byte `h`.
    fn spark(nets: [[Option<[u8; 3]>; 2]; 2], h: u8) -> RankPorts {
        let mut devices = Vec::new();
        for (root, rname) in ["0000:00:00.0", "0002:00:00.0"].iter().enumerate() {
            for (port, net) in nets.iter().enumerate() {
                if let Some(s) = net[root] {
                    devices.push(dev(
                        &format!("r{root}f{port}"),
                        rname,
                        port as u32,
                        [s[0], s[1], s[2], h],
                        24,
                    ));
                }
            }
        }
        RankPorts {
            fixed: false,
            primary: [0, devices.len().min(2) - 1],
            devices,
        }
    }

    fn names(all: &[RankPorts], me: usize, q: usize, p: &Plan) -> Vec<Vec<String>> {
        match &p.routes[q] {
            Some(Route::Direct { rails, .. }) => rails
                .iter()
                .map(|r| {
                    r.iter()
                        .map(|h| {
                            format!(
                                "{}-{}",
                                all[me].devices[h.mine].name, all[q].devices[h.theirs].name
                            )
                        })
                        .collect()
                })
                .collect(),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn record_round_trips_and_rejects_garbage() {
        let r = spark([[Some([10, 0, 0]), Some([10, 0, 2])], [None, None]], 1);
        assert_eq!(RankPorts::decode(3, &r.encode()).unwrap(), r);
        let e = RankPorts::decode(3, &r.encode()[..20]).unwrap_err();
        assert!(
            e.to_string().contains("peer 3") || e.to_string().contains("rank 3"),
            "{e}"
        );
        assert!(RankPorts::decode(1, b"nonsense").is_err());
    }

    #[test]
    fn one_cable_pair_uses_both_roots_of_the_port() {
        let net = [[Some([10, 0, 0]), Some([10, 0, 2])], [None, None]];
        let all = [spark(net, 1), spark(net, 2)];
        for me in 0..2 {
            let p = plan(&all, me).unwrap();
            assert_eq!(names(&all, me, 1 - me, &p), [["r0f0-r0f0", "r1f0-r1f0"]]);
            assert!(p.forwards.is_empty());
            assert!(
                !p.notes.iter().any(|n| n.starts_with("warning")),
                "{:?}",
                p.notes
            );
        }
    }

    #[test]
    fn two_cables_give_two_rails_of_one_port_each() {
        let net = [
            [Some([10, 0, 0]), Some([10, 0, 2])],
            [Some([10, 1, 0]), Some([10, 1, 2])],
        ];
        let all = [spark(net, 1), spark(net, 2)];
        let p = plan(&all, 0).unwrap();
        assert_eq!(
            names(&all, 0, 1, &p),
            [["r0f0-r0f0", "r1f0-r1f0"], ["r0f1-r0f1", "r1f1-r1f1"]]
        );
        let p1 = plan(&all, 1).unwrap();
        assert_eq!(
            names(&all, 1, 0, &p1),
            [["r0f0-r0f0", "r1f0-r1f0"], ["r0f1-r0f1", "r1f1-r1f1"]]
        );
    }

    #[test]
    fn three_ring_reaches_each_peer_through_the_port_cabled_to_it() {
        // Link 0-1 on 10.1.{0,2}, 1-2 on 10.2.{0,2}, 2-0 on 10.3.{0,2}; rank
        // k's port 0 faces k+1, port 1 faces k-1.
        let l = |x: u8| [Some([10, x, 0]), Some([10, x, 2])];
        let all = [
            spark([l(1), l(3)], 1),
            spark([l(2), l(1)], 2),
            spark([l(3), l(2)], 3),
        ];
        let p0 = plan(&all, 0).unwrap();
        assert_eq!(names(&all, 0, 1, &p0), [["r0f0-r0f1", "r1f0-r1f1"]]);
        assert_eq!(names(&all, 0, 2, &p0), [["r0f1-r0f0", "r1f1-r1f0"]]);
        let p2 = plan(&all, 2).unwrap();
        assert_eq!(names(&all, 2, 0, &p2), [["r0f0-r0f1", "r1f0-r1f1"]]);
        assert!(p0.forwards.is_empty() && p2.forwards.is_empty());
    }

    #[test]
    fn four_ring_relays_diagonals_through_the_next_neighbour() {
        // Ring 0-1-2-3-0: link k between k and k+1 on 10.k+1.{0,2}.
        let l = |x: u8| [Some([10, x, 0]), Some([10, x, 2])];
        let all = [
            spark([l(1), l(4)], 1),
            spark([l(2), l(1)], 2),
            spark([l(3), l(2)], 3),
            spark([l(4), l(3)], 4),
        ];
        let plans: Vec<Plan> = (0..4).map(|r| plan(&all, r).unwrap()).collect();
        assert_eq!(plans[0].routes[2], Some(Route::Relay { via: 1 }));
        assert_eq!(plans[2].routes[0], Some(Route::Relay { via: 3 }));
        assert_eq!(plans[1].routes[3], Some(Route::Relay { via: 2 }));
        assert_eq!(plans[3].routes[1], Some(Route::Relay { via: 0 }));
        // Every unlinked ordered pair is forwarded by exactly one rank, and
        // each rank forwards exactly one.
        let mut all_fw: Vec<(usize, usize)> =
            plans.iter().flat_map(|p| p.forwards.clone()).collect();
        all_fw.sort();
        assert_eq!(all_fw, [(0, 2), (1, 3), (2, 0), (3, 1)]);
        assert!(plans.iter().all(|p| p.forwards.len() == 1));
        assert_eq!(plans[1].forwards, [(0, 2)]);
        // Neighbours are direct.
        assert!(matches!(plans[0].routes[1], Some(Route::Direct { .. })));
        assert!(matches!(plans[0].routes[3], Some(Route::Direct { .. })));
    }

    #[test]
    fn switch_one_subnet_per_root_reaches_everyone_on_one_port() {
        let net = [[Some([10, 0, 0]), Some([10, 0, 2])], [None, None]];
        let all: Vec<RankPorts> = (1..=4).map(|h| spark(net, h)).collect();
        for me in 0..4 {
            let p = plan(&all, me).unwrap();
            for q in (0..4).filter(|&q| q != me) {
                assert_eq!(names(&all, me, q, &p), [["r0f0-r0f0", "r1f0-r1f0"]]);
            }
        }
    }

    #[test]
    fn both_roots_on_one_subnet_still_pair_root_with_root() {
        let net = [[Some([10, 0, 0]), Some([10, 0, 0])], [None, None]];
        let mut a = spark(net, 1);
        let mut b = spark(net, 2);
        // Distinct host bytes per root.
        a.devices[1].ipv4 = Some(Ipv4Addr::new(10, 0, 0, 11));
        b.devices[1].ipv4 = Some(Ipv4Addr::new(10, 0, 0, 12));
        let all = [a, b];
        let p = plan(&all, 0).unwrap();
        assert_eq!(names(&all, 0, 1, &p), [["r0f0-r0f0", "r1f0-r1f0"]]);
    }

    #[test]
    fn one_root_addressed_is_one_device_with_a_warning() {
        let net = [[Some([10, 0, 0]), None], [None, None]];
        let all = [spark(net, 1), spark(net, 2)];
        let p = plan(&all, 0).unwrap();
        assert_eq!(names(&all, 0, 1, &p), [["r0f0-r0f0", "r0f0-r0f0"]]);
        assert!(p
            .notes
            .iter()
            .any(|n| n.contains("one device carries both lanes")));
    }

    #[test]
    fn unmatched_subnets_fall_back_to_primary_lanes() {
        // A routed fabric: every rank on its own subnets.
        let all = [
            spark([[Some([10, 0, 0]), Some([10, 0, 2])], [None, None]], 1),
            spark([[Some([10, 9, 0]), Some([10, 9, 2])], [None, None]], 2),
        ];
        let p = plan(&all, 1).unwrap();
        assert_eq!(names(&all, 1, 0, &p), [["r0f0-r0f0", "r1f0-r1f0"]]);
        assert!(
            p.notes.iter().any(|n| n.contains("routed fabric")),
            "{:?}",
            p.notes
        );
    }

    #[test]
    fn arx_devices_on_any_rank_means_primary_lanes_everywhere() {
        let l = |x: u8| [Some([10, x, 0]), Some([10, x, 2])];
        let mut all = vec![
            spark([l(1), l(4)], 1),
            spark([l(2), l(1)], 2),
            spark([l(3), l(2)], 3),
            spark([l(4), l(3)], 4),
        ];
        all[2].fixed = true;
        let p = plan(&all, 0).unwrap();
        assert!(p.forwards.is_empty());
        assert!(
            matches!(p.routes[2], Some(Route::Direct { how, .. }) if how.contains("ARX_DEVICES"))
        );
    }

    /// Every node's selection from its own sysfs fixture, then the plan of
    /// every rank: the cluster shapes of FACTS.md, end to end.
    fn cluster(prefix: &str, nodes: usize) -> (Vec<crate::topology::Selection>, Vec<Plan>) {
        let sels: Vec<_> = (0..nodes)
            .map(|i| crate::topology::test_util::sel(&format!("{prefix}_n{i}"), &[]).unwrap())
            .collect();
        let recs: Vec<RankPorts> = sels.iter().map(|s| s.ports()).collect();
        for (s, r) in sels.iter().zip(&recs) {
            assert!(
                r.devices.iter().all(|d| d.prefix == Some(24)),
                "{:#?}",
                s.candidates
            );
        }
        let plans = (0..nodes).map(|me| plan(&recs, me).unwrap()).collect();
        (sels, plans)
    }

    fn hop_names(
        sels: &[crate::topology::Selection],
        me: usize,
        q: usize,
        p: &Plan,
    ) -> Vec<String> {
        match &p.routes[q] {
            Some(Route::Direct { rails, .. }) => rails
                .iter()
                .flatten()
                .map(|h| {
                    format!(
                        "{}>{}",
                        sels[me].candidates[h.mine].name, sels[q].candidates[h.theirs].name
                    )
                })
                .collect(),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn spark_fixtures_dual_cable_stripes_over_all_four_functions() {
        let (sels, plans) = cluster("spark_dual", 2);
        assert_eq!(sels[0].candidates.len(), 4);
        assert_eq!(
            hop_names(&sels, 0, 1, &plans[0]),
            [
                "rocep1s0f0>rocep1s0f0",
                "roceP2p1s0f0>roceP2p1s0f0",
                "rocep1s0f1>rocep1s0f1",
                "roceP2p1s0f1>roceP2p1s0f1"
            ]
        );
    }

    #[test]
    #[allow(clippy::needless_range_loop)]
    fn spark_fixtures_ring3_routes_each_peer_through_its_own_port() {
        let (sels, plans) = cluster("spark_ring3", 3);
        for me in 0..3 {
            let next = (me + 1) % 3;
            let prev = (me + 2) % 3;
            assert_eq!(
                hop_names(&sels, me, next, &plans[me]),
                ["rocep1s0f0>rocep1s0f1", "roceP2p1s0f0>roceP2p1s0f1"]
            );
            assert_eq!(
                hop_names(&sels, me, prev, &plans[me]),
                ["rocep1s0f1>rocep1s0f0", "roceP2p1s0f1>roceP2p1s0f0"]
            );
            assert!(!plans[me].notes.iter().any(|n| n.starts_with("warning")));
        }
    }

    #[test]
    #[allow(clippy::needless_range_loop)]
    fn spark_fixtures_ring4_relays_only_the_diagonals() {
        let (sels, plans) = cluster("spark_ring4", 4);
        for me in 0..4 {
            assert_eq!(
                hop_names(&sels, me, (me + 1) % 4, &plans[me]),
                ["rocep1s0f0>rocep1s0f1", "roceP2p1s0f0>roceP2p1s0f1"]
            );
            assert_eq!(
                plans[me].routes[(me + 2) % 4],
                Some(Route::Relay { via: (me + 1) % 4 })
            );
            assert_eq!(plans[me].forwards, [((me + 3) % 4, (me + 1) % 4)]);
        }
    }

    #[test]
    #[allow(clippy::needless_range_loop)]
    fn spark_fixtures_switch_uses_port_0_for_everyone() {
        let (sels, plans) = cluster("spark_switch", 4);
        for me in 0..4 {
            assert_eq!(sels[me].candidates.len(), 2);
            for q in (0..4).filter(|&q| q != me) {
                assert_eq!(
                    hop_names(&sels, me, q, &plans[me]),
                    ["rocep1s0f0>rocep1s0f0", "roceP2p1s0f0>roceP2p1s0f0"]
                );
            }
            assert!(plans[me].forwards.is_empty());
        }
    }

    /// The soft-RoCE topologies of `scripts/rxe-vm` (every rxe device is a
    /// root of its own; `n<i>p<k>r<j>` is node i, port k, root j): the
    /// routes the VM runs must take.
    #[test]
    #[allow(clippy::needless_range_loop)]
    fn rxe_fixtures_route_as_the_vm_is_cabled() {
        let (s, p) = cluster("rxe_dual", 2);
        assert_eq!(
            hop_names(&s, 0, 1, &p[0]),
            [
                "n0p0r0>n1p0r0",
                "n0p0r1>n1p0r1",
                "n0p1r0>n1p1r0",
                "n0p1r1>n1p1r1"
            ]
        );
        let (s, p) = cluster("rxe_triangle", 3);
        for me in 0..3 {
            for q in (0..3).filter(|&q| q != me) {
                let h = hop_names(&s, me, q, &p[me]);
                assert_eq!(h.len(), 2, "{h:?}");
                // Both lanes on one port of each node, on both roots.
                for (l, hop) in h.iter().enumerate() {
                    let (a, b) = hop.split_once('>').unwrap();
                    assert!(
                        a.ends_with(&format!("r{l}")) && b.ends_with(&format!("r{l}")),
                        "{h:?}"
                    );
                    assert!(
                        a.starts_with(&format!("n{me}")) && b.starts_with(&format!("n{q}")),
                        "{h:?}"
                    );
                }
                assert_ne!(h[0][..4], hop_names(&s, me, 3 - me - q, &p[me])[0][..4]);
            }
            assert!(p[me].forwards.is_empty());
        }
        let (s, p) = cluster("rxe_ring4", 4);
        for me in 0..4 {
            assert_eq!(
                p[me].routes[(me + 2) % 4],
                Some(Route::Relay { via: (me + 1) % 4 })
            );
            assert_eq!(hop_names(&s, me, (me + 1) % 4, &p[me]).len(), 2);
            assert_eq!(hop_names(&s, me, (me + 3) % 4, &p[me]).len(), 2);
            assert_eq!(p[me].forwards, [((me + 3) % 4, (me + 1) % 4)]);
        }
        let (s, p) = cluster("rxe_switch", 3);
        for me in 0..3 {
            for q in (0..3).filter(|&q| q != me) {
                assert_eq!(
                    hop_names(&s, me, q, &p[me]),
                    [format!("n{me}p0r0>n{q}p0r0"), format!("n{me}p0r1>n{q}p0r1")]
                );
            }
        }
    }
}
