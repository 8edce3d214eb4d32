//! Construction of an instance after the settings were agreed: device side,
//! layout, peers' descriptions, fabric (and, over Verbs, the topology),
//! device side, proxy, start-up barrier. Every step is collective and runs
//! the same collectives on every rank whatever the settings, so that a
//! failure on one rank fails every rank instead of desynchronising them.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::bootstrap::Bootstrap;
use crate::config::{Config, DeviceKind, FabricKind};
use crate::device::{self, Device, Side};
use crate::error::{Error, Result};
use crate::fabric::{self, Fabric};
use crate::layout::{Layout, Region};
use crate::proxy::Proxy;
use crate::wire::{self, PeerInfo};
use crate::{topology, Arx};

pub(crate) fn establish(mut boot: Bootstrap, cfg: Config) -> Result<Arx> {
    let world = boot.world();
    let rank = boot.rank();

    // Device side. Auto takes the GPU only if every rank can, so that
    // all ranks run the same side (and a rank without a GPU does not
    // fail a job that never asked for one). The availability is
    // exchanged whatever the setting, so that every rank runs the same
    // collectives; the host side does not probe (no driver loading).
    let probe = match cfg.device {
        DeviceKind::Host => Err(Error::Unavailable {
            what: "the GPU device side",
            reason: "not probed (ARX_DEVICE=host)".into(),
        }),
        _ => device::gpu::device_count().map(|_| ()),
    };
    let avail = boot.all_gather_bytes(
        "GPU availability",
        &match &probe {
            Ok(()) => vec![1],
            Err(e) => [&[0u8][..], e.to_string().as_bytes()].concat(),
        },
    )?;
    let missing = avail.iter().position(|b| b.first() != Some(&1));
    let peer_text =
        |r: usize| String::from_utf8_lossy(avail[r].get(1..).unwrap_or_default()).into_owned();
    let want_gpu = match cfg.device {
        DeviceKind::Host => false,
        DeviceKind::Gpu => {
            probe?;
            if let Some(r) = missing {
                return Err(Error::PeerFailed {
                    peer: r,
                    reason: peer_text(r),
                });
            }
            true
        }
        DeviceKind::Auto => match missing {
            None => true,
            Some(r) => {
                match auto_fallback_warning(&avail, r) {
                    Some(w) if rank == 0 => log::warn!("{w}"),
                    _ => log::debug!("arx: device side auto: host (rank {r}: {})", peer_text(r)),
                }
                false
            }
        },
    };
    let device_code = if want_gpu {
        DeviceKind::Gpu.code()
    } else {
        DeviceKind::Host.code()
    };
    let layout = boot.agree("layout", Layout::agreed(&boot, world, rank, cfg.slot_bytes))?;

    // Everyone's description, validated identically on every rank.
    let me = PeerInfo::local(world, rank, layout.slot_bytes(), cfg.fabric, device_code);
    let infos = wire::validate(&boot.all_gather_bytes("PeerInfo", &me.encode())?)?;
    let one_node = infos.iter().all(|p| p.host == infos[0].host);
    let local_ranks = infos.iter().filter(|p| p.host == infos[rank].host).count();
    let mut cfg = cfg;
    cfg.spin_hot = Some(cfg.hot_rounds(local_ranks));
    let fabric_kind = match cfg.fabric {
        FabricKind::Auto if one_node => FabricKind::Shm,
        FabricKind::Auto => FabricKind::Verbs,
        k => k,
    };
    // The resolved settings name the fabric in use (the automatic
    // algorithm's thresholds depend on it: `Algo::choose`).
    cfg.fabric = fabric_kind;
    if cfg.spin == crate::config::SpinMode::Hot
        && infos[..rank].iter().all(|p| p.host != infos[rank].host)
    {
        // (Once per node: its lowest rank.)
        let copy = match fabric_kind {
            FabricKind::Shm => cfg.copy_threads(local_ranks),
            _ => 0,
        };
        let online = crate::config::online_cpus().unwrap_or(1);
        if let Some(w) = hot_oversubscribed(local_ranks, 2 + copy, online) {
            log::warn!("{w}");
        }
    }
    if fabric_kind == FabricKind::Shm && !one_node {
        let other = infos
            .iter()
            .position(|p| p.host != infos[0].host)
            .unwrap_or(0);
        return Err(Error::Mismatch {
            what: "node (the shm fabric needs every rank on one node)",
            rank: other,
            ours: infos[0].host.clone(),
            theirs: infos[other].host.clone(),
        });
    }

    // The CUDA context: this rank's index among the ranks of its node
    // picks the device unless one was set.
    let ranks_on_node = infos.iter().filter(|p| p.host == infos[rank].host).count();
    let ctx = if want_gpu {
        let local = infos[..rank]
            .iter()
            .filter(|p| p.host == infos[rank].host)
            .count();
        let ctx = device::gpu::device_count()
            .and_then(|n| device::gpu::context(cfg.cuda_device.unwrap_or(local % n)));
        Some(boot.agree("CUDA context", ctx)?)
    } else {
        None
    };
    // What the GPU is (integrated or not) decides how its region is
    // allocated (device::platform).
    let platform = match &ctx {
        Some(c) => Some(boot.agree(
            "GPU attributes",
            device::platform::GpuPlatform::read(c.ordinal()),
        )?),
        None => None,
    };

    // Region and fabric, and the proxy's CPU: the topology's (lanes, proxy
    // CPU) for the Verbs fabric, the Shm placement's for Shm.
    // And the CPUs this node's GPU callers are bound to alone, from the
    // same facts: their CUDA synchronize spins there, so a thread of arx's
    // that ends up on one of them naps instead of polling
    // (`proxy::proxy_spin`; host callers post their own calls).
    let topology_cpu;
    let spinning_callers: Vec<usize>;
    let (region, fabric): (Arc<Region>, Box<dyn Fabric>) = match fabric_kind {
        FabricKind::Shm => {
            let setup = fabric::shm::establish(&boot, &layout)?;
            let region = Arc::clone(&setup.regions[rank]);
            let place = shm_placement(&boot, &cfg, &layout, rank, want_gpu)?;
            topology_cpu = place.proxy;
            spinning_callers = place.spinning_callers.clone();
            (
                region,
                Box::new(boot.agree(
                    "shm copy threads",
                    fabric::shm::ShmFabric::new(layout, &setup, &place, &cfg),
                )?),
            )
        }
        _ => {
            let region = match (&ctx, &platform) {
                (Some(c), Some(p)) => device::gpu::alloc_region(c, p, layout.region_bytes()),
                _ => Region::anonymous(layout.region_bytes()),
            };
            let region = Arc::new(boot.agree("region", region)?);
            let hosts: Vec<&str> = infos.iter().map(|p| p.host.as_str()).collect();
            let local = topology::LocalRank::gather(&boot, &hosts, rank)?;
            let sel = boot.agree("topology", topology::select(&cfg, &local))?;
            topology_cpu = sel.proxy_cpu;
            spinning_callers = if want_gpu {
                local.main_cpus.clone()
            } else {
                Vec::new()
            };
            let f = fabric::verbs::connect(&boot, &cfg, &layout, &region, &sel)?;
            (region, Box::new(f))
        }
    };
    // The one copy of the call timeout: the host side and the proxy read it
    // here, the GPU side copies it into its device state. Relaxed: written
    // before the proxy thread is spawned (which orders it for that thread)
    // and read by this thread otherwise.
    region
        .ctrl()
        .timeout_ns()
        .store(cfg.timeout.as_nanos() as u64, Ordering::Relaxed);
    // The GPU side is complete (region mapped, kernels loaded, device
    // state initialised) before the proxy starts.
    let side = match ctx.zip(platform) {
        Some((ctx, platform)) => {
            // The Shm segment, and an mmap'd region on a coherent
            // integrated GPU, are registered; cuMemHostAlloc's is mapped.
            let register = fabric_kind == FabricKind::Shm
                || platform.region == device::platform::RegionAlloc::MmapRegister;
            let g = device::gpu::GpuSide::new(
                ctx,
                platform,
                Arc::clone(&region),
                register,
                layout,
                &cfg,
                ranks_on_node,
            );
            Side::Gpu(Box::new(boot.agree("GPU side", g)?))
        }
        None => Side::Host,
    };
    // Test-only: every post late (fabric::delayed).
    let fabric: Box<dyn Fabric> = match fabric::delayed::from_env() {
        Some(d) => Box::new(fabric::delayed::Delayed::new(fabric, d)),
        None => fabric,
    };
    let fabric_name = fabric.name();
    let fabric_desc = fabric.describe();
    let proxy = boot.agree("proxy start", {
        let cpu = cfg.proxy_cpu.or(topology_cpu);
        Proxy::start(
            fabric,
            Arc::clone(&region),
            layout,
            &cfg,
            cpu,
            &spinning_callers,
        )
    })?;
    boot.barrier("start-up barrier")?;
    boot.set_call_timeout(cfg.timeout);
    let device = Device::new(side, region, layout, cfg, proxy.link());
    log::info!(
        "arx: rank {rank}/{world} ready: device {}, fabric {fabric_name} ({fabric_desc}), {} bytes mapped",
        device.describe(),
        layout.region_bytes()
    );
    Ok(Arx {
        device,
        proxy,
        layout,
        fabric_desc,
        fabric_name,
        boot,
    })
}

