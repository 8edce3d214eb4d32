//! Device and lane choice: which devices carry lane 0 and lane 1 (function
//! k of two PCIe roots, for the lowest k ACTIVE on both), each lane's port,
//! GID and MTU, and warnings about the PCIe links they sit behind.

use std::collections::BTreeSet;

use super::gid::resolve_gid;
use super::sysfs::parse_gts;
use super::{DeviceInfo, Discovery, LaneDevice, PciLink, WARN};
use crate::config::Config;
use crate::error::{Error, Result};

fn describe_ports(d: &DeviceInfo) -> String {
    if d.ports.is_empty() {
        return "no ports".into();
    }
    d.ports
        .iter()
        .map(|p| {
            format!(
                "port {} {}{}",
                p.port,
                if p.state.is_empty() { "?" } else { &p.state },
                if p.phys_state.is_empty() {
                    String::new()
                } else {
                    format!(" / {}", p.phys_state)
                }
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

fn describe_found(devs: &[DeviceInfo]) -> String {
    devs.iter()
        .map(|d| format!("{} (root {}, {})", d.name, d.root, describe_ports(d)))
        .collect::<Vec<_>>()
        .join("; ")
}

fn lane(
    d: &DeviceInfo,
    disc: &Discovery,
    cfg: &Config,
    notes: &mut Vec<String>,
) -> Result<LaneDevice> {
    let Some(port) = d.active_port() else {
        return Err(Error::Topology(format!(
            "{} has no ACTIVE port ({}); cable it or bring the link up (ip link set <netdev> up)",
            d.name,
            describe_ports(d)
        )));
    };
    let (g, netdev) = resolve_gid(d, port, cfg, notes)?;
    let active_mtu = match port.active_mtu {
        Some((m, how)) => {
            notes.push(format!("{}: active MTU {m} ({how})", d.name));
            m
        }
        None => {
            notes.push(format!(
                "{WARN}{}: active MTU unknown (no active_mtu, no netdev MTU); assuming 1024",
                d.name
            ));
            1024
        }
    };
    let ipv4 = g
        .is_ipv4_mapped()
        .then(|| std::net::Ipv4Addr::new(g.gid[12], g.gid[13], g.gid[14], g.gid[15]));
    // The prefix of that address on its netdev (else on any netdev: a
    // bond or bridge above it holds the address).
    let prefix = ipv4.and_then(|a| {
        let on = |nd: Option<&str>| {
            disc.addrs
                .iter()
                .find(|x| x.addr == a && nd.map_or(true, |nd| x.netdev == nd))
                .map(|x| x.prefix)
        };
        on(Some(&netdev)).or_else(|| on(None))
    });
    Ok(LaneDevice {
        name: d.name.clone(),
        port: port.port,
        gid_index: g.index,
        gid: g.gid,
        active_mtu,
        netdev,
        pci: d.pci.clone(),
        root: d.root.clone(),
        function: d.function(),
        ipv4,
        prefix,
    })
}

/// Every device that could carry a lane (see [`Selection::candidates`]):
/// with `ARX_DEVICES`, the chosen lanes' devices; otherwise each device,
/// virtual functions aside, whose port is ACTIVE with a RoCE v2 IPv4 GID, in
/// discovery order.
///
/// [`Selection::candidates`]: super::Selection::candidates
pub(crate) fn candidates(disc: &Discovery, lanes: &[LaneDevice], cfg: &Config) -> Vec<LaneDevice> {
    let mut out: Vec<LaneDevice> = Vec::new();
    if cfg.devices.is_some() {
        for l in lanes {
            if !out.iter().any(|c| c.name == l.name) {
                out.push(l.clone());
            }
        }
        return out;
    }
    for d in disc.devices.iter().filter(|d| !d.virtual_function) {
        if let Some(l) = lanes.iter().find(|l| l.name == d.name) {
            out.push(l.clone());
        } else if d.active_port().is_some() {
            if let Ok(l) = lane(d, disc, cfg, &mut Vec::new()) {
                if l.ipv4.is_some() {
                    out.push(l);
                }
            }
        }
    }
    out
}

/// Chooses the lane devices among `devs` (without overrides), counting a
/// device as up when `up` says so.
fn choose_devices<'a>(
    devs: &'a [DeviceInfo],
    notes: &mut Vec<String>,
    up: &dyn Fn(&DeviceInfo) -> bool,
) -> Result<Vec<&'a DeviceInfo>> {
    let usable: Vec<&DeviceInfo> = devs.iter().filter(|d| !d.virtual_function).collect();
    // Roots in lane order: PCI roots by address (lower domain first), then
    // software devices by name.
    let mut roots: Vec<(u8, u32, u32, u32, u32, String)> =
        usable.iter().map(|d| d.root_key()).collect();
    roots.sort();
    roots.dedup();
    let root_of = |d: &DeviceInfo| roots.iter().position(|r| *r == d.root_key());
    let functions: BTreeSet<u32> = usable.iter().map(|d| d.function()).collect();
    for &k in &functions {
        let mut per_root: Vec<&DeviceInfo> = Vec::new();
        for r in 0..roots.len() {
            let mut c: Vec<&DeviceInfo> = usable
                .iter()
                .copied()
                .filter(|d| root_of(d) == Some(r) && d.function() == k && up(d))
                .collect();
            c.sort_by(|a, b| a.pci.cmp(&b.pci).then(a.name.cmp(&b.name)));
            if let Some(d) = c.first() {
                per_root.push(d);
            }
        }
        if per_root.len() >= 2 {
            let (a, b) = (per_root[0], per_root[1]);
            notes.push(format!(
                "lanes: {} (root {}) + {} (root {}): function/port {k} is ACTIVE on both roots",
                a.name, a.root, b.name, b.root
            ));
            let skipped: Vec<String> = usable
                .iter()
                .filter(|d| d.function() < k)
                .map(|d| format!("{} {}", d.name, describe_ports(d)))
                .collect();
            if !skipped.is_empty() {
                notes.push(format!(
                    "lower ports not ACTIVE (with a RoCE v2 IPv4 GID) on two roots: {}",
                    skipped.join("; ")
                ));
            }
            if per_root.len() > 2 {
                notes.push(format!(
                    "{} roots have port {k} ACTIVE; using the first two",
                    per_root.len()
                ));
            }
            return Ok(vec![a, b]);
        }
    }
    // No port active on two roots: one device carries both lanes.
    let mut active: Vec<&DeviceInfo> = usable.iter().copied().filter(|d| up(d)).collect();
    active.sort_by_key(|d| (root_of(d), d.function(), d.name.clone()));
    let Some(d) = active.first() else {
        return Err(Error::Topology(format!(
            "no RDMA device has an ACTIVE port (found: {}). Cable a port, check the link \
             (ip link; rdma link), or name devices with ARX_DEVICES",
            describe_found(devs)
        )));
    };
    let why = if roots.len() < 2 {
        format!(
            "the NIC has one PCIe root ({}); both lanes use {}: expect about half the \
             bandwidth of a two-root Spark",
            d.root, d.name
        )
    } else {
        format!(
            "no port is ACTIVE on two PCIe roots (found: {}); both lanes use {}: about half \
             the bandwidth. Cable/enable the same port on the other root",
            describe_found(devs),
            d.name
        )
    };
    notes.push(format!("{WARN}{why}"));
    Ok(vec![d, d])
}

/// The lane devices of a [`Discovery`]: the ones `ARX_DEVICES` names, else
/// function k of two PCIe roots (see [`choose_devices`]), preferring a port
/// that is addressed on both roots over one that is merely ACTIVE.
pub(super) fn lane_devices<'a>(
    disc: &'a Discovery,
    cfg: &Config,
    notes: &mut Vec<String>,
) -> Result<Vec<&'a DeviceInfo>> {
    match &cfg.devices {
        Some(names) => {
            if names.is_empty() || names.len() > 2 {
                return Err(Error::Topology(format!(
                    "ARX_DEVICES must name one or two RDMA devices, got {names:?}"
                )));
            }
            let mut v = Vec::new();
            for n in names {
                let Some(d) = disc.devices.iter().find(|d| &d.name == n) else {
                    return Err(Error::Topology(format!(
                        "ARX_DEVICES names {n}, which does not exist (found: {}); fix or \
                         unset ARX_DEVICES",
                        describe_found(&disc.devices)
                    )));
                };
                v.push(d);
            }
            if v.len() == 1 {
                v.push(v[0]);
            }
            notes.push(format!(
                "lanes from ARX_DEVICES (override): {} + {}",
                v[0].name, v[1].name
            ));
            if v[0].name != v[1].name && v[0].root == v[1].root {
                notes.push(format!(
                    "{WARN}ARX_DEVICES: {} and {} share PCIe root {}; both lanes share one link",
                    v[0].name, v[1].name, v[0].root
                ));
            }
            Ok(v)
        }
        None => {
            // Prefer a port that is ACTIVE and addressed (has the GID the
            // lane needs) on two roots; failing that, a port ACTIVE on two
            // roots, so that a missing address is reported as such rather
            // than silently halving the bandwidth; then one root.
            let addressed = |d: &DeviceInfo| {
                d.active_port()
                    .is_some_and(|p| resolve_gid(d, p, cfg, &mut Vec::new()).is_ok())
            };
            let active = |d: &DeviceInfo| d.active_port().is_some();
            let two = |r: &Result<Vec<&DeviceInfo>>| {
                r.as_ref()
                    .is_ok_and(|v| v.len() == 2 && v[0].name != v[1].name)
            };
            let (mut n1, mut n2) = (Vec::new(), Vec::new());
            let by_gid = choose_devices(&disc.devices, &mut n1, &addressed);
            let by_link = choose_devices(&disc.devices, &mut n2, &active);
            let (r, n) = if two(&by_gid) || (!two(&by_link) && by_gid.is_ok()) {
                (by_gid, n1)
            } else {
                (by_link, n2)
            };
            notes.extend(n);
            r
        }
    }
}

