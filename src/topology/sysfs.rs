//! Discovery: RDMA devices, ports, GIDs, PCIe links and CPUs read from
//! sysfs (the kernel's own view, and what rdma-core reads), then completed
//! and cross-checked with hwloc's view of CPU kinds, nearby CPUs and PCIe
//! roots.

use std::fs;
use std::path::Path;

use super::{
    hwloc, CpuInfo, DeviceInfo, Discovery, GidEntry, HwlocSource, PciLink, PortInfo, WARN,
};
use crate::error::{Error, Result};

fn read_trim(p: &Path) -> Option<String> {
    fs::read_to_string(p).ok().map(|s| s.trim().to_string())
}

fn sorted_names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = match fs::read_dir(dir) {
        Ok(rd) => rd
            .filter_map(|e| e.ok())
            .filter_map(|e| e.file_name().into_string().ok())
            .collect(),
        Err(_) => Vec::new(),
    };
    v.sort_by(|a, b| match (a.parse::<u64>(), b.parse::<u64>()) {
        (Ok(x), Ok(y)) => x.cmp(&y),
        _ => a.cmp(b),
    });
    v
}

/// `DDDD:BB:dd.f` → (domain, bus, device, function).
pub(super) fn parse_bdf(s: &str) -> Option<(u32, u32, u32, u32)> {
    let (dom, rest) = s.split_once(':')?;
    let (bus, rest) = rest.split_once(':')?;
    let (dev, func) = rest.split_once('.')?;
    if dom.len() < 4 || bus.len() != 2 || dev.len() != 2 || func.is_empty() {
        return None;
    }
    Some((
        u32::from_str_radix(dom, 16).ok()?,
        u32::from_str_radix(bus, 16).ok()?,
        u32::from_str_radix(dev, 16).ok()?,
        u32::from_str_radix(func, 16).ok()?,
    ))
}

/// A PCIe link speed (`32.0 GT/s PCIe`) in GT/s per lane (0 if unparsable).
pub(super) fn parse_gts(s: &str) -> f32 {
    s.split_whitespace()
        .next()
        .and_then(|t| t.parse::<f32>().ok())
        .unwrap_or(0.0)
}

fn parse_gid(s: &str) -> Option<[u8; 16]> {
    let mut out = [0u8; 16];
    let groups: Vec<&str> = s.trim().split(':').collect();
    if groups.len() != 8 {
        return None;
    }
    for (i, g) in groups.iter().enumerate() {
        let v = u16::from_str_radix(g, 16).ok()?;
        out[2 * i..2 * i + 2].copy_from_slice(&v.to_be_bytes());
    }
    Some(out)
}

/// Parses a kernel CPU list (`0-4,10-14`).
fn parse_cpulist(s: &str) -> Vec<usize> {
    let mut v = Vec::new();
    for part in s.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                if let (Ok(a), Ok(b)) = (a.trim().parse::<usize>(), b.trim().parse::<usize>()) {
                    v.extend(a..=b.min(a + 65536));
                }
            }
            None => {
                if let Ok(a) = part.trim().parse::<usize>() {
                    v.push(a);
                }
            }
        }
    }
    v.sort_unstable();
    v.dedup();
    v
}

/// Formats a CPU list compactly (`5-9,15-19`).
pub(super) fn format_cpulist(cpus: &[usize]) -> String {
    let mut out = Vec::new();
    let mut i = 0;
    while i < cpus.len() {
        let mut j = i;
        while j + 1 < cpus.len() && cpus[j + 1] == cpus[j] + 1 {
            j += 1;
        }
        out.push(if i == j {
            cpus[i].to_string()
        } else {
            format!("{}-{}", cpus[i], cpus[j])
        });
        i = j + 1;
    }
    if out.is_empty() {
        "none".into()
    } else {
        out.join(",")
    }
}

/// The kernel's RoCE rule (`iboe_get_mtu`): the largest IB MTU not above the
/// netdev MTU less GRH 40 + UDP 8 + BTH 12 + XRC 4 + AtomicETH 28 + ICRC 4.
fn roce_mtu_from_netdev(mtu: u32) -> Option<u32> {
    let eff = mtu.checked_sub(96)?;
    [4096, 2048, 1024, 512, 256].into_iter().find(|&m| m <= eff)
}

/// Parses an `active_mtu` file leniently: `4096`, `4096 (5)` or `5` (enum).
fn parse_active_mtu(s: &str) -> Option<u32> {
    let n: u32 = s.split_whitespace().next()?.parse().ok()?;
    match n {
        1..=5 => Some(128u32 << n),
        256 | 512 | 1024 | 2048 | 4096 => Some(n),
        _ => None,
    }
}

