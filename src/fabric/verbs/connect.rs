//! Connecting: learn every rank's addressed devices, plan the routes
//! ([`route::plan`]), open the devices the routes use, create a QP per
//! (peer, rail, lane), exchange endpoint records over MPI, and move every
//! QP to RTS. Each step is agreed across ranks: a failure on one rank fails
//! every rank.

use std::sync::Arc;
use std::time::Instant;

use super::endpoint::{DeviceRecord, Endpoint, HopRecord};
use super::ledger::cq_depth;
use super::post::{Link, RemoteRegion};
use super::qp::{Init, Qp, RemoteQp};
use super::relay::Relay;
use super::wrappers::{Device, DeviceList};
use super::{mtu_bytes, verbs_err, VerbsFabric, LANES, SQ_DEPTH};
use crate::bootstrap::Bootstrap;
use crate::config::{Config, Staging};
use crate::error::{Error, Result};
use crate::fabric::Fabric;
use crate::layout::{Layout, Region};
use crate::topology::route::{self, Plan, RankPorts, Route};
use crate::topology::{self, Selection};

/// What `open_local` made: the devices the routes use, the candidate index
/// of each, QPs (in INIT) and, per peer, rail and lane, the QP's index.
struct Local {
    devices: Vec<Device>,
    /// `cand[i]`: the index in [`Selection::candidates`] of `devices[i]`.
    cand: Vec<usize>,
    qps: Vec<Qp<Init>>,
    /// `rails[q][rail][lane]`: index into `qps` (and later the links).
    rails: Vec<Vec<[usize; LANES]>>,
}

fn direct(plan: &Plan, q: usize) -> &[[route::Hop; 2]] {
    match &plan.routes[q] {
        Some(Route::Direct { rails, .. }) => rails,
        _ => &[],
    }
}

fn open_local(
    layout: &Layout,
    region: &Arc<Region>,
    sel: &Selection,
    plan: &Plan,
) -> Result<Local> {
    let world = layout.world();
    // The candidates some route uses, in candidate order; QPs per device.
    let mut cand: Vec<usize> = Vec::new();
    let mut qps_on: Vec<usize> = Vec::new();
    for q in layout.peers() {
        for rail in direct(plan, q) {
            for hop in rail {
                let i = match cand.iter().position(|&c| c == hop.mine) {
                    Some(i) => i,
                    None => {
                        cand.push(hop.mine);
                        qps_on.push(0);
                        cand.len() - 1
                    }
                };
                qps_on[i] += 1;
            }
        }
    }
    if cand.iter().any(|&c| c >= sel.candidates.len()) {
        return Err(Error::Topology(format!(
            "route plan names device {:?} of {} candidates",
            cand,
            sel.candidates.len()
        )));
    }
    let nqps: usize = qps_on.iter().sum();
    // Pinned by the provider besides the region: send queues (a WQE with
    // inline data takes up to 256 bytes) and CQs (up to 128 bytes a CQE).
    let cqes: usize = qps_on.iter().map(|&n| cq_depth(n)).sum();
    let needed =
        cand.len() * region.len() + nqps * (SQ_DEPTH as usize) * 256 + cqes * 128 + (1 << 20);
    topology::check_memlock(needed)?;

    let list = DeviceList::get()?;
    let mut devices = Vec::with_capacity(cand.len());
    for (i, &c) in cand.iter().enumerate() {
        let d = &sel.candidates[c];
        let depth = u32::try_from(cq_depth(qps_on[i])).map_err(|_| {
            verbs_err(
                "ibv_create_cq",
                &d.name,
                None,
                None,
                format!("{} QPs need too many CQ entries", qps_on[i]),
            )
        })?;
        devices.push(Device::open(&list, d, region, depth)?);
    }
    drop(list);

    let mut qps = Vec::with_capacity(nqps);
    let mut rails = vec![Vec::new(); world];
    for q in layout.peers() {
        for rail in direct(plan, q) {
            let mut ix = [usize::MAX; LANES];
            for (lane, hop) in rail.iter().enumerate() {
                let d = cand.iter().position(|&c| c == hop.mine).unwrap_or(0);
                ix[lane] = qps.len();
                qps.push(Qp::create(&devices[d], q, lane)?);
            }
            rails[q].push(ix);
        }
    }
    Ok(Local {
        devices,
        cand,
        qps,
        rails,
    })
}

/// `e`, with what changed if `dev`'s GID is no longer what start-up
/// resolved (the usual cause of a QP that cannot reach RTR or that fails).
pub(super) fn with_gid_drift(e: Error, dev: &topology::LaneDevice, cfg: &Config) -> Error {
    match topology::gid_drift(std::path::Path::new("/"), dev, cfg) {
        Some(d) => e.with_verbs_detail("; ", &d),
        None => e,
    }
}

/// This rank's route plan, and every rank's device names (for `describe`
/// and the rail probe). Collective.
fn plan_routes(boot: &Bootstrap, sel: &Selection, me: usize) -> Result<(Plan, Vec<Vec<String>>)> {
    let all = boot.all_gather_bytes("verbs routes", &sel.ports().encode())?;
    let planned = (|| {
        let recs = all
            .iter()
            .enumerate()
            .map(|(r, b)| RankPorts::decode(r, b))
            .collect::<Result<Vec<_>>>()?;
        let names = recs
            .iter()
            .map(|r| r.devices.iter().map(|d| d.name.clone()).collect())
            .collect::<Vec<Vec<String>>>();
        Ok((route::plan(&recs, me)?, names))
    })();
    let (plan, names) = boot.agree("verbs routes", planned)?;
    for n in &plan.notes {
        match n.strip_prefix("warning: ") {
            Some(w) => log::warn!("arx verbs: rank {me}: {w}"),
            None => log::info!("arx verbs: rank {me}: {n}"),
        }
    }
    Ok((plan, names))
}

