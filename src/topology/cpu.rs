//! The proxy's CPU: each local rank takes its own share of the node's
//! cores, best first (big and near the NIC), away from the main threads;
//! and pinning the proxy thread to it.

use super::sysfs::format_cpulist;
use super::{CpuInfo, DeviceInfo, Discovery, LocalRank, ThreadCpus, WARN};
use crate::config::Config;
use crate::error::{Error, Result};

/// The node's CPUs in the order the proxy wants them: big and near the
/// NIC, big, near, the rest; higher numbers first within each (CPU 0 tends
/// to take interrupts and housekeeping). It depends on the hardware only,
/// so every rank of the node computes the same order.
fn proxy_cpu_order(cpus: &CpuInfo, near: &[usize]) -> Vec<usize> {
    let big = |c: &usize| cpus.big.contains(c);
    let is_near = |c: &usize| near.is_empty() || near.contains(c);
    let mut order: Vec<usize> = cpus.online.iter().rev().copied().collect();
    // Stable: descending numbers within each group.
    order.sort_by_key(|c| (!big(c), !is_near(c)));
    order
}

pub(super) fn choose_proxy_cpu(
    disc: &Discovery,
    lanes: &[&DeviceInfo],
    cfg: &Config,
    me: &ThreadCpus,
    local: &LocalRank,
    notes: &mut Vec<String>,
) -> Option<usize> {
    let online = &disc.cpus.online;
    if let Some(c) = cfg.proxy_cpu {
        notes.push(format!("proxy CPU {c} from ARX_PROXY_CPU (override)"));
        if !online.is_empty() && !online.contains(&c) {
            notes.push(format!(
                "{WARN}ARX_PROXY_CPU={c} is not an online CPU ({})",
                format_cpulist(online)
            ));
        }
        if local.count > 1 {
            notes.push(format!(
                "{WARN}ARX_PROXY_CPU={c} puts the proxies of all {} ranks on this node on one \
                 CPU; unset it to give each its own",
                local.count
            ));
        }
        return Some(c);
    }
    if online.is_empty() {
        notes.push("proxy CPU: online CPUs unknown; the proxy is not pinned".into());
        return None;
    }
    let mut near: Vec<usize> = Vec::new();
    for d in lanes {
        near.extend(d.local_cpus.iter().copied());
    }
    near.sort_unstable();
    near.dedup();
    let near_all = near.is_empty() || online.iter().all(|c| near.contains(c));
    let big = |c: &usize| disc.cpus.big.contains(c);
    let is_near = |c: &usize| near.is_empty() || near.contains(c);

    // Each local rank takes every `count`-th CPU of the node's order,
    // starting at its index: the ranks' shares are disjoint, so their
    // proxies get distinct CPUs without talking to each other, and the
    // first `count` CPUs of the order (the best) go one to each rank.
    // Beyond the big cores near the NIC a rank gets the next best distinct
    // core rather than a big one another proxy spins on. Only with more
    // local ranks than online CPUs do shares wrap (and proxies share).
    let mut order = proxy_cpu_order(&disc.cpus, &near);
    let count = local.count.max(1);
    // Main threads bound to one CPU each, then CPUs that other live
    // instances of the node's ranks' processes pinned their proxies to
    // (every rank knows the same lists): left out of the order while
    // enough others remain.
    if let Some((held, left)) = leave_out(&mut order, &local.main_cpus, count) {
        notes.push(if left {
            format!(
                "CPUs {held} hold main threads of this node's ranks (bound one CPU each): left to them"
            )
        } else {
            format!(
                "CPUs {held} hold main threads of this node's ranks, but too few CPUs remain \
                 without them for {count} proxies: proxies may share with main threads"
            )
        });
    }
    if let Some((held, left)) = leave_out(&mut order, &local.claimed_cpus, count) {
        notes.push(if left {
            format!(
                "CPUs {held} hold proxies of other instances in this node's ranks' processes: \
                 left to them"
            )
        } else {
            format!(
                "{WARN}CPUs {held} hold proxies of other instances in this node's ranks' \
                 processes, but too few CPUs remain without them for {count} proxies: proxies \
                 may share"
            )
        });
    }
    let index = local.index % count;
    let share: Vec<usize> = if count <= order.len() {
        order.iter().skip(index).step_by(count).copied().collect()
    } else {
        notes.push(format!(
            "{WARN}{count} ranks on this node but {} online CPUs: proxies share CPUs (local \
             rank {index} takes CPU {}, as does every local rank {} apart)",
            order.len(),
            order[index % order.len()],
            order.len()
        ));
        vec![order[index % order.len()]]
    };
    let best = order.iter().filter(|c| big(c) && is_near(c)).count();
    if count > 1 && !disc.cpus.big.is_empty() && count > best {
        notes.push(format!(
            "{count} ranks on this node, {best} big cores near the NIC: local ranks {best} and \
             up get the next best distinct cores rather than sharing a big one"
        ));
    }

    let bound = me
        .bound
        .as_ref()
        .filter(|b| !b.is_empty() && online.iter().any(|c| !b.contains(c)));
    // A big core matters more than staying outside the main thread's
    // binding: the proxy's poll-to-post latency is on every call's path.
    let tiers: [(&str, bool, bool, bool); 5] = [
        (
            "big, near the NIC, outside the main thread's binding",
            true,
            true,
            true,
        ),
        ("big, outside the main thread's binding", true, false, true),
        (
            "big (all big cores are in the main thread's binding)",
            true,
            false,
            false,
        ),
        (
            "near the NIC, outside the main thread's binding",
            false,
            true,
            true,
        ),
        ("any online CPU", false, false, false),
    ];
    let share_note = if count > 1 {
        format!(
            "; local rank {index} of {count} on this node, its share of the node's CPUs: {}",
            format_cpulist(&share)
        )
    } else {
        String::new()
    };
    for (why, want_big, want_near, avoid_bound) in tiers {
        if want_big && disc.cpus.big.is_empty() {
            continue;
        }
        let pick = share
            .iter()
            .copied()
            .filter(|c| !want_big || big(c))
            .filter(|c| !want_near || is_near(c))
            .filter(|c| !avoid_bound || bound.map_or(true, |b| !b.contains(c)))
            .find(|c| Some(*c) != me.current);
        if let Some(c) = pick {
            notes.push(format!(
                "proxy CPU {c}: {why} (big cores {} from {}; near the NIC: {}; main thread on \
                 CPU {}{}{share_note})",
                format_cpulist(&disc.cpus.big),
                disc.cpus.big_source,
                if near_all {
                    "all CPUs".to_string()
                } else {
                    format_cpulist(&near)
                },
                me.current
                    .map(|c| c.to_string())
                    .unwrap_or_else(|| "?".into()),
                bound
                    .map(|b| format!(", bound to {}", format_cpulist(b)))
                    .unwrap_or_default()
            ));
            return Some(c);
        }
    }
    notes.push(format!(
        "proxy CPU: no CPU other than the main thread's in this rank's share; not pinned{share_note}"
    ));
    None
}