/// Where the Shm fabric's proxy and copy threads run on this rank
/// (`topology::choose_shm_cpus`, from every rank's facts: the Shm fabric's
/// ranks are one node's); logged (a GPU instance's proxy that must share
/// the caller's only CPU warns as it starts). Collective over `boot`.
///
/// Only a GPU instance's threads leave a one-CPU binding: there the proxy
/// posts every call while the caller's CUDA synchronize spins. A host
/// instance's caller posts its own calls, and its proxy moved to a core of
/// its own made small calls slower (measured on 16 cores, 2 ranks bound to
/// one core each, 8 B float: 0.85x MPI's time ratio before, 0.42x after:
/// the proxy's hot loop then contends with the caller for the fabric), so
/// it keeps sharing. Test hook (tests only, not a setting):
/// `ARX_TEST_SHM_PLACEMENT=pin` applies the GPU rule to a host instance.
fn shm_placement(
    boot: &Bootstrap,
    cfg: &Config,
    layout: &Layout,
    rank: usize,
    gpu: bool,
) -> Result<topology::ShmCpus> {
    let explicit = cfg.shm_copy_threads.map(|n| n as usize);
    let sole = topology::sole_bound_cpu();
    let rule = gpu || std::env::var("ARX_TEST_SHM_PLACEMENT").as_deref() == Ok("pin");
    let pin = rule && cfg.proxy_cpu.is_none() && sole.is_some();
    let crew = fabric::shm::crew_possible(layout);
    let mut cpus = topology::CpuInfo::default();
    let me = if pin {
        cpus = topology::shm_cpu_info(std::path::Path::new("/"));
        let online = cpus.online.len().max(1);
        let want = explicit
            .unwrap_or_else(|| crate::config::default_copy_threads(online, online, layout.world()));
        topology::ShmRank {
            sole,
            pin,
            want: if crew { want } else { 0 },
            explicit: explicit.is_some(),
            allowed: topology::allowed_cpus(&cpus.online),
            claimed: topology::claimed_cpus(),
        }
    } else {
        topology::ShmRank {
            sole,
            want: if crew {
                cfg.copy_threads(layout.world())
            } else {
                0
            },
            ..topology::ShmRank::default()
        }
    };
    let all = boot.all_gather_bytes("shm thread placement", &me.encode())?;
    let ranks = all
        .iter()
        .map(|b| topology::ShmRank::decode(b))
        .collect::<Option<Vec<_>>>()
        .ok_or_else(|| {
            Error::Topology(format!(
                "a malformed shm thread placement message among {} ranks",
                all.len()
            ))
        })?;
    // Where GPU callers spin (their main threads' sole CPUs, every rank's).
    let spinning_callers: Vec<usize> = if gpu {
        ranks.iter().filter_map(|r| r.sole).collect()
    } else {
        Vec::new()
    };
    if !pin {
        let note = match (cfg.proxy_cpu, sole) {
            (Some(c), _) => format!("proxy on CPU {c} (ARX_PROXY_CPU); copy threads not pinned"),
            (None, None) => {
                "main thread not bound to one CPU: proxy and copy threads run on the rank's CPUs"
                    .into()
            }
            (None, Some(c)) => format!(
                "host device side: the caller posts its own calls; proxy and copy threads share \
                 the main thread's CPU {c}"
            ),
        };
        log::info!("arx: rank {rank}: {note}");
        return Ok(topology::ShmCpus {
            proxy: cfg.proxy_cpu,
            threads: me.want,
            note,
            spinning_callers,
            ..topology::ShmCpus::default()
        });
    }
    let mut place = topology::choose_shm_cpus(&cpus, &ranks, rank);
    place.spinning_callers = spinning_callers;
    // (A GPU instance's proxy that shares the caller's CPU says what that
    // costs when it starts: `proxy::Proxy::start`.)
    log::info!("arx: rank {rank}: {}", place.note);
    Ok(place)
}