/// The PCI path of a device under sysfs: (function address, root port).
fn pci_of(sysfs: &Path, dev_dir: &Path) -> Option<(String, String)> {
    let link = dev_dir.join("device");
    let real = fs::canonicalize(&link).ok()?;
    let base = fs::canonicalize(sysfs.join("sys")).ok()?;
    let rel = real.strip_prefix(&base).ok()?;
    let comps: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    let host = comps.iter().position(|c| c.starts_with("pci"))?;
    let root = comps.get(host + 1).filter(|c| parse_bdf(c).is_some())?;
    let func = comps.iter().rev().find(|c| parse_bdf(c).is_some())?;
    Some((func.clone(), root.clone()))
}

fn read_gids(port_dir: &Path) -> Vec<GidEntry> {
    let mut out = Vec::new();
    for n in sorted_names(&port_dir.join("gids")) {
        let Ok(index) = n.parse::<u32>() else {
            continue;
        };
        let Some(gid) = read_trim(&port_dir.join("gids").join(&n)).and_then(|s| parse_gid(&s))
        else {
            continue;
        };
        if gid.iter().all(|&b| b == 0) {
            continue;
        }
        let kind = read_trim(&port_dir.join("gid_attrs/types").join(&n)).filter(|s| !s.is_empty());
        let ndev = read_trim(&port_dir.join("gid_attrs/ndevs").join(&n)).filter(|s| !s.is_empty());
        out.push(GidEntry {
            index,
            gid,
            kind,
            ndev,
        });
    }
    out
}

pub(super) fn read_device(sysfs: &Path, name: &str) -> DeviceInfo {
    let dir = sysfs.join("sys/class/infiniband").join(name);
    let pci = pci_of(sysfs, &dir);
    let pci_dir = dir.join("device");
    let (pci_addr, root) = match &pci {
        Some((f, r)) => (Some(f.clone()), r.clone()),
        None => (None, name.to_string()),
    };
    let mut netdevs = Vec::new();
    if pci_addr.is_some() {
        netdevs = sorted_names(&pci_dir.join("net"));
    }
    if netdevs.is_empty() {
        // Software devices (rxe, siw) name their netdev in `parent`; failing
        // that, GID 0 (the link-local GID) belongs to the base netdev.
        if let Some(p) = read_trim(&dir.join("parent")).filter(|s| !s.is_empty()) {
            netdevs.push(p);
        }
    }
    let mut ports = Vec::new();
    for p in sorted_names(&dir.join("ports")) {
        let Ok(port) = p.parse::<u8>() else { continue };
        let pd = dir.join("ports").join(&p);
        let gids = read_gids(&pd);
        if netdevs.is_empty() {
            if let Some(nd) = read_trim(&pd.join("gid_attrs/ndevs/0")).filter(|s| !s.is_empty()) {
                netdevs.push(nd);
            }
        }
        ports.push(PortInfo {
            port,
            state: read_trim(&pd.join("state")).unwrap_or_default(),
            phys_state: read_trim(&pd.join("phys_state")).unwrap_or_default(),
            link_layer: read_trim(&pd.join("link_layer")).unwrap_or_default(),
            gids,
            active_mtu: None,
        });
    }
    // MTU needs the netdev, known only now.
    for port in ports.iter_mut() {
        let pd = dir.join("ports").join(port.port.to_string());
        port.active_mtu = read_trim(&pd.join("active_mtu"))
            .and_then(|s| parse_active_mtu(&s))
            .map(|m| (m, "ports/N/active_mtu"))
            .or_else(|| {
                // The port's netdev: the one its GIDs are on, if it is the
                // device's own, else the device's first.
                let nd = port
                    .gids
                    .iter()
                    .filter_map(|g| g.ndev.as_ref())
                    .find(|n| netdevs.contains(n))
                    .or(netdevs.first())?;
                let m: u32 = read_trim(&sysfs.join("sys/class/net").join(nd).join("mtu"))?
                    .parse()
                    .ok()?;
                roce_mtu_from_netdev(m).map(|x| (x, "netdev MTU less RoCE headers"))
            });
    }
    let link = pci_addr.as_ref().and_then(|_| {
        Some(PciLink {
            speed: read_trim(&pci_dir.join("current_link_speed"))?,
            width: read_trim(&pci_dir.join("current_link_width"))?
                .parse()
                .ok()?,
            max_speed: read_trim(&pci_dir.join("max_link_speed")),
            max_width: read_trim(&pci_dir.join("max_link_width")).and_then(|s| s.parse().ok()),
        })
    });
    let local_cpus = if pci_addr.is_some() {
        read_trim(&pci_dir.join("local_cpulist"))
            .map(|s| parse_cpulist(&s))
            .unwrap_or_default()
    } else {
        Vec::new()
    };
    DeviceInfo {
        name: name.to_string(),
        virtual_function: pci_addr.is_some() && pci_dir.join("physfn").exists(),
        pci: pci_addr,
        root,
        netdevs,
        ports,
        link,
        sys_image_guid: read_trim(&dir.join("sys_image_guid")),
        local_cpus,
        hwloc_root: None,
    }
}