/// Removes `held`'s CPUs from `order` if at least `count` others remain.
/// None when none of them is in `order`; else the CPU list of those that
/// were, and whether they were removed.
fn leave_out(order: &mut Vec<usize>, held: &[usize], count: usize) -> Option<(String, bool)> {
    let there: Vec<usize> = held.iter().copied().filter(|c| order.contains(c)).collect();
    if there.is_empty() {
        return None;
    }
    let left = order.len() - there.len() >= count;
    if left {
        order.retain(|c| !there.contains(c));
    }
    Some((format_cpulist(&there), left))
}

/// Where the Shm fabric's proxy and copy threads run
/// ([`choose_shm_cpus`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct ShmCpus {
    /// The proxy's CPU; None: not pinned (it runs on the rank's CPUs).
    pub proxy: Option<usize>,
    /// The copy threads' CPUs, one per thread (empty: not pinned).
    pub helpers: Vec<usize>,
    /// How many copy threads to start.
    pub threads: usize,
    /// Why, for the log and the fabric's description.
    pub note: String,
    /// The main thread's one CPU, when the proxy must share it (no other
    /// CPU was free): a GPU instance's calls then wait on the scheduler.
    pub shared: Option<usize>,
    /// The CPUs that this node's GPU callers are bound to alone (their
    /// CUDA synchronize spins there; from every rank's `ShmRank::sole`): a
    /// proxy or copy thread that ends up on one of them naps
    /// (`proxy::settle_thread_spin`). Empty for host instances.
    pub spinning_callers: Vec<usize>,
}

/// One local rank's facts for the Shm placement; every local rank learns
/// every other's (`establish::shm_placement` gathers them), so that all
/// compute the same assignment.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct ShmRank {
    /// The CPU its main thread is bound to alone, if so.
    pub sole: Option<usize>,
    /// Whether its threads leave that CPU (a GPU instance; never for a
    /// rank without `sole`).
    pub pin: bool,
    /// The copy threads it starts.
    pub want: usize,
    /// `want` was set by hand (`ARX_SHM_COPY_THREADS`): started even with
    /// too few CPUs, sharing them.
    pub explicit: bool,
    /// The CPUs it may be pinned to (probed: `allowed_cpus`).
    pub allowed: Vec<usize>,
    /// The CPUs its process's other live instances pinned threads to
    /// ([`claimed_cpus`]): avoided while others are free.
    pub claimed: Vec<usize>,
}

/// The CPUs that live Shm instances of this process pinned their proxy
/// and copy threads to, one entry per thread ([`CpuClaim`]).
static CLAIMED: std::sync::Mutex<Vec<usize>> = std::sync::Mutex::new(Vec::new());

/// This process's claimed CPUs now, each once, in ascending order.
pub(crate) fn claimed_cpus() -> Vec<usize> {
    let mut v = CLAIMED.lock().unwrap_or_else(|e| e.into_inner()).clone();
    v.sort_unstable();
    v.dedup();
    v
}

/// The CPUs one instance's pinned threads run on, claimed for as long as
/// it lives, so that the next instance of this process places its threads
/// elsewhere ([`choose_shm_cpus`]). Two instances started at the same time
/// by two threads may still pick the same CPUs (the choice is collective
/// and cannot hold the claim lock across it).
#[derive(Debug)]
pub(crate) struct CpuClaim(Vec<usize>);

impl CpuClaim {
    pub(crate) fn new(cpus: Vec<usize>) -> Self {
        CLAIMED
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend_from_slice(&cpus);
        CpuClaim(cpus)
    }
}

impl Drop for CpuClaim {
    fn drop(&mut self) {
        let mut all = CLAIMED.lock().unwrap_or_else(|e| e.into_inner());
        for c in &self.0 {
            if let Some(i) = all.iter().position(|x| x == c) {
                all.swap_remove(i);
            }
        }
    }
}