/// With `ARX_SPIN=hot` nothing of arx yields its CPU: `local_ranks` ranks
/// of `per_rank` spinning threads each (the caller, the proxy, the Shm
/// copy threads) on `online` CPUs. When they outnumber the CPUs, a thread
/// whose work another waits for may sit off-CPU for whole scheduler ticks
/// and calls crawl (an outside test's 3 ranks of 17 threads on 2 CPUs did
/// not finish in 120 s): the warning the node's first rank logs.
fn hot_oversubscribed(local_ranks: usize, per_rank: usize, online: usize) -> Option<String> {
    let threads = local_ranks * per_rank;
    (threads > online).then(|| {
        format!(
            "arx: ARX_SPIN=hot: {local_ranks} rank(s) here x {per_rank} threads that never yield \
             (caller, proxy, copy threads) = {threads} on {online} CPUs: calls will crawl; unset \
             ARX_SPIN (adaptive yields), or lower ARX_SHM_COPY_THREADS"
        )
    })
}

/// With `ARX_DEVICE=auto`, rank `missing` cannot run the GPU side (`avail`:
/// every rank's availability, 1 or 0 then the reason), so every rank runs
/// the host side. If some rank could have run the GPU side, the job (a
/// benchmark above all) probably meant the GPU and would otherwise time the
/// host side without a word: the warning rank 0 logs.
fn auto_fallback_warning(avail: &[Vec<u8>], missing: usize) -> Option<String> {
    let some_gpu = avail.iter().any(|b| b.first() == Some(&1));
    some_gpu.then(|| {
        let why = String::from_utf8_lossy(avail[missing].get(1..).unwrap_or_default());
        format!(
            "arx: ARX_DEVICE=auto: every rank runs the host device side, as rank {missing} \
             cannot run the GPU side ({why}) while others can; ARX_DEVICE=gpu makes that an \
             error, ARX_DEVICE=host silences this"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::{auto_fallback_warning, hot_oversubscribed};

    #[test]
    fn hot_spinning_past_the_cpus_is_warned_about() {
        assert_eq!(hot_oversubscribed(2, 2, 4), None);
        assert_eq!(hot_oversubscribed(1, 5, 16), None);
        let w = hot_oversubscribed(3, 17, 2).expect("51 threads on 2 CPUs");
        assert!(w.contains("3 rank(s) here x 17 threads"), "{w}");
        assert!(w.contains("= 51 on 2 CPUs"), "{w}");
        assert!(!w.contains("  "), "runs of spaces: {w}");
        assert!(hot_oversubscribed(2, 2, 3).is_some());
    }

    #[test]
    fn auto_warns_only_when_some_rank_had_a_gpu() {
        let no = |why: &str| [&[0u8][..], why.as_bytes()].concat();
        let w = auto_fallback_warning(&[vec![1], no("libcuda cannot be loaded"), vec![1]], 1)
            .expect("a warning when ranks 0 and 2 have a GPU");
        for needle in [
            "rank 1 cannot",
            "(libcuda cannot be loaded)",
            "ARX_DEVICE=gpu",
            "ARX_DEVICE=host",
        ] {
            assert!(w.contains(needle), "missing {needle:?} in {w}");
        }
        assert!(!w.contains("  "), "runs of spaces in {w:?}");
        // No rank has a GPU (a CPU-only machine): nothing to say.
        assert_eq!(auto_fallback_warning(&[no("a"), no("b")], 0), None);
    }
}