/// Plans the routes, opens the devices they use, creates the QPs, exchanges
/// their numbers over `boot` and connects them. Collective: a failure on
/// any rank fails every rank.
pub(crate) fn connect(
    boot: &Bootstrap,
    cfg: &Config,
    layout: &Layout,
    region: &Arc<Region>,
    sel: &Selection,
) -> Result<VerbsFabric> {
    let world = layout.world();
    let me = layout.rank();
    let (plan, names) = plan_routes(boot, sel, me)?;
    let Local {
        devices,
        cand,
        qps,
        rails,
    } = boot.agree("verbs devices", open_local(layout, region, sel, &plan))?;

    let mine = Endpoint {
        world: world as u32,
        rank: me as u32,
        addr: region.as_ptr() as u64,
        len: region.len() as u64,
        devices: devices
            .iter()
            .map(|d| DeviceRecord {
                gid: d.gid,
                gid_index: d.sel.gid_index,
                rkey: d.mr.rkey(),
                mtu: d.active_mtu,
            })
            .collect(),
        peers: (0..world)
            .map(|q| {
                rails[q]
                    .iter()
                    .zip(direct(&plan, q))
                    .map(|(ix, hops)| {
                        [0, 1].map(|lane| {
                            let qp = &qps[ix[lane]];
                            HopRecord {
                                dev: cand.iter().position(|&c| c == hops[lane].mine).unwrap_or(0)
                                    as u16,
                                qpn: qp.qpn(),
                                psn: qp.psn(),
                            }
                        })
                    })
                    .collect()
            })
            .collect(),
    };
    let all = boot.all_gather_bytes("verbs endpoints", &mine.encode())?;

    let connected = (|| -> Result<Vec<Link>> {
        if all.len() != world {
            return Err(Error::Mpi {
                call: "MPI_Iallgather",
                detail: format!("{} endpoint records for {world} ranks", all.len()),
            });
        }
        let eps = all
            .iter()
            .enumerate()
            .map(|(r, b)| Endpoint::decode(r, world, region.len(), b))
            .collect::<Result<Vec<_>>>()?;
        // Rail r lane l to q: this rank's QP at rails[q][r][l], q's at
        // eps[q].peers[me][r][l]. Both ends planned the same rails.
        let mut where_: Vec<(usize, usize, usize)> = vec![(0, 0, 0); qps.len()];
        for q in 0..world {
            let theirs = eps[q].peers.get(me).map_or(0, Vec::len);
            if q != me && theirs != rails[q].len() {
                return Err(Error::PeerFailed {
                    peer: q,
                    reason: format!(
                        "it planned {theirs} rail(s) to rank {me}, this rank {} to it: the \
                         ranks' route plans differ (different arx builds or settings?)",
                        rails[q].len()
                    ),
                });
            }
            for (r, ix) in rails[q].iter().enumerate() {
                for (l, &i) in ix.iter().enumerate() {
                    where_[i] = (q, r, l);
                }
            }
        }
        qps.into_iter()
            .enumerate()
            .map(|(i, qp)| {
                let (q, r, lane) = where_[i];
                let hops = direct(&plan, q)[r][lane];
                let d = cand.iter().position(|&c| c == hops.mine).unwrap_or(0);
                let hop = eps[q].peers[me][r][lane];
                let dev = &eps[q].devices[hop.dev as usize];
                let mtu = devices[d].active_mtu.min(dev.mtu);
                let far = RemoteQp {
                    gid: dev.gid,
                    qpn: hop.qpn,
                    psn: hop.psn,
                };
                let qp = qp
                    .into_rtr(&far, mtu)
                    .and_then(|q| q.into_rts())
                    .map_err(|e| with_gid_drift(e, &devices[d].sel, cfg))?;
                Ok(Link::new(
                    qp,
                    d,
                    r,
                    RemoteRegion {
                        addr: eps[q].addr,
                        rkey: dev.rkey,
                    },
                    dev.gid,
                    (
                        names[q].get(hops.theirs).cloned().unwrap_or_default(),
                        dev.gid_index,
                    ),
                    mtu_bytes(mtu),
                ))
            })
            .collect()
    })();
    // Also the barrier: nobody writes before every peer's QPs are in RTR.
    let links = boot.agree("verbs connect", connected)?;

    let relays = plan
        .forwards
        .iter()
        .map(|&(from, to)| Relay::new(from, to))
        .collect();
    let fabric = VerbsFabric {
        links,
        devices,
        rails,
        relays,
        probe_words: vec![0; world],
        probe_last: None,
        plan,
        layout: *layout,
        base: region.as_ptr() as u64,
        timeout: cfg.timeout,
        last_seq: 0,
        last_post: Instant::now(),
        signal_each_call: cfg.staging == Staging::CopyEngine,
        tail: false,
        failed: None,
        departed: false,
        polls: 0,
        cfg: cfg.clone(),
        region: Arc::clone(region),
        _claim: crate::topology::CpuClaim::new(sel.proxy_cpu.into_iter().collect()),
    };
    log::info!("arx verbs: rank {me}: {}", fabric.describe());
    Ok(fabric)
}