impl ShmRank {
    /// As little-endian u64 words: sole (u64::MAX: none), pin, want,
    /// explicit, the number of claimed CPUs, the claimed CPUs, then the
    /// allowed CPUs.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let head = [
            self.sole.map_or(u64::MAX, |c| c as u64),
            u64::from(self.pin),
            self.want as u64,
            u64::from(self.explicit),
            self.claimed.len() as u64,
        ];
        head.iter()
            .copied()
            .chain(self.claimed.iter().map(|&c| c as u64))
            .chain(self.allowed.iter().map(|&c| c as u64))
            .flat_map(u64::to_le_bytes)
            .collect()
    }

    /// [`ShmRank::encode`]'s bytes back; None when they are not whole words
    /// or too few.
    pub(crate) fn decode(b: &[u8]) -> Option<Self> {
        if b.len() % 8 != 0 || b.len() < 40 {
            return None;
        }
        let w: Vec<u64> = b
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8-byte chunk")))
            .collect();
        let cpu = |x: u64| usize::try_from(x).ok();
        let claimed_end = cpu(w[4])?.checked_add(5).filter(|&e| e <= w.len())?;
        let cpus = |ws: &[u64]| ws.iter().map(|&x| cpu(x)).collect::<Option<Vec<_>>>();
        Some(ShmRank {
            sole: (w[0] != u64::MAX).then(|| cpu(w[0])).flatten(),
            pin: w[1] != 0,
            want: cpu(w[2])?,
            explicit: w[3] != 0,
            claimed: cpus(&w[5..claimed_end])?,
            allowed: cpus(&w[claimed_end..])?,
        })
    }
}

/// The Shm fabric's proxy and copy threads of local rank `me` among the
/// node's `ranks` (in local rank order), on a node with CPUs `cpus`.
///
/// For GPU instances (`ShmRank::pin`; `establish::shm_placement`). A rank
/// bound to several CPUs, or to none, keeps its threads there (the
/// scheduler spreads them over the binding). A rank bound to one CPU (Open
/// MPI's `--bind-to core`, its default at two ranks or fewer) would make
/// its proxy share that CPU with the caller, whose CUDA synchronize spins
/// without yielding: each GPU call then waits for a scheduler tick (4 ms
/// measured on the H200 machine against 12 us). So the proxy and copy
/// threads go to CPUs outside every main thread's one CPU: in rounds, each
/// pinning rank in turn takes the best CPU (big cores first, high numbers
/// first) that it may use and no one has taken, first for its proxy, then
/// one per copy thread; with the same CPUs allowed to all, local rank i
/// gets the i-th, (n+i)-th, ... CPU of the order. By default a rank starts
/// no more copy threads than it got CPUs beyond the proxy's. CPUs that
/// another live instance of any local rank's process claimed
/// (`ShmRank::claimed`) are avoided: copy threads never take one, a proxy
/// only when no other CPU is free (sharing another instance's thread
/// beats sharing the caller's CPU). Instances of other communicators whose
/// ranks are not among `ranks` are not seen.
pub(crate) fn choose_shm_cpus(cpus: &CpuInfo, ranks: &[ShmRank], me: usize) -> ShmCpus {
    let Some(mine) = ranks.get(me) else {
        return ShmCpus::default();
    };
    let Some(main) = mine.sole.filter(|_| mine.pin) else {
        return ShmCpus {
            threads: mine.want,
            note: "proxy and copy threads run on the rank's CPUs".into(),
            ..ShmCpus::default()
        };
    };
    let order = proxy_cpu_order(cpus, &[]);
    let mut taken: Vec<usize> = ranks.iter().filter_map(|r| r.sole).collect();
    // Any local rank's claim: another instance of that rank's process has
    // a thread there (a peer's as much as this rank's own).
    let claimed: Vec<usize> = ranks
        .iter()
        .flat_map(|r| r.claimed.iter().copied())
        .collect();
    let mut got: Vec<Vec<usize>> = vec![Vec::new(); ranks.len()];
    let mut open: Vec<bool> = ranks.iter().map(|r| r.pin && r.sole.is_some()).collect();
    while open.iter().any(|&o| o) {
        for (i, r) in ranks.iter().enumerate() {
            if !open[i] {
                continue;
            }
            let free = |c: &usize| r.allowed.contains(c) && !taken.contains(c);
            let pick = order
                .iter()
                .copied()
                .find(|c| free(c) && !claimed.contains(c))
                .or_else(|| {
                    // Only a proxy goes to a CPU another instance claimed.
                    let proxy = got[i].is_empty();
                    order.iter().copied().find(|c| proxy && free(c))
                });
            match pick {
                Some(c) => {
                    taken.push(c);
                    got[i].push(c);
                    open[i] = got[i].len() < 1 + r.want;
                }
                None => open[i] = false,
            }
        }
    }
    let Some((&proxy, rest)) = got[me].split_first() else {
        let why = if cpus.online.is_empty() {
            "the node's online CPUs are unknown".to_string()
        } else {
            format!(
                "no CPU it may use is free of the node's main threads and the other local \
                 ranks' threads (local rank {me} of {})",
                ranks.len()
            )
        };
        return ShmCpus {
            threads: if mine.explicit { mine.want } else { 0 },
            note: format!(
                "main thread bound to CPU {main} alone and {why}: the proxy shares CPU {main}"
            ),
            shared: Some(main),
            ..ShmCpus::default()
        };
    };
    let threads = if mine.explicit {
        mine.want
    } else {
        mine.want.min(rest.len())
    };
    // More copy threads than CPUs (only when set by hand): they share the
    // CPUs beyond the proxy's, or the proxy's when there are none.
    let spare = if rest.is_empty() { &got[me][..1] } else { rest };
    let helpers: Vec<usize> = spare.iter().copied().cycle().take(threads).collect();
    let note = format!(
        "main thread bound to CPU {main} alone: proxy on CPU {proxy}{}{}",
        if claimed.contains(&proxy) {
            " (beside another instance's thread: no other CPU was free)"
        } else {
            ""
        },
        if helpers.is_empty() {
            String::new()
        } else {
            format!(", copy threads on CPUs {}", cpu_words(&helpers))
        }
    );
    ShmCpus {
        proxy: Some(proxy),
        helpers,
        threads,
        note,
        shared: None,
        spinning_callers: Vec::new(),
    }
}