fn cpu_part_is_big(part: u32) -> bool {
    // Arm Cortex-X parts: X1 0xd44, X2 0xd48, X3 0xd4e, X4 0xd82, X925 0xd85.
    matches!(part, 0xd44 | 0xd48 | 0xd4e | 0xd82 | 0xd85)
}

/// Big cores from sysfs: the highest `cpu_capacity`, else Cortex-X MIDRs.
fn big_cores_sysfs(sysfs: &Path, online: &[usize]) -> (Vec<usize>, String) {
    let cpu = |c: usize| sysfs.join(format!("sys/devices/system/cpu/cpu{c}"));
    let caps: Vec<(usize, u64)> = online
        .iter()
        .filter_map(|&c| Some((c, read_trim(&cpu(c).join("cpu_capacity"))?.parse().ok()?)))
        .collect();
    if caps.len() == online.len() && !caps.is_empty() {
        let max = caps.iter().map(|x| x.1).max().unwrap_or(0);
        if caps.iter().any(|x| x.1 != max) {
            return (
                caps.iter().filter(|x| x.1 == max).map(|x| x.0).collect(),
                format!("sysfs cpu_capacity (highest = {max})"),
            );
        }
    }
    let big: Vec<usize> = online
        .iter()
        .copied()
        .filter(|&c| {
            read_trim(&cpu(c).join("regs/identification/midr_el1"))
                .and_then(|s| u64::from_str_radix(s.trim_start_matches("0x"), 16).ok())
                .is_some_and(|m| cpu_part_is_big(((m >> 4) & 0xfff) as u32))
        })
        .collect();
    if !big.is_empty() && big.len() < online.len() {
        return (big, "sysfs MIDR (Cortex-X parts)".into());
    }
    (
        Vec::new(),
        "no CPU kinds found (all CPUs treated alike)".into(),
    )
}

/// Discovers RDMA devices and CPUs under `sysfs_root` (`/` for the live
/// system), with hwloc from `hwloc`.
pub fn discover_in(sysfs_root: &Path, hwloc: HwlocSource<'_>) -> Result<Discovery> {
    let class = sysfs_root.join("sys/class/infiniband");
    if !class.is_dir() {
        return Err(Error::Unavailable {
            what: "RDMA",
            reason: format!(
                "{} does not exist: this kernel has no RDMA stack loaded. Load the \
                 driver (modprobe mlx5_ib, or rdma_rxe for soft-RoCE) or use ARX_FABRIC=shm",
                class.display()
            ),
        });
    }
    let names = sorted_names(&class);
    if names.is_empty() {
        return Err(Error::Unavailable {
            what: "RDMA",
            reason: format!(
                "{} is empty: no RDMA device. Check the NIC driver (mlx5_ib) or create a \
                 soft-RoCE device (rdma link add rxe0 type rxe netdev <if>)",
                class.display()
            ),
        });
    }
    let mut notes = Vec::new();
    let mut devices: Vec<DeviceInfo> = names.iter().map(|n| read_device(sysfs_root, n)).collect();
    devices.sort_by_key(|d| (d.root_key(), d.function(), d.name.clone()));
    let online = read_trim(&sysfs_root.join("sys/devices/system/cpu/online"))
        .map(|s| parse_cpulist(&s))
        .unwrap_or_default();
    let mut cpus = CpuInfo {
        online,
        ..Default::default()
    };

    let hw = match hwloc {
        HwlocSource::Off => None,
        HwlocSource::Live => Some(hwloc::load(None)),
        HwlocSource::Xml(p) => Some(hwloc::load(Some(p))),
    };
    let hw = match hw {
        None => {
            notes.push("hwloc not used: sysfs alone".into());
            None
        }
        Some(Err(e)) => {
            log::info!("arx topology: hwloc unusable ({e}); using sysfs alone");
            notes.push(format!("hwloc unusable ({e}); sysfs alone"));
            None
        }
        Some(Ok(t)) => Some(t),
    };
    if let Some(t) = &hw {
        notes.push(format!("hwloc {} loaded ({})", t.version, t.source));
        if cpus.online.is_empty() {
            cpus.online = t.online.clone();
        }
        for d in &mut devices {
            match t.devices.iter().find(|o| o.name == d.name) {
                Some(o) => {
                    d.hwloc_root = o.root.clone();
                    if !o.local_cpus.is_empty() {
                        d.local_cpus = o.local_cpus.clone();
                    }
                    if let (Some(a), Some(b)) = (&o.pci, &d.pci) {
                        if a != b {
                            notes.push(format!(
                                "{WARN}{}: hwloc places it at PCI {a}, sysfs at {b}; using sysfs",
                                d.name
                            ));
                        }
                    }
                    if let (Some(a), true) = (&o.root, d.pci.is_some()) {
                        if *a != d.root {
                            notes.push(format!(
                                "{WARN}{}: hwloc's PCIe root is {a}, sysfs's {}; using sysfs",
                                d.name, d.root
                            ));
                        }
                    }
                }
                None if d.pci.is_some() => notes.push(format!(
                    "{}: not among hwloc's OpenFabrics devices (sysfs is used)",
                    d.name
                )),
                None => {}
            }
        }
        for o in &t.devices {
            if !devices.iter().any(|d| d.name == o.name) {
                notes.push(format!(
                    "{WARN}hwloc lists OpenFabrics device {} that sysfs does not; ignored",
                    o.name
                ));
            }
        }
        if let Some((big, why)) = t.big_cores(&cpus.online) {
            cpus.big = big;
            cpus.big_source = why;
        }
    }
    if cpus.big_source.is_empty() {
        let (big, why) = big_cores_sysfs(sysfs_root, &cpus.online);
        cpus.big = big;
        cpus.big_source = why;
    }
    Ok(Discovery {
        devices,
        cpus,
        notes,
        addrs: super::ifaddr::read(sysfs_root),
    })
}

