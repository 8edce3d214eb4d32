//! The human-readable report of everything topology finds and chooses,
//! for `examples/doctor`.

use std::fmt::Write as _;
use std::path::Path;

use super::memlock::{check_memlock_with, human, memlock_limit, memlock_needed};
use super::sysfs::format_cpulist;
use super::{discover_in, format_gid, hwloc, select_from, HwlocSource, LocalRank, ThreadCpus};
use crate::config::{Config, Overrides};

/// A human-readable report of everything topology finds and chooses, with
/// the settings from the environment (for `examples/doctor`).
pub fn report() -> String {
    let (cfg, err) = match Config::resolve(&Overrides::default()) {
        Ok(c) => (Some(c), None),
        Err(e) => (None, Some(e)),
    };
    let mut s = String::new();
    if let Some(e) = err {
        let _ = writeln!(s, "settings: {e}; using defaults");
    }
    let cfg = match cfg {
        Some(c) => c,
        None => match Config::resolve_with(&Overrides::default(), |_| None) {
            Ok(c) => c,
            Err(e) => return format!("{s}cannot build default settings: {e}\n"),
        },
    };
    let memlock = memlock_limit();
    s.push_str(&report_in(
        Path::new("/"),
        HwlocSource::Live,
        &cfg,
        &ThreadCpus::of_current_thread(),
        memlock.ok(),
    ));
    s
}