/// CPU numbers as written, comma-separated (a copy thread list may repeat
/// CPUs, which a kernel CPU list cannot say).
pub(crate) fn cpu_words(cpus: &[usize]) -> String {
    cpus.iter()
        .map(|c| c.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// Which of `cpus` this process may run a thread on: each is tried on a
/// short-lived thread with `sched_setaffinity`, which refuses CPUs outside
/// the process's cpuset (a cgroup's, a container's) whatever the cgroup
/// layout. All of `cpus` when the probe thread cannot start.
pub(crate) fn allowed_cpus(cpus: &[usize]) -> Vec<usize> {
    let list = cpus.to_vec();
    std::thread::Builder::new()
        .name("arx-cpu-probe".into())
        .spawn(move || {
            list.into_iter()
                .filter(|&c| pin_current_thread(c).is_ok())
                .collect()
        })
        .ok()
        .and_then(|t| t.join().ok())
        .unwrap_or_else(|| cpus.to_vec())
}

/// The one CPU the calling thread is bound to, if it is bound to exactly
/// one (read with `sched_getaffinity`, without loading a topology).
pub(crate) fn sole_bound_cpu() -> Option<usize> {
    // SAFETY: cpu_set_t is plain data whose all-zero value is the empty
    // set; sched_getaffinity(0) writes at most the size given into it, for
    // the calling thread; CPU_ISSET reads it at indices below CPU_SETSIZE.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return None;
        }
        let mut on = (0..libc::CPU_SETSIZE as usize).filter(|&c| libc::CPU_ISSET(c, &set));
        match (on.next(), on.next()) {
            (Some(c), None) => Some(c),
            _ => None,
        }
    }
}