/// The node's CPUs for placing the Shm fabric's proxy and copy threads
/// (no RDMA device involved): online CPUs and big cores from sysfs under
/// `root` (`/` for the live system). Which of them this process may use
/// is probed (`cpu::allowed_cpus`), not read from cgroup files, whose
/// layout differs between cgroup versions and containers.
pub(crate) fn shm_cpu_info(root: &Path) -> CpuInfo {
    let online = read_trim(&root.join("sys/devices/system/cpu/online"))
        .map(|s| parse_cpulist(&s))
        .unwrap_or_default();
    let (big, big_source) = big_cores_sysfs(root, &online);
    CpuInfo {
        online,
        big,
        big_source,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::topology::test_util::{cfg_with, fixture, has_note, names};
    use crate::topology::{select_in, LocalRank, ThreadCpus};

    #[test]
    fn hwloc_xml_supplies_cpu_kinds_and_confirms_roots() {
        let xml = fixture("gb10.xml");
        let root = fixture("spark_nokinds");
        let d = discover_in(&root, HwlocSource::Xml(&xml)).unwrap();
        assert_eq!(d.cpus.big, [5, 6, 7, 8, 9, 15, 16, 17, 18, 19]);
        assert!(d.cpus.big_source.contains("hwloc"), "{}", d.cpus.big_source);
        for dev in &d.devices {
            assert_eq!(dev.hwloc_root.as_deref(), Some(dev.root.as_str()));
        }
        // Main thread on 19, bound to the big cores: hwloc's kinds keep the
        // proxy on a big core; sysfs alone (no kinds here) cannot.
        let me = ThreadCpus {
            current: Some(19),
            bound: Some(vec![5, 6, 7, 8, 9, 15, 16, 17, 18, 19]),
        };
        let cfg = cfg_with(&[]);
        let with = select_in(&root, HwlocSource::Xml(&xml), &cfg, &me, &LocalRank::ALONE).unwrap();
        assert_eq!(with.proxy_cpu, Some(18), "{:#?}", with.notes);
        assert_eq!(with.warnings().count(), 0, "{:#?}", with.notes);
        let without = select_in(&root, HwlocSource::Off, &cfg, &me, &LocalRank::ALONE).unwrap();
        assert_eq!(without.proxy_cpu, Some(14), "{:#?}", without.notes);
        assert_eq!(with.lanes, without.lanes);
    }

    #[test]
    fn hwloc_root_disagreement_is_reported() {
        // hwloc (the GB10 XML) lists OpenFabrics devices that this sysfs
        // tree (two rxe devices) lacks: noted, and sysfs wins.
        let xml = fixture("gb10.xml");
        let d = discover_in(&fixture("rxe2"), HwlocSource::Xml(&xml)).unwrap();
        assert!(
            d.notes
                .iter()
                .any(|n| n.contains("hwloc lists OpenFabrics device rocep1s0f0")),
            "{:#?}",
            d.notes
        );
    }

    #[test]
    fn hwloc_root_port_disagreement_is_a_warning_and_sysfs_wins() {
        let xml = fixture("gb10_other_rootport.xml");
        let s = select_in(
            &fixture("spark_both"),
            HwlocSource::Xml(&xml),
            &cfg_with(&[]),
            &ThreadCpus::default(),
            &LocalRank::ALONE,
        )
        .unwrap();
        assert_eq!(s.lanes[0].root, "0000:00:00.0");
        assert!(
            s.warnings()
                .any(|n| n.contains("hwloc's PCIe root is 0000:00:01.0")),
            "{:#?}",
            s.notes
        );
    }

    #[test]
    fn unusable_hwloc_falls_back_to_sysfs() {
        let s = select_in(
            &fixture("spark_both"),
            HwlocSource::Xml(Path::new("/nonexistent/topo.xml")),
            &cfg_with(&[]),
            &ThreadCpus::default(),
            &LocalRank::ALONE,
        )
        .unwrap();
        assert_eq!(names(&s), ["rocep1s0f0", "roceP2p1s0f0"]);
        assert!(has_note(&s, "hwloc unusable"), "{:#?}", s.notes);
        assert_eq!(s.proxy_cpu, Some(19));
    }

    #[test]
    fn shm_cpu_info_reads_online() {
        let base = std::env::temp_dir().join(format!("arx-cpus-{}", std::process::id()));
        let _ = fs::remove_dir_all(&base);
        fs::create_dir_all(base.join("sys/devices/system/cpu")).unwrap();
        assert!(shm_cpu_info(&base).online.is_empty());
        fs::write(base.join("sys/devices/system/cpu/online"), "0-3,6\n").unwrap();
        assert_eq!(shm_cpu_info(&base).online, [0, 1, 2, 3, 6]);
        let _ = fs::remove_dir_all(&base);
    }

    #[test]
    fn no_rdma_stack_or_no_device_is_unavailable() {
        let base = std::env::temp_dir().join(format!("arx-topo-{}", std::process::id()));
        let _ = fs::remove_dir_all(&base);
        fs::create_dir_all(base.join("sys/class")).unwrap();
        let e = select_in(
            &base,
            HwlocSource::Off,
            &cfg_with(&[]),
            &ThreadCpus::default(),
            &LocalRank::ALONE,
        )
        .unwrap_err();
        assert!(matches!(e, Error::Unavailable { .. }), "{e:?}");
        assert!(e.to_string().contains("no RDMA stack"), "{e}");
        fs::create_dir_all(base.join("sys/class/infiniband")).unwrap();
        let e = select_in(
            &base,
            HwlocSource::Off,
            &cfg_with(&[]),
            &ThreadCpus::default(),
            &LocalRank::ALONE,
        )
        .unwrap_err();
        assert!(matches!(e, Error::Unavailable { .. }), "{e:?}");
        assert!(e.to_string().contains("no RDMA device"), "{e}");
        let _ = fs::remove_dir_all(&base);
    }

    #[test]
    fn parsers() {
        assert_eq!(
            parse_cpulist("0-4,10-14\n"),
            [0, 1, 2, 3, 4, 10, 11, 12, 13, 14]
        );
        assert_eq!(format_cpulist(&[5, 6, 7, 8, 9, 15, 19]), "5-9,15,19");
        assert_eq!(parse_bdf("0002:01:00.1"), Some((2, 1, 0, 1)));
        assert_eq!(parse_bdf("rxe0"), None);
        assert_eq!(parse_active_mtu("4096 (5)"), Some(4096));
        assert_eq!(parse_active_mtu("5"), Some(4096));
        assert_eq!(parse_active_mtu("1024"), Some(1024));
        assert_eq!(roce_mtu_from_netdev(4200), Some(4096));
        assert_eq!(roce_mtu_from_netdev(9000), Some(4096));
        assert_eq!(roce_mtu_from_netdev(4000), Some(2048));
        assert_eq!(roce_mtu_from_netdev(1500), Some(1024));
        assert_eq!(roce_mtu_from_netdev(300), None);
        let g = parse_gid("0000:0000:0000:0000:0000:ffff:0a4d:0001").unwrap();
        assert_eq!(g[10..], [0xff, 0xff, 10, 77, 0, 1]);
        assert!(parse_gid("fe80::1").is_none());
    }
}
