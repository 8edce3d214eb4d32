//! Connecting: open the devices of the lanes the topology chose, create a
//! QP per (peer, lane), exchange endpoint records over MPI, and move every
//! QP to RTS. Each step is agreed across ranks: a failure on one rank fails
//! every rank.

use std::sync::Arc;
use std::time::Instant;

use super::endpoint::{Endpoint, LaneRecord};
use super::ledger::cq_depth;
use super::post::{Link, RemoteRegion};
use super::qp::{Init, Qp, RemoteQp};
use super::wrappers::{Device, DeviceList};
use super::{mtu_bytes, verbs_err, VerbsFabric, LANES, SQ_DEPTH};
use crate::bootstrap::Bootstrap;
use crate::config::{Config, Staging};
use crate::error::{Error, Result};
use crate::fabric::Fabric;
use crate::layout::{Layout, Region};
use crate::topology::{self, LaneDevice, Selection};

/// What `open_local` made: devices, the device of each lane, QPs (in INIT)
/// and the index of (peer, lane) into them.
struct Local {
    devices: Vec<Device>,
    lane_dev: [usize; LANES],
    qps: Vec<Qp<Init>>,
    qp_index: Vec<usize>,
}

fn open_local(layout: &Layout, region: &Arc<Region>, lanes: &[LaneDevice]) -> Result<Local> {
    if lanes.len() != LANES {
        return Err(Error::Topology(format!(
            "selection has {} lanes, the Verbs fabric needs {LANES}",
            lanes.len()
        )));
    }
    let world = layout.world();
    // The distinct devices, in lane order.
    let mut chosen: Vec<&LaneDevice> = Vec::new();
    let mut lane_dev = [0usize; LANES];
    for (l, d) in lanes.iter().enumerate() {
        lane_dev[l] = match chosen.iter().position(|c| c.name == d.name) {
            Some(i) => i,
            None => {
                chosen.push(d);
                chosen.len() - 1
            }
        };
    }
    let qps_per_dev = |i: usize| (world - 1) * lane_dev.iter().filter(|&&d| d == i).count();
    // Pinned by the provider besides the region: send queues (a WQE with
    // inline data takes up to 256 bytes) and CQs (up to 128 bytes a CQE).
    let cqes: usize = (0..chosen.len()).map(|i| cq_depth(qps_per_dev(i))).sum();
    let needed = chosen.len() * region.len()
        + (world - 1) * LANES * (SQ_DEPTH as usize) * 256
        + cqes * 128
        + (1 << 20);
    topology::check_memlock(needed)?;

    let list = DeviceList::get()?;
    let mut devices = Vec::with_capacity(chosen.len());
    for (i, sel) in chosen.iter().enumerate() {
        let depth = u32::try_from(cq_depth(qps_per_dev(i))).map_err(|_| {
            verbs_err(
                "ibv_create_cq",
                &sel.name,
                None,
                None,
                format!("{} QPs need too many CQ entries", qps_per_dev(i)),
            )
        })?;
        devices.push(Device::open(&list, sel, region, depth)?);
    }
    drop(list);

    let mut qps = Vec::with_capacity((world - 1) * LANES);
    let mut qp_index = vec![usize::MAX; world * LANES];
    for q in layout.peers() {
        for lane in 0..LANES {
            qp_index[q * LANES + lane] = qps.len();
            qps.push(Qp::create(&devices[lane_dev[lane]], q, lane)?);
        }
    }
    Ok(Local {
        devices,
        lane_dev,
        qps,
        qp_index,
    })
}

/// Opens the devices of `sel`'s lanes, creates the QPs, exchanges their
/// numbers over `boot` and connects them. Collective: a failure on any rank
/// fails every rank.
pub(crate) fn connect(
    boot: &Bootstrap,
    cfg: &Config,
    layout: &Layout,
    region: &Arc<Region>,
    sel: &Selection,
) -> Result<VerbsFabric> {
    let world = layout.world();
    let me = layout.rank();
    let Local {
        devices,
        lane_dev,
        qps,
        qp_index,
    } = boot.agree("verbs devices", open_local(layout, region, &sel.lanes))?;

    let mine = Endpoint {
        world: world as u32,
        rank: me as u32,
        addr: region.as_ptr() as u64,
        len: region.len() as u64,
        lanes: (0..LANES)
            .map(|lane| {
                let dev = &devices[lane_dev[lane]];
                LaneRecord {
                    gid: dev.gid,
                    gid_index: dev.sel.gid_index,
                    rkey: dev.mr.rkey(),
                    mtu: dev.active_mtu,
                    qps: (0..world)
                        .map(|q| {
                            if q == me {
                                (0, 0)
                            } else {
                                let qp = &qps[qp_index[q * LANES + lane]];
                                (qp.qpn(), qp.psn())
                            }
                        })
                        .collect(),
                }
            })
            .collect(),
    };
    let all = boot.all_gather_bytes("verbs endpoints", &mine.encode())?;

    let connected = (|| -> Result<(Vec<Link>, Vec<RemoteRegion>, [u32; LANES])> {
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
        let mut remote = vec![RemoteRegion { addr: 0, rkey: 0 }; world * LANES];
        let mut path_mtu = [u32::MAX; LANES];
        // In creation order: peers r+1, r+2, …, both lanes of each.
        let links = qps
            .into_iter()
            .map(|qp| {
                let (q, lane) = (qp.peer(), qp.lane());
                let d = lane_dev[lane];
                let theirs = &eps[q].lanes[lane];
                let (qpn, psn) = theirs.qps[me];
                let mtu = devices[d].active_mtu.min(theirs.mtu);
                let far = RemoteQp {
                    gid: theirs.gid,
                    qpn,
                    psn,
                };
                let qp = qp.into_rtr(&far, mtu)?.into_rts()?;
                path_mtu[lane] = path_mtu[lane].min(mtu_bytes(mtu));
                remote[q * LANES + lane] = RemoteRegion {
                    addr: eps[q].addr,
                    rkey: theirs.rkey,
                };
                Ok(Link::new(qp, d))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((links, remote, path_mtu))
    })();
    // Also the barrier: nobody writes before every peer's QPs are in RTR.
    let (links, remote, path_mtu) = boot.agree("verbs connect", connected)?;

    let fabric = VerbsFabric {
        links,
        devices,
        lane_dev,
        link_index: qp_index,
        remote,
        layout: *layout,
        base: region.as_ptr() as u64,
        timeout: cfg.timeout,
        path_mtu,
        last_seq: 0,
        last_post: Instant::now(),
        signal_each_call: cfg.staging == Staging::CopyEngine,
        tail: false,
        failed: None,
        polls: 0,
    };
    log::info!("arx verbs: rank {me}: {}", fabric.describe());
    Ok(fabric)
}