/// Each chosen device's lane (a device chosen twice gives one lane twice).
pub(super) fn lanes_on(
    chosen: &[&DeviceInfo],
    disc: &Discovery,
    cfg: &Config,
    notes: &mut Vec<String>,
) -> Result<Vec<LaneDevice>> {
    let mut lanes = Vec::with_capacity(2);
    for d in chosen {
        if let Some(l) = lanes.iter().find(|l: &&LaneDevice| l.name == d.name) {
            lanes.push(l.clone());
            continue;
        }
        lanes.push(lane(d, disc, cfg, notes)?);
    }
    if lanes[0].active_mtu != lanes[1].active_mtu {
        notes.push(format!(
            "{WARN}lane MTUs differ ({} {} vs {} {})",
            lanes[0].name, lanes[0].active_mtu, lanes[1].name, lanes[1].active_mtu
        ));
    }
    Ok(lanes)
}

pub(super) fn pcie_notes(lanes: &[&DeviceInfo], notes: &mut Vec<String>) {
    let mut links = Vec::new();
    for d in lanes {
        let Some(l) = &d.link else { continue };
        notes.push(format!(
            "{}: PCIe {} x{} (max {} x{})",
            d.name,
            l.speed,
            l.width,
            l.max_speed.as_deref().unwrap_or("?"),
            l.max_width
                .map(|w| w.to_string())
                .unwrap_or_else(|| "?".into())
        ));
        if let Some(mw) = l.max_width {
            if l.width < mw {
                notes.push(format!(
                    "{WARN}{}: PCIe link trained at x{} of x{}; check the BIOS/firmware \
                     (some units run the second root at x2)",
                    d.name, l.width, mw
                ));
            }
        }
        if let Some(ms) = &l.max_speed {
            if l.gts() + 0.01 < parse_gts(ms) {
                notes.push(format!(
                    "{WARN}{}: PCIe link runs at {} of {ms}",
                    d.name, l.speed
                ));
            }
        }
        links.push((d, l));
    }
    if links.len() == 2 && links[0].0.name != links[1].0.name {
        let bw = |l: &PciLink| l.gts() * l.width as f32;
        let (a, b) = (&links[0], &links[1]);
        if (bw(a.1) - bw(b.1)).abs() > 0.01 {
            let (narrow, wide) = if bw(a.1) < bw(b.1) { (a, b) } else { (b, a) };
            notes.push(format!(
                "{WARN}root {} ({}) is narrower than root {} ({}): {} x{} vs {} x{}; that lane \
                 limits the split (update the BIOS; ASUS GX10/older BIOS run one root at x2)",
                narrow.0.root,
                narrow.0.name,
                wide.0.root,
                wide.0.name,
                narrow.1.speed,
                narrow.1.width,
                wide.1.speed,
                wide.1.width
            ));
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::topology::test_util::{has_note, names, sel};

    #[test]
    fn one_port_cabled_pairs_that_function_on_both_roots() {
        let s = sel("spark_port1", &[]).unwrap();
        assert_eq!(names(&s), ["rocep1s0f1", "roceP2p1s0f1"]);
        assert_eq!(s.lanes[0].root, "0000:00:00.0");
        assert_eq!(s.lanes[1].root, "0002:00:00.0");
        assert_eq!(s.lanes[0].pci.as_deref(), Some("0000:01:00.1"));
        assert_eq!(s.lanes[1].pci.as_deref(), Some("0002:01:00.1"));
        assert_eq!(s.lanes[0].netdev, "enp1s0f1np1");
        assert_eq!(s.lanes[1].netdev, "enP2p1s0f1np1");
        assert_eq!(s.lanes[0].port, 1);
        assert!(!s.single_device());
        assert_eq!(s.warnings().count(), 0, "{:#?}", s.notes);
    }

    #[test]
    fn both_ports_cabled_chooses_port_0_deterministically() {
        let a = sel("spark_both", &[]).unwrap();
        assert_eq!(names(&a), ["rocep1s0f0", "roceP2p1s0f0"]);
        for _ in 0..3 {
            let b = sel("spark_both", &[]).unwrap();
            assert_eq!(a.lanes, b.lanes);
            assert_eq!(a.proxy_cpu, b.proxy_cpu);
        }
        assert_eq!(a.lanes[0].gid_index, 3);
        assert_eq!(a.lanes[0].gid[10..], [0xff, 0xff, 10, 0, 0, 10]);
        assert_eq!(a.lanes[1].gid[10..], [0xff, 0xff, 10, 0, 2, 10]);
        // Netdev MTU 4200 less RoCE headers gives 4096 (FACTS.md).
        assert_eq!(a.lanes[0].active_mtu, 4096);
    }

    #[test]
    fn active_but_unaddressed_port_is_passed_over() {
        // All four links up, IPv4 only on port 1: port 1 is chosen.
        let s = sel("spark_ip_on_port1", &[]).unwrap();
        assert_eq!(names(&s), ["rocep1s0f1", "roceP2p1s0f1"]);
        assert_eq!(s.warnings().count(), 0, "{:#?}", s.notes);
        // Addressed on one root only: the other root's missing address is
        // the error, not a silent single-root run.
        let e = sel("spark_ip_one_root", &[]).unwrap_err();
        assert!(
            e.to_string().contains("roceP2p1s0f0") && e.to_string().contains("ip addr add"),
            "{e}"
        );
    }

    #[test]
    fn port_down_on_one_root_is_not_chosen() {
        let s = sel("spark_down_one_root", &[]).unwrap();
        assert_eq!(names(&s), ["rocep1s0f1", "roceP2p1s0f1"]);
        assert!(has_note(&s, "2: Polling"), "{:#?}", s.notes);
    }

    #[test]
    fn narrow_root_is_a_warning() {
        let s = sel("spark_x2", &[]).unwrap();
        assert_eq!(names(&s), ["rocep1s0f0", "roceP2p1s0f0"]);
        let w: Vec<&str> = s.warnings().collect();
        assert!(
            w.iter()
                .any(|n| n.contains("x2 of x4") && n.contains("roceP2p1s0f0")),
            "{w:#?}"
        );
        assert!(
            w.iter()
                .any(|n| n.contains("root 0002:00:00.0 (roceP2p1s0f0) is narrower")),
            "{w:#?}"
        );
        // The same machine at x4 has no PCIe warning.
        let ok = sel("spark_both", &[]).unwrap();
        assert!(
            ok.warnings().all(|n| !n.contains("PCIe")),
            "{:#?}",
            ok.notes
        );
    }

    #[test]
    fn single_root_nic_uses_one_device_for_both_lanes() {
        let s = sel("single_root", &[]).unwrap();
        assert_eq!(names(&s), ["rocep1s0f0", "rocep1s0f0"]);
        assert!(s.single_device());
        assert!(
            s.warnings().any(|n| n.contains("one PCIe root")),
            "{:#?}",
            s.notes
        );
    }

    #[test]
    fn two_rxe_devices_are_two_roots() {
        let s = sel("rxe2", &[]).unwrap();
        assert_eq!(names(&s), ["rxe0", "rxe1"]);
        for (i, l) in s.lanes.iter().enumerate() {
            assert_eq!(l.pci, None);
            assert_eq!(l.root, l.name);
            assert_eq!(l.gid_index, 1);
            assert_eq!(l.gid[12..], [10, 77, 0, i as u8 + 1]);
            // Netdev MTU 1500 less RoCE headers gives 1024.
            assert_eq!(l.active_mtu, 1024);
        }
        assert_eq!(s.lanes[0].netdev, "veth0"); // from `parent`
        assert_eq!(s.lanes[1].netdev, "veth2"); // from gid_attrs/ndevs/0
        assert_eq!(s.warnings().count(), 0, "{:#?}", s.notes);
    }

    #[test]
    fn arx_devices_override_is_honoured_in_its_order() {
        let s = sel("spark_both", &[("ARX_DEVICES", "roceP2p1s0f1,rocep1s0f1")]).unwrap();
        assert_eq!(names(&s), ["roceP2p1s0f1", "rocep1s0f1"]);
        assert!(has_note(&s, "ARX_DEVICES"), "{:#?}", s.notes);

        let one = sel("spark_both", &[("ARX_DEVICES", "rocep1s0f1")]).unwrap();
        assert_eq!(names(&one), ["rocep1s0f1", "rocep1s0f1"]);

        let same_root = sel("spark_both", &[("ARX_DEVICES", "rocep1s0f0,rocep1s0f1")]).unwrap();
        assert!(same_root.warnings().any(|n| n.contains("share PCIe root")));

        let e = sel("spark_both", &[("ARX_DEVICES", "mlx5_9")]).unwrap_err();
        assert!(e.to_string().contains("mlx5_9") && e.to_string().contains("rocep1s0f0"));

        // A named device whose port is down is an error, not a silent hang.
        let e = sel("spark_port1", &[("ARX_DEVICES", "rocep1s0f0,roceP2p1s0f0")]).unwrap_err();
        assert!(e.to_string().contains("no ACTIVE port"), "{e}");
    }

    #[test]
    fn a_gid_that_moved_since_start_up_is_named() {
        use crate::topology::gid_drift;
        use crate::topology::test_util::{cfg_with, fixture};
        let s = sel("spark_both", &[]).unwrap();
        let lane1 = &s.lanes[1];
        assert_eq!(lane1.name, "roceP2p1s0f0");
        // Unchanged: the same tree.
        assert_eq!(
            gid_drift(&fixture("spark_both"), lane1, &cfg_with(&[])),
            None
        );
        // The same device's IPv4 RoCE v2 GID now at index 4 (a link flap).
        let d = gid_drift(&fixture("spark_gid_3_and_4"), lane1, &cfg_with(&[])).unwrap();
        assert!(
            d.contains("GID[3]") && d.contains("GID[4]") && d.contains("restart"),
            "{d}"
        );
        // Address gone (port 0's IPv4 removed): named, with the old GID.
        let d = gid_drift(&fixture("spark_ip_on_port1"), &s.lanes[0], &cfg_with(&[])).unwrap();
        assert!(
            d.contains("no longer has the GID") && d.contains("10.0.0.10"),
            "{d}"
        );
    }
}