/// Pins the calling thread to `cpu`.
pub fn pin_current_thread(cpu: usize) -> Result<()> {
    let os = |detail: String| Error::Os {
        call: "sched_setaffinity",
        object: format!("CPU {cpu}"),
        detail,
    };
    if cpu >= libc::CPU_SETSIZE as usize {
        return Err(os("CPU number out of range".into()));
    }
    // SAFETY: as in `sole_bound_cpu`; CPU_SET writes the bit of an index
    // below CPU_SETSIZE; sched_setaffinity(0) binds the calling thread and
    // only reads the set.
    let rc = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    if rc != 0 {
        return Err(os(std::io::Error::last_os_error().to_string()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    use crate::topology::test_util::{cfg_with, fixture, has_note, sel};
    use crate::topology::{discover_in, select_from, select_in, HwlocSource, Selection};

    #[test]
    fn proxy_cpu_is_a_big_core_away_from_the_main_thread() {
        let cfg = cfg_with(&[]);
        let root = fixture("spark_both");
        let pick = |me: ThreadCpus| {
            select_in(&root, HwlocSource::Off, &cfg, &me, &LocalRank::ALONE)
                .unwrap()
                .proxy_cpu
                .unwrap()
        };
        assert_eq!(pick(ThreadCpus::default()), 19);
        let on19 = ThreadCpus {
            current: Some(19),
            bound: None,
        };
        assert_eq!(pick(on19), 18);
        let bound = ThreadCpus {
            current: Some(17),
            bound: Some((15..=19).collect()),
        };
        assert_eq!(pick(bound), 9);
        // Bound to every big core: stay big, avoid the current CPU.
        let all_big = ThreadCpus {
            current: Some(19),
            bound: Some([5, 6, 7, 8, 9, 15, 16, 17, 18, 19].into()),
        };
        let c = pick(all_big);
        assert!(
            c != 19 && ((5..=9).contains(&c) || (15..=19).contains(&c)),
            "{c}"
        );

        let s = sel("spark_both", &[("ARX_PROXY_CPU", "3")]).unwrap();
        assert_eq!(s.proxy_cpu, Some(3));
        assert!(has_note(&s, "ARX_PROXY_CPU"));
    }

    const GB10_BIG: [usize; 10] = [5, 6, 7, 8, 9, 15, 16, 17, 18, 19];

    fn lr(index: usize, count: usize) -> LocalRank {
        LocalRank {
            index,
            count,
            main_cpus: Vec::new(),
            claimed_cpus: Vec::new(),
        }
    }

    /// Every local rank's proxy CPU on a node of `count` ranks, each rank's
    /// main thread described by `me(index)`.
    fn node_picks(
        disc: &Discovery,
        count: usize,
        me: impl Fn(usize) -> ThreadCpus,
    ) -> Vec<(usize, Selection)> {
        let cfg = cfg_with(&[]);
        (0..count)
            .map(|index| {
                let s = select_from(disc, &cfg, &me(index), &lr(index, count)).unwrap();
                (s.proxy_cpu.expect("pinned"), s)
            })
            .collect()
    }

    fn distinct(picks: &[(usize, Selection)]) -> bool {
        let set: BTreeSet<usize> = picks.iter().map(|p| p.0).collect();
        set.len() == picks.len()
    }

    #[test]
    fn proxies_of_a_nodes_ranks_get_distinct_big_cores() {
        let xml = fixture("gb10.xml");
        let discs = [
            discover_in(&fixture("spark_x2"), HwlocSource::Off).unwrap(),
            discover_in(&fixture("spark_both"), HwlocSource::Off).unwrap(),
            // CPU kinds from hwloc rather than sysfs.
            discover_in(&fixture("spark_nokinds"), HwlocSource::Xml(&xml)).unwrap(),
        ];
        for disc in &discs {
            assert_eq!(disc.cpus.big, GB10_BIG);
            for count in [1, 2, 4] {
                // Main threads: unknown; on the CPU each rank would otherwise
                // take; bound one core each by `mpirun --bind-to core`
                // (little cores 0..3 on GB10); bound to every big core.
                let contexts: [&dyn Fn(usize) -> ThreadCpus; 4] = [
                    &|_| ThreadCpus::default(),
                    &|i| ThreadCpus {
                        current: Some(19 - i),
                        bound: None,
                    },
                    &|i| ThreadCpus {
                        current: Some(i),
                        bound: Some(vec![i]),
                    },
                    &|i| ThreadCpus {
                        current: Some(GB10_BIG[i]),
                        bound: Some(GB10_BIG.to_vec()),
                    },
                ];
                for (k, me) in contexts.iter().enumerate() {
                    let picks = node_picks(disc, count, me);
                    let cpus: Vec<usize> = picks.iter().map(|p| p.0).collect();
                    assert!(distinct(&picks), "{count} ranks, context {k}: {cpus:?}");
                    for (i, (c, s)) in picks.iter().enumerate() {
                        assert!(GB10_BIG.contains(c), "{count} ranks, context {k}: {cpus:?}");
                        assert_ne!(Some(*c), me(i).current, "rank {i}: {:#?}", s.notes);
                        // (spark_x2's narrow link is warned about; CPUs are not.)
                        let cpu_warnings = s.warnings().filter(|w| w.contains("CPU")).count();
                        assert_eq!(cpu_warnings, 0, "{:#?}", s.notes);
                        if count > 1 {
                            assert!(has_note(s, &format!("local rank {i} of {count}")));
                        }
                    }
                }
                // Nothing known of the main threads: the best cores, in order.
                let picks = node_picks(disc, count, |_| ThreadCpus::default());
                let cpus: Vec<usize> = picks.iter().map(|p| p.0).collect();
                assert_eq!(cpus, [19, 18, 17, 16][..count]);
            }
        }
    }

    #[test]
    fn more_ranks_than_big_cores_take_distinct_lesser_cores_then_wrap() {
        let disc = discover_in(&fixture("spark_both"), HwlocSource::Off).unwrap();
        let picks = node_picks(&disc, 12, |_| ThreadCpus::default());
        assert!(distinct(&picks));
        for (i, (c, s)) in picks.iter().enumerate() {
            assert_eq!(GB10_BIG.contains(c), i < 10, "rank {i}: CPU {c}");
            assert!(has_note(
                s,
                "12 ranks on this node, 10 big cores near the NIC"
            ));
        }
        // More local ranks than online CPUs: shares wrap, said as a warning.
        let picks = node_picks(&disc, 24, |_| ThreadCpus::default());
        for (i, (c, s)) in picks.iter().enumerate() {
            if i < 20 {
                assert!(picks.iter().filter(|p| p.0 == *c).count() <= 2);
            } else {
                assert_eq!(*c, picks[i - 20].0, "rank {i} wraps onto rank {}", i - 20);
            }
            assert!(
                s.warnings().any(|w| w.contains("proxies share CPUs")),
                "{:#?}",
                s.notes
            );
        }
    }

    #[test]
    fn proxies_prefer_big_cores_near_the_nic() {
        let mut disc = discover_in(&fixture("spark_both"), HwlocSource::Off).unwrap();
        for d in &mut disc.devices {
            d.local_cpus = (10..=17).collect(); // big ones near: 15, 16, 17
        }
        let picks = node_picks(&disc, 3, |_| ThreadCpus::default());
        let cpus: Vec<usize> = picks.iter().map(|p| p.0).collect();
        assert_eq!(cpus, [17, 16, 15]);
        // A fourth rank: a big core away from the NIC beats a near little one.
        let picks = node_picks(&disc, 4, |_| ThreadCpus::default());
        let cpus: Vec<usize> = picks.iter().map(|p| p.0).collect();
        assert_eq!(cpus, [17, 16, 15, 19]);
        assert!(has_note(
            &picks[3].1,
            "4 ranks on this node, 3 big cores near the NIC"
        ));
    }

    #[test]
    fn a_second_instance_pins_its_proxies_off_the_first_ones() {
        // Two ranks on a Spark, mains bound to 18 and 19: the first
        // instance's proxies go to 17 and 16 (see the next test); a second
        // instance in the same processes knows those CPUs are claimed.
        let disc = discover_in(&fixture("spark_both"), HwlocSource::Off).unwrap();
        let cfg = cfg_with(&[]);
        let bound = |i: usize| {
            let c = [18, 19][i];
            ThreadCpus {
                current: Some(c),
                bound: Some(vec![c]),
            }
        };
        let picks = |claimed: &[usize]| -> Vec<Selection> {
            (0..2)
                .map(|i| {
                    let local = LocalRank {
                        main_cpus: vec![18, 19],
                        claimed_cpus: claimed.to_vec(),
                        ..lr(i, 2)
                    };
                    select_from(&disc, &cfg, &bound(i), &local).unwrap()
                })
                .collect()
        };
        let first: Vec<usize> = picks(&[]).iter().map(|s| s.proxy_cpu.unwrap()).collect();
        assert_eq!(first, [17, 16]);
        let second = picks(&first);
        let cpus: Vec<usize> = second.iter().map(|s| s.proxy_cpu.unwrap()).collect();
        assert!(
            cpus.iter()
                .all(|c| !first.contains(c) && ![18, 19].contains(c) && GB10_BIG.contains(c)),
            "{cpus:?}"
        );
        assert_ne!(cpus[0], cpus[1]);
        assert!(
            has_note(&second[0], "hold proxies of other instances"),
            "{:#?}",
            second[0].notes
        );
        // Every CPU claimed: proxies may share, and it is said.
        let all: Vec<usize> = (0..20).collect();
        let crowded = picks(&all);
        assert!(
            has_note(&crowded[0], "too few CPUs remain without them"),
            "{:#?}",
            crowded[0].notes
        );
        assert!(crowded.iter().all(|s| s.proxy_cpu.is_some()));
    }

    #[test]
    fn proxies_keep_off_the_cpus_of_bound_main_threads() {
        let disc = discover_in(&fixture("spark_both"), HwlocSource::Off).unwrap();
        // Main threads bound to 18 (local rank 0) and 19 (local rank 1): with
        // only its own binding known, each proxy lands on the other rank's
        // main thread.
        let bound = |i: usize| {
            let c = [18, 19][i];
            ThreadCpus {
                current: Some(c),
                bound: Some(vec![c]),
            }
        };
        let blind = node_picks(&disc, 2, bound);
        let cpus: Vec<usize> = blind.iter().map(|p| p.0).collect();
        assert_eq!(cpus, [19, 18]);
        // Knowing every local rank's binding, they keep off both.
        let cfg = cfg_with(&[]);
        let cpus: Vec<usize> = (0..2)
            .map(|i| {
                let local = LocalRank {
                    main_cpus: vec![18, 19],
                    ..lr(i, 2)
                };
                let s = select_from(&disc, &cfg, &bound(i), &local).unwrap();
                assert!(
                    has_note(&s, "CPUs 18-19 hold main threads"),
                    "{:#?}",
                    s.notes
                );
                s.proxy_cpu.unwrap()
            })
            .collect();
        assert_eq!(cpus, [17, 16]);
        // Too few CPUs without them: proxies may share, and it is said.
        let local = LocalRank {
            main_cpus: (0..20).collect(),
            ..lr(0, 2)
        };
        let s = select_from(&disc, &cfg, &ThreadCpus::default(), &local).unwrap();
        assert!(has_note(&s, "too few CPUs remain"), "{:#?}", s.notes);
        assert_eq!(s.proxy_cpu, Some(19));
    }

    #[test]
    fn local_rank_among_the_node_names() {
        let hosts = ["a", "b", "a", "a", "b"];
        let at = |rank| LocalRank::among(&hosts, rank);
        assert_eq!(at(0), lr(0, 3));
        assert_eq!(at(1), lr(0, 2));
        assert_eq!(at(3), lr(2, 3));
        assert_eq!(at(4), lr(1, 2));
        assert_eq!(at(5), LocalRank::ALONE);
        // The override pins every local rank to one CPU: said as a warning.
        let disc = discover_in(&fixture("spark_both"), HwlocSource::Off).unwrap();
        let cfg = cfg_with(&[("ARX_PROXY_CPU", "7")]);
        let me = ThreadCpus::default();
        let s = select_from(&disc, &cfg, &me, &lr(1, 2)).unwrap();
        assert_eq!(s.proxy_cpu, Some(7));
        assert!(
            s.warnings().any(|w| w.contains("one CPU")),
            "{:#?}",
            s.notes
        );
        let s = select_from(&disc, &cfg, &me, &LocalRank::ALONE).unwrap();
        assert_eq!(s.warnings().count(), 0, "{:#?}", s.notes);
    }

    /// `n` alike CPUs, all online.
    fn alike(n: usize) -> CpuInfo {
        CpuInfo {
            online: (0..n).collect(),
            ..CpuInfo::default()
        }
    }

    /// A pinning rank bound to `sole`, wanting `want` copy threads, allowed
    /// `allowed` (None: every CPU of `cpus`).
    fn pinning(cpus: &CpuInfo, sole: usize, want: usize, allowed: Option<&[usize]>) -> ShmRank {
        ShmRank {
            sole: Some(sole),
            pin: true,
            want,
            explicit: false,
            allowed: allowed.map_or_else(|| cpus.online.clone(), <[usize]>::to_vec),
            claimed: Vec::new(),
        }
    }

    #[test]
    fn shm_threads_leave_a_one_cpu_binding() {
        // Open MPI's default at 2 ranks on 16 CPUs: mains on 0 and 1.
        let cpus = alike(16);
        let ranks = [pinning(&cpus, 0, 3, None), pinning(&cpus, 1, 3, None)];
        let a = choose_shm_cpus(&cpus, &ranks, 0);
        let b = choose_shm_cpus(&cpus, &ranks, 1);
        assert_eq!(
            (a.proxy, a.helpers.clone(), a.threads),
            (Some(15), vec![13, 11, 9], 3)
        );
        assert_eq!(
            (b.proxy, b.helpers.clone(), b.threads),
            (Some(14), vec![12, 10, 8], 3)
        );
        for p in [&a, &b] {
            assert_eq!(p.shared, None);
            assert!(p.note.contains("proxy on CPU"), "{}", p.note);
        }
        // Disjoint, and off every main CPU.
        let mut all: Vec<usize> = [a.proxy.unwrap(), b.proxy.unwrap()]
            .into_iter()
            .chain(a.helpers.iter().chain(&b.helpers).copied())
            .collect();
        assert!(all.iter().all(|c| *c > 1));
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), 8);
        // The encoding every rank sends round-trips.
        for r in &ranks {
            assert_eq!(ShmRank::decode(&r.encode()).as_ref(), Some(r));
        }
        assert_eq!(ShmRank::decode(&[0; 39]), None);
    }

    #[test]
    fn a_second_instance_avoids_the_first_ones_cpus() {
        // Open MPI's default at 2 ranks on 16 CPUs: the first instance
        // (claims empty) got 15, 13, 11, 9 and 14, 12, 10, 8.
        let cpus = alike(16);
        let mut ranks = [pinning(&cpus, 0, 3, None), pinning(&cpus, 1, 3, None)];
        ranks[0].claimed = vec![15, 13, 11, 9];
        ranks[1].claimed = vec![14, 12, 10, 8];
        let a = choose_shm_cpus(&cpus, &ranks, 0);
        let b = choose_shm_cpus(&cpus, &ranks, 1);
        assert_eq!((a.proxy, a.helpers.clone()), (Some(7), vec![5, 3]));
        assert_eq!((b.proxy, b.helpers.clone()), (Some(6), vec![4, 2]));
        assert!(!a.note.contains("another instance"), "{}", a.note);
        for r in &ranks {
            assert_eq!(ShmRank::decode(&r.encode()).as_ref(), Some(r));
        }
        // Nothing unclaimed left (4 CPUs, mains on 0 and 1, the first
        // instance on 3 and 2): proxies go beside the first instance's
        // threads rather than onto a main CPU; copy threads do not.
        let cpus = alike(4);
        let mut ranks = [pinning(&cpus, 0, 1, None), pinning(&cpus, 1, 1, None)];
        ranks[0].claimed = vec![3];
        ranks[1].claimed = vec![2];
        let a = choose_shm_cpus(&cpus, &ranks, 0);
        let b = choose_shm_cpus(&cpus, &ranks, 1);
        assert_eq!(
            (a.proxy, a.helpers.clone(), a.threads),
            (Some(3), vec![], 0)
        );
        assert_eq!(
            (b.proxy, b.helpers.clone(), b.threads),
            (Some(2), vec![], 0)
        );
        assert!(a.note.contains("another instance"), "{}", a.note);
    }

    #[test]
    fn claims_last_as_long_as_their_holder() {
        // Other tests may hold claims meanwhile: count this test's CPUs.
        let mine = |c: usize| claimed_cpus().contains(&c);
        let (x, y) = (1 << 20, (1 << 20) + 1);
        let a = CpuClaim::new(vec![x, y]);
        let b = CpuClaim::new(vec![x]);
        assert!(mine(x) && mine(y));
        drop(a);
        assert!(mine(x) && !mine(y), "b still holds x");
        drop(b);
        assert!(!mine(x));
    }

    #[test]
    fn a_malformed_placement_message_is_refused() {
        let mut r = pinning(&alike(4), 0, 1, None);
        r.claimed = vec![3, 2];
        let b = r.encode();
        assert_eq!(ShmRank::decode(&b).as_ref(), Some(&r));
        // A claimed count past the message's end.
        let mut bad = b.clone();
        bad[32..40].copy_from_slice(&100u64.to_le_bytes());
        assert_eq!(ShmRank::decode(&bad), None);
        assert_eq!(ShmRank::decode(&b[..39]), None);
    }

    #[test]
    fn shm_threads_stay_when_not_pinning() {
        let cpus = alike(16);
        let host = ShmRank {
            sole: Some(0),
            pin: false,
            want: 0,
            ..ShmRank::default()
        };
        let unbound = ShmRank {
            sole: None,
            pin: true,
            want: 3,
            ..ShmRank::default()
        };
        let ranks = [host, unbound, pinning(&cpus, 2, 3, None)];
        let p = choose_shm_cpus(&cpus, &ranks, 0);
        assert_eq!(
            (p.proxy, p.helpers.len(), p.threads, p.shared),
            (None, 0, 0, None)
        );
        let p = choose_shm_cpus(&cpus, &ranks, 1);
        assert_eq!(
            (p.proxy, p.helpers.len(), p.threads, p.shared),
            (None, 0, 3, None)
        );
        // The pinning rank avoids the host rank's main CPU too.
        let p = choose_shm_cpus(&cpus, &ranks, 2);
        assert_eq!((p.proxy, p.helpers.clone()), (Some(15), vec![14, 13, 12]));
    }

    #[test]
    fn shm_proxy_shares_when_no_cpu_is_free() {
        // CI's 2 CPUs, 2 ranks bound one each.
        let cpus = alike(2);
        let ranks = [pinning(&cpus, 0, 3, None), pinning(&cpus, 1, 3, None)];
        let p = choose_shm_cpus(&cpus, &ranks, 1);
        assert_eq!((p.proxy, p.threads, p.shared), (None, 0, Some(1)));
        assert!(p.note.contains("shares CPU 1"), "{}", p.note);
        // Copy threads set by hand are still started (not pinned).
        let mut by_hand = ranks.clone();
        by_hand[1].explicit = true;
        by_hand[1].want = 2;
        let p = choose_shm_cpus(&cpus, &by_hand, 1);
        assert_eq!((p.proxy, p.threads, p.helpers.len()), (None, 2, 0));
        // 3 CPUs, 2 bound ranks: the one free CPU goes to local rank 0.
        let cpus = alike(3);
        let ranks = [pinning(&cpus, 0, 3, None), pinning(&cpus, 1, 3, None)];
        let a = choose_shm_cpus(&cpus, &ranks, 0);
        let b = choose_shm_cpus(&cpus, &ranks, 1);
        assert_eq!((a.proxy, a.threads, a.shared), (Some(2), 0, None));
        assert_eq!((b.proxy, b.shared), (None, Some(1)));
        // Online CPUs unknown: shared, and the note says why.
        let none = CpuInfo::default();
        let p = choose_shm_cpus(&none, &[pinning(&none, 0, 3, Some(&[]))], 0);
        assert_eq!(p.shared, Some(0));
        assert!(p.note.contains("unknown"), "{}", p.note);
    }

    #[test]
    fn shm_threads_respect_allowed_cpus_and_big_cores() {
        // This process may use CPUs 0-5 only: nothing pinned beyond them.
        let cpus = alike(16);
        let few = [0, 1, 2, 3, 4, 5];
        let p = choose_shm_cpus(&cpus, &[pinning(&cpus, 0, 3, Some(&few))], 0);
        assert_eq!((p.proxy, p.helpers.clone()), (Some(5), vec![4, 3, 2]));
        // Only the main's CPU allowed: shared.
        let p = choose_shm_cpus(&cpus, &[pinning(&cpus, 0, 3, Some(&[0]))], 0);
        assert_eq!((p.proxy, p.shared), (None, Some(0)));
        // Ranks allowed different CPUs never get the same one (4 CPUs,
        // mains 0 and 1; rank 0 may use 0-2, rank 1 all).
        let cpus = alike(4);
        let ranks = [
            pinning(&cpus, 0, 0, Some(&[0, 1, 2])),
            pinning(&cpus, 1, 0, None),
        ];
        let a = choose_shm_cpus(&cpus, &ranks, 0);
        let b = choose_shm_cpus(&cpus, &ranks, 1);
        assert_eq!((a.proxy, b.proxy), (Some(2), Some(3)));
        // Each rank's own cpuset (per-task cgroups): its own CPUs.
        let cpus = alike(4);
        let ranks = [
            pinning(&cpus, 0, 1, Some(&[0, 1])),
            pinning(&cpus, 2, 1, Some(&[2, 3])),
        ];
        let a = choose_shm_cpus(&cpus, &ranks, 0);
        let b = choose_shm_cpus(&cpus, &ranks, 1);
        assert_eq!(
            (a.proxy, a.threads, b.proxy, b.threads),
            (Some(1), 0, Some(3), 0)
        );
        // Big cores first (GB10: 5-9 and 15-19 big).
        let cpus = CpuInfo {
            online: (0..20).collect(),
            big: GB10_BIG.to_vec(),
            big_source: "test".into(),
        };
        let p = choose_shm_cpus(&cpus, &[pinning(&cpus, 19, 3, None)], 0);
        assert_eq!((p.proxy, p.helpers.clone()), (Some(18), vec![17, 16, 15]));
        // More copy threads than CPUs, set by hand: they share the spare.
        let cpus = alike(4);
        let mut r = pinning(&cpus, 0, 5, None);
        r.explicit = true;
        let p = choose_shm_cpus(&cpus, &[r], 0);
        assert_eq!(
            (p.proxy, p.helpers.clone(), p.threads),
            (Some(3), vec![2, 1, 2, 1, 2], 5)
        );
        assert!(p.note.contains("CPUs 2,1,2,1,2"), "{}", p.note);
        // By default no more than the spare CPUs.
        let cpus = alike(3);
        let p = choose_shm_cpus(&cpus, &[pinning(&cpus, 0, 3, None)], 0);
        assert_eq!(
            (p.proxy, p.helpers.clone(), p.threads),
            (Some(2), vec![1], 1)
        );
    }

    #[test]
    fn allowed_cpus_are_probed() {
        // CPU 0 exists everywhere; one past the set's size never does.
        assert_eq!(allowed_cpus(&[0, 1 << 20]), [0]);
    }

    #[test]
    fn sole_bound_cpu_reads_the_threads_binding() {
        let r = std::thread::spawn(|| {
            pin_current_thread(0).unwrap();
            sole_bound_cpu()
        })
        .join()
        .unwrap();
        assert_eq!(r, Some(0));
        let n = std::thread::available_parallelism().map_or(1, |n| n.get());
        if n > 1 {
            // A fresh thread of this (unbound) test process.
            let r = std::thread::spawn(sole_bound_cpu).join().unwrap();
            assert_eq!(r, None);
        }
    }

    #[test]
    fn pin_current_thread_binds_or_errs() {
        let r = std::thread::spawn(|| {
            let ok = pin_current_thread(0);
            let bad = pin_current_thread(1 << 20);
            (ok.is_ok(), bad.is_err())
        })
        .join()
        .unwrap();
        assert_eq!(r, (true, true));
    }
}
