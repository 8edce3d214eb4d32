//! The proxy's CPU: each local rank takes its own share of the node's
//! cores, best first (big and near the NIC), away from the main threads;
//! and pinning the proxy thread to it.

use super::sysfs::format_cpulist;
use super::{DeviceInfo, Discovery, LocalRank, ThreadCpus, WARN};
use crate::config::Config;
use crate::error::{Error, Result};

/// The node's CPUs in the order the proxy wants them: big and near the
/// NIC, big, near, the rest; higher numbers first within each (CPU 0 tends
/// to take interrupts and housekeeping). It depends on the hardware only,
/// so every rank of the node computes the same order.
fn proxy_cpu_order(disc: &Discovery, near: &[usize]) -> Vec<usize> {
    let big = |c: &usize| disc.cpus.big.contains(c);
    let is_near = |c: &usize| near.is_empty() || near.contains(c);
    let mut order: Vec<usize> = disc.cpus.online.iter().rev().copied().collect();
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
    let mut order = proxy_cpu_order(disc, &near);
    let count = local.count.max(1);
    // Main threads bound to one CPU each (every rank knows the same list):
    // leave those CPUs out of the order while enough others remain.
    let mains: Vec<usize> = local
        .main_cpus
        .iter()
        .copied()
        .filter(|c| order.contains(c))
        .collect();
    if !mains.is_empty() {
        if order.len() - mains.len() >= count {
            order.retain(|c| !mains.contains(c));
            notes.push(format!(
                "CPUs {} hold main threads of this node's ranks (bound one CPU each): left to them",
                format_cpulist(&mains)
            ));
        } else {
            notes.push(format!(
                "CPUs {} hold main threads of this node's ranks, but too few CPUs remain \
                 without them for {count} proxies: proxies may share with main threads",
                format_cpulist(&mains)
            ));
        }
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

/// Pins the calling thread to `cpu`.
pub fn pin_current_thread(cpu: usize) -> Result<()> {
    let os = |detail: String| Error::Os {
        call: "hwloc_set_cpubind(THREAD)",
        object: format!("CPU {cpu}"),
        detail,
    };
    let id = u32::try_from(cpu).map_err(|_| os("CPU number out of range".into()))?;
    let mut topo =
        hwloc2::Topology::new().ok_or_else(|| os("hwloc topology unavailable".into()))?;
    topo.set_cpubind(
        hwloc2::CpuSet::from(id),
        hwloc2::CpuBindFlags::CPUBIND_THREAD,
    )
    .map_err(|e| os(format!("{e:?}")))
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