/// As [`report`], for a sysfs tree, hwloc source, settings, thread context
/// and memlock limits `(soft, hard)` given explicitly.
pub fn report_in(
    sysfs_root: &Path,
    hwloc: HwlocSource<'_>,
    cfg: &Config,
    me: &ThreadCpus,
    memlock: Option<(u64, u64)>,
) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "== arx topology ==");
    match memlock {
        Some((soft, hard)) => {
            let _ = writeln!(
                s,
                "memlock: soft {}, hard {}{}",
                human(soft),
                human(hard),
                match check_memlock_with(memlock_needed(cfg.slot_bytes, 16), soft, hard) {
                    Ok(()) => String::new(),
                    Err(e) => format!(" -- too low for 16 ranks at this slot size: {e}"),
                }
            );
        }
        None => {
            let _ = writeln!(s, "memlock: unknown (getrlimit failed)");
        }
    }
    let disc = match discover_in(sysfs_root, hwloc) {
        Ok(d) => d,
        Err(e) => {
            let _ = writeln!(s, "RDMA devices: none ({e})");
            let hw = match hwloc {
                HwlocSource::Off => return s,
                HwlocSource::Live => hwloc::load(None),
                HwlocSource::Xml(p) => hwloc::load(Some(p)),
            };
            match hw {
                Ok(t) => {
                    let _ = writeln!(
                        s,
                        "hwloc {} ({}): online CPUs {}, {} CPU kind(s), big cores {}, \
                         {} OpenFabrics device(s)",
                        t.version,
                        t.source,
                        format_cpulist(&t.online),
                        t.kinds.len(),
                        t.big_cores(&t.online)
                            .map(|b| format_cpulist(&b.0))
                            .unwrap_or_else(|| "none".into()),
                        t.devices.len()
                    );
                }
                Err(e) => {
                    let _ = writeln!(s, "hwloc unusable: {e}");
                }
            }
            return s;
        }
    };
    let _ = writeln!(
        s,
        "CPUs: online {}; big cores {} ({})",
        format_cpulist(&disc.cpus.online),
        format_cpulist(&disc.cpus.big),
        disc.cpus.big_source
    );
    let _ = writeln!(
        s,
        "main thread: CPU {}, binding {}",
        me.current
            .map(|c| c.to_string())
            .unwrap_or_else(|| "?".into()),
        me.bound
            .as_deref()
            .map(format_cpulist)
            .unwrap_or_else(|| "unknown".into())
    );
    for d in &disc.devices {
        let _ = writeln!(
            s,
            "device {}: pci {}, root {}{}{}, netdev {}, guid {}",
            d.name,
            d.pci.as_deref().unwrap_or("none (software)"),
            d.root,
            d.hwloc_root
                .as_ref()
                .map(|r| format!(" (hwloc {r})"))
                .unwrap_or_default(),
            if d.virtual_function {
                ", SR-IOV VF"
            } else {
                ""
            },
            if d.netdevs.is_empty() {
                "?".to_string()
            } else {
                d.netdevs.join("/")
            },
            d.sys_image_guid.as_deref().unwrap_or("?")
        );
        if let Some(l) = &d.link {
            let _ = writeln!(
                s,
                "  PCIe {} x{} (max {} x{})",
                l.speed,
                l.width,
                l.max_speed.as_deref().unwrap_or("?"),
                l.max_width
                    .map(|w| w.to_string())
                    .unwrap_or_else(|| "?".into())
            );
        }
        if !d.local_cpus.is_empty() {
            let _ = writeln!(s, "  near CPUs {}", format_cpulist(&d.local_cpus));
        }
        for p in &d.ports {
            let _ = writeln!(
                s,
                "  port {}: {} / {} ({}), MTU {}",
                p.port,
                p.state,
                if p.phys_state.is_empty() {
                    "?"
                } else {
                    &p.phys_state
                },
                p.link_layer,
                p.active_mtu
                    .map(|(m, how)| format!("{m} ({how})"))
                    .unwrap_or_else(|| "?".into())
            );
            for g in &p.gids {
                let _ = writeln!(
                    s,
                    "    gid {}: {} {} on {}",
                    g.index,
                    g.kind.as_deref().unwrap_or("?"),
                    format_gid(&g.gid),
                    g.ndev.as_deref().unwrap_or("?")
                );
            }
        }
    }
    match select_from(&disc, cfg, me, &LocalRank::ALONE) {
        Ok(sel) => {
            for (i, l) in sel.lanes.iter().enumerate() {
                let _ = writeln!(
                    s,
                    "lane {i}: {} port {} gid index {} ({}) on {}, MTU {}, root {}",
                    l.name,
                    l.port,
                    l.gid_index,
                    format_gid(&l.gid),
                    l.netdev,
                    l.active_mtu,
                    l.root
                );
            }
            let _ = writeln!(
                s,
                "proxy CPU (a rank alone on its node): {}",
                sel.proxy_cpu
                    .map(|c| c.to_string())
                    .unwrap_or_else(|| "not pinned".into())
            );
            for n in &sel.notes {
                let _ = writeln!(s, "  - {n}");
            }
        }
        Err(e) => {
            let _ = writeln!(s, "selection failed: {e}");
            for n in &disc.notes {
                let _ = writeln!(s, "  - {n}");
            }
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;
    use crate::topology::select;
    use crate::topology::test_util::{cfg_with, fixture};

    #[test]
    fn live_machine_without_rdma_is_unavailable_and_reportable() {
        let r = report();
        assert!(r.contains("memlock:"), "{r}");
        if !Path::new("/sys/class/infiniband").exists() {
            let e = select(&cfg_with(&[]), &LocalRank::ALONE).unwrap_err();
            assert!(matches!(e, Error::Unavailable { .. }), "{e:?}");
            assert!(r.contains("RDMA devices: none"), "{r}");
        }
    }

    #[test]
    fn report_lists_devices_ports_gids_and_choice() {
        let r = report_in(
            &fixture("spark_port1"),
            HwlocSource::Off,
            &cfg_with(&[]),
            &ThreadCpus {
                current: Some(0),
                bound: None,
            },
            Some((8 << 20, 8 << 20)),
        );
        for needle in [
            "device rocep1s0f0: pci 0000:01:00.0, root 0000:00:00.0",
            "device roceP2p1s0f1: pci 0002:01:00.1, root 0002:00:00.0",
            "port 1: 1: DOWN / 3: Disabled",
            "gid 3: RoCE v2 0000:0000:0000:0000:0000:ffff:0a00:000b (10.0.0.11) on enp1s0f1np1",
            "PCIe 32.0 GT/s PCIe x4",
            "lane 0: rocep1s0f1 port 1 gid index 3",
            "lane 1: roceP2p1s0f1",
            "proxy CPU (a rank alone on its node): 19",
            "too low for 16 ranks",
            "big cores 5-9,15-19",
        ] {
            assert!(r.contains(needle), "missing {needle:?} in\n{r}");
        }
        let bad = report_in(
            &fixture("no_rocev2"),
            HwlocSource::Off,
            &cfg_with(&[]),
            &ThreadCpus::default(),
            None,
        );
        assert!(bad.contains("selection failed"), "{bad}");
    }

    #[test]
    #[ignore = "prints reports for eyeballing: cargo test --lib print_reports -- --ignored --nocapture"]
    fn print_reports() {
        println!("{}", report());
        let xml = fixture("gb10.xml");
        println!(
            "{}",
            report_in(
                &fixture("spark_port1"),
                HwlocSource::Xml(&xml),
                &cfg_with(&[]),
                &ThreadCpus {
                    current: Some(3),
                    bound: None
                },
                Some((u64::MAX, u64::MAX)),
            )
        );
    }
}
