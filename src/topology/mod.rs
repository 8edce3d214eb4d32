//! RDMA device discovery and selection (hwloc + sysfs), proxy pinning.
//!
//! Picks one RDMA device per PCIe root for the physical port whose link is
//! ACTIVE on both roots, resolves each device's RoCE v2 GID on its own
//! netdev, reads MTU and PCIe link, checks RLIMIT_MEMLOCK, and chooses the
//! proxy's core.
//!
//! # Sources of truth
//!
//! sysfs (`/sys/class/infiniband`, the PCI device directories, `/sys/class/net`)
//! is the primary truth for devices, ports, GIDs and links: it is what the
//! kernel and rdma-core read. hwloc adds what sysfs states poorly: the CPU
//! kinds (big/little cores) and the CPUs near each device, and cross-checks
//! the PCIe root of each device. When hwloc cannot be loaded, selection goes
//! on from sysfs alone and says so in [`Selection::notes`].
//!
//! # The rules (DGX Spark, FACTS.md)
//!
//! * A ConnectX-7 on Spark is four PCI functions under two PCIe roots;
//!   physical port k is function k on both roots. Lanes pair function k of
//!   two roots, for the lowest k whose link is ACTIVE on both; lane 0 is the
//!   root with the lower PCI domain, so every rank orders lanes alike.
//! * A software device (rxe, siw: no PCI parent) is a root of its own.
//! * A NIC with one usable root gives both lanes the same device (a warning).
//! * Each device's GID index is resolved from its own GID table: RoCE v2,
//!   IPv4-mapped, on the device's own netdev (VLAN and other upper devices
//!   skipped). `ARX_GID_INDEX` overrides it for every device.
//! * MTU: sysfs has no `active_mtu` file (rdma-core gets it from
//!   `ibv_query_port`). Where a driver does provide `ports/N/active_mtu`, it
//!   is read; otherwise the active MTU is derived from the netdev MTU the way
//!   the kernel does for RoCE (`iboe_get_mtu`: the largest IB MTU not above
//!   the netdev MTU less 96 bytes of RoCE headers; 4200 → 4096, 1500 → 1024).
//!   The Verbs fabric should still prefer `ibv_query_port` where it can.

mod hwloc;

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::fs;
use std::path::Path;

use crate::config::{Config, Overrides};
use crate::error::{Error, Result};

/// One lane's device, as chosen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaneDevice {
    /// RDMA device name (`rocep1s0f0`).
    pub name: String,
    /// Port number (1 for RoCE functions).
    pub port: u8,
    /// GID table index of the RoCE v2 IPv4-mapped GID.
    pub gid_index: u32,
    /// That GID.
    pub gid: [u8; 16],
    /// The port's active MTU in bytes (256..4096).
    pub active_mtu: u32,
    /// The netdev the GID belongs to.
    pub netdev: String,
    /// PCI address (`0000:01:00.0`), None for software devices.
    pub pci: Option<String>,
    /// PCIe root: the PCI address of the root port the device sits under
    /// (`0000:00:00.0`; the device's own address when it sits on a root bus),
    /// or the device name for software devices.
    pub root: String,
}

/// What topology chose for this rank.
#[derive(Debug, Clone)]
pub struct Selection {
    /// Lane 0 and lane 1 devices (the same device twice for a one-root NIC).
    pub lanes: Vec<LaneDevice>,
    /// CPU the proxy thread is pinned to, if any.
    pub proxy_cpu: Option<usize>,
    /// Why each choice was made, for logs and `doctor`. Warnings start with
    /// `warning: ` (see [`Selection::warnings`]).
    pub notes: Vec<String>,
}

impl Selection {
    /// The notes that are warnings (a narrow PCIe link, a single root, ...).
    pub fn warnings(&self) -> impl Iterator<Item = &str> {
        self.notes
            .iter()
            .filter(|n| n.starts_with(WARN))
            .map(String::as_str)
    }

    /// Whether both lanes use one device (a one-root NIC, or one
    /// `ARX_DEVICES` name).
    pub fn single_device(&self) -> bool {
        self.lanes.len() < 2 || self.lanes[0].name == self.lanes[1].name
    }
}

const WARN: &str = "warning: ";

/// Where hwloc's view comes from.
#[derive(Debug, Clone, Copy)]
pub enum HwlocSource<'a> {
    /// The running machine.
    Live,
    /// An hwloc XML export (`lstopo --of xml`), for tests and for diagnosing
    /// another machine's topology.
    Xml(&'a Path),
    /// No hwloc: sysfs alone.
    Off,
}

/// The calling thread's CPU context, which the proxy core must avoid.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ThreadCpus {
    /// The CPU the calling (main) thread last ran on.
    pub current: Option<usize>,
    /// The calling thread's CPU binding, when it is bound to a subset of the
    /// online CPUs (`mpirun --bind-to core`, `taskset`, Slurm cgroups).
    pub bound: Option<Vec<usize>>,
}

impl ThreadCpus {
    /// The calling thread's context, read with hwloc (empty if hwloc fails).
    pub fn of_current_thread() -> Self {
        let Some(topo) = hwloc2::Topology::new() else {
            return ThreadCpus::default();
        };
        let flags = hwloc2::CpuBindFlags::CPUBIND_THREAD;
        let current = topo
            .get_cpu_location(flags)
            .and_then(|s| usize::try_from(s.first()).ok());
        let bound = topo
            .get_cpubind(flags)
            .map(|s| s.into_iter().map(|c| c as usize).collect::<Vec<_>>());
        ThreadCpus { current, bound }
    }

    /// The one CPU the thread is bound to, if it is bound to exactly one.
    pub fn sole_cpu(&self) -> Option<usize> {
        match self.bound.as_deref() {
            Some([c]) => Some(*c),
            _ => None,
        }
    }
}

/// This rank's place among the ranks of its node. The proxies of a node's
/// ranks are spread over distinct cores by it: each local rank takes its
/// own share of the node's preferred cores.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalRank {
    /// Index among the ranks of this node, in rank order (0-based).
    pub index: usize,
    /// Ranks on this node (at least 1).
    pub count: usize,
    /// CPUs to which the main thread of one of this node's ranks is bound
    /// alone (`mpirun --bind-to core`), as far as known: no proxy goes
    /// there while enough other CPUs remain. Must be the same list on every
    /// rank of the node (arx gathers it from every rank); empty when unknown.
    pub main_cpus: Vec<usize>,
}

impl LocalRank {
    /// The only rank on its node.
    pub const ALONE: LocalRank = LocalRank {
        index: 0,
        count: 1,
        main_cpus: Vec::new(),
    };

    /// `rank`'s place given every rank's node name in rank order
    /// (`hosts[r]` is rank r's, as `PeerInfo::host`); main threads unknown.
    pub fn among<S: AsRef<str>>(hosts: &[S], rank: usize) -> Self {
        let Some(mine) = hosts.get(rank).map(AsRef::as_ref) else {
            return LocalRank::ALONE;
        };
        let same = |h: &S| h.as_ref() == mine;
        LocalRank {
            index: hosts[..rank].iter().filter(|h| same(h)).count(),
            count: hosts.iter().filter(|h| same(h)).count(),
            main_cpus: Vec::new(),
        }
    }

    /// As [`LocalRank::among`], with the CPUs the node's ranks' main threads
    /// are bound to alone, learnt from every rank. Collective over `boot`.
    pub(crate) fn gather<S: AsRef<str>>(
        boot: &crate::bootstrap::Bootstrap,
        hosts: &[S],
        rank: usize,
    ) -> Result<Self> {
        let mut local = LocalRank::among(hosts, rank);
        let sole = ThreadCpus::of_current_thread().sole_cpu();
        let mine = sole.map_or(u64::MAX, |c| c as u64);
        let all = boot.all_gather_bytes("main thread CPUs", &mine.to_le_bytes())?;
        for (r, b) in all.iter().enumerate() {
            let same_node = hosts.get(r).map(AsRef::as_ref) == hosts.get(rank).map(AsRef::as_ref);
            let cpu = <[u8; 8]>::try_from(b.as_slice()).map(u64::from_le_bytes);
            if let (true, Ok(c)) = (same_node, cpu) {
                if c != u64::MAX {
                    local.main_cpus.push(c as usize);
                }
            }
        }
        local.main_cpus.sort_unstable();
        local.main_cpus.dedup();
        Ok(local)
    }
}

impl Default for LocalRank {
    fn default() -> Self {
        LocalRank::ALONE
    }
}

/// One GID table entry that could be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GidEntry {
    /// Index in the port's GID table.
    pub index: u32,
    /// The GID.
    pub gid: [u8; 16],
    /// `gid_attrs/types/N` (`RoCE v2`, `IB/RoCE v1`), if readable.
    pub kind: Option<String>,
    /// `gid_attrs/ndevs/N`, if readable.
    pub ndev: Option<String>,
}

impl GidEntry {
    /// Whether this is a RoCE v2 GID.
    pub fn is_roce_v2(&self) -> bool {
        self.kind
            .as_deref()
            .is_some_and(|k| k.trim().eq_ignore_ascii_case("RoCE v2"))
    }
    /// Whether the GID is an IPv4-mapped address (`::ffff:a.b.c.d`).
    pub fn is_ipv4_mapped(&self) -> bool {
        self.gid[..10].iter().all(|&b| b == 0) && self.gid[10] == 0xff && self.gid[11] == 0xff
    }
}

/// One port of an RDMA device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortInfo {
    /// Port number (1 for RoCE functions).
    pub port: u8,
    /// `ports/N/state`, e.g. `4: ACTIVE`.
    pub state: String,
    /// `ports/N/phys_state`, e.g. `5: LinkUp` (empty if absent).
    pub phys_state: String,
    /// `ports/N/link_layer` (`Ethernet` for RoCE, `InfiniBand`).
    pub link_layer: String,
    /// The readable GID entries.
    pub gids: Vec<GidEntry>,
    /// Active MTU in bytes, and how it was found.
    pub active_mtu: Option<(u32, &'static str)>,
}

impl PortInfo {
    /// Whether the logical state is ACTIVE and the physical link (where the
    /// driver reports it) is up.
    pub fn is_active(&self) -> bool {
        self.state.contains("ACTIVE")
            && (self.phys_state.is_empty() || self.phys_state.contains("LinkUp"))
    }
}

/// PCIe link of a PCI function.
#[derive(Debug, Clone, PartialEq)]
pub struct PciLink {
    /// `current_link_speed`, e.g. `32.0 GT/s PCIe`.
    pub speed: String,
    /// `current_link_width` (lanes).
    pub width: u32,
    /// `max_link_speed`, if present.
    pub max_speed: Option<String>,
    /// `max_link_width`, if present.
    pub max_width: Option<u32>,
}

impl PciLink {
    /// Transfer rate per lane in GT/s (0 if unparsable).
    pub fn gts(&self) -> f32 {
        parse_gts(&self.speed)
    }
}

fn parse_gts(s: &str) -> f32 {
    s.split_whitespace()
        .next()
        .and_then(|t| t.parse::<f32>().ok())
        .unwrap_or(0.0)
}

/// One RDMA device as discovered.
#[derive(Debug, Clone)]
pub struct DeviceInfo {
    /// RDMA device name.
    pub name: String,
    /// PCI address of the function, None for software devices.
    pub pci: Option<String>,
    /// PCIe root (see [`LaneDevice::root`]).
    pub root: String,
    /// The device's own netdevs (PCI `net/*`, or a software device's parent).
    pub netdevs: Vec<String>,
    /// Ports in number order.
    pub ports: Vec<PortInfo>,
    /// PCIe link, for PCI devices.
    pub link: Option<PciLink>,
    /// An SR-IOV virtual function (skipped unless named in `ARX_DEVICES`).
    pub virtual_function: bool,
    /// `sys_image_guid` (functions of one NIC share it).
    pub sys_image_guid: Option<String>,
    /// CPUs near the device (hwloc, else the PCI `local_cpulist`).
    pub local_cpus: Vec<usize>,
    /// The PCIe root hwloc reports, when hwloc saw the device.
    pub hwloc_root: Option<String>,
}

impl DeviceInfo {
    /// PCI function number: the physical port on a Spark's ConnectX-7 (0 for
    /// software devices).
    pub fn function(&self) -> u32 {
        self.pci
            .as_deref()
            .and_then(|p| p.rsplit('.').next())
            .and_then(|f| u32::from_str_radix(f, 16).ok())
            .unwrap_or(0)
    }
    /// The first ACTIVE port.
    pub fn active_port(&self) -> Option<&PortInfo> {
        self.ports.iter().find(|p| p.is_active())
    }
    fn root_key(&self) -> (u8, u32, u32, u32, u32, String) {
        match parse_bdf(&self.root) {
            Some((d, b, dev, f)) if self.pci.is_some() => (0, d, b, dev, f, String::new()),
            _ => (1, 0, 0, 0, 0, self.root.clone()),
        }
    }
}

/// CPU facts used for the proxy core.
#[derive(Debug, Clone, Default)]
pub struct CpuInfo {
    /// Online CPUs.
    pub online: Vec<usize>,
    /// The most performant CPU kind (empty when all CPUs are alike or unknown).
    pub big: Vec<usize>,
    /// Where `big` came from.
    pub big_source: String,
}

/// Everything discovered, before choosing.
#[derive(Debug, Clone)]
pub struct Discovery {
    /// RDMA devices in lane order: by PCIe root (lower domain first, then
    /// software devices by name), then function.
    pub devices: Vec<DeviceInfo>,
    /// CPU kinds and online CPUs.
    pub cpus: CpuInfo,
    /// Discovery notes (hwloc fallback, sysfs/hwloc disagreements).
    pub notes: Vec<String>,
}

// ---------------------------------------------------------------- sysfs --

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
fn parse_bdf(s: &str) -> Option<(u32, u32, u32, u32)> {
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

/// Formats a GID as sysfs does, with an IPv4 suffix when IPv4-mapped.
pub fn format_gid(g: &[u8; 16]) -> String {
    let mut s = String::new();
    for i in 0..8 {
        if i > 0 {
            s.push(':');
        }
        let _ = write!(s, "{:02x}{:02x}", g[2 * i], g[2 * i + 1]);
    }
    let e = GidEntry {
        index: 0,
        gid: *g,
        kind: None,
        ndev: None,
    };
    if e.is_ipv4_mapped() {
        let _ = write!(s, " ({}.{}.{}.{})", g[12], g[13], g[14], g[15]);
    }
    s
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
fn format_cpulist(cpus: &[usize]) -> String {
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

fn read_device(sysfs: &Path, name: &str) -> DeviceInfo {
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
    })
}

// ------------------------------------------------------------- choosing --

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

/// Resolves the GID of `d`'s port `port`, per device.
fn resolve_gid(
    d: &DeviceInfo,
    port: &PortInfo,
    cfg: &Config,
    notes: &mut Vec<String>,
) -> Result<(GidEntry, String)> {
    let own = |e: &GidEntry| e.ndev.as_ref().is_some_and(|n| d.netdevs.contains(n));
    if let Some(ix) = cfg.gid_index {
        let Some(e) = port.gids.iter().find(|e| e.index == ix) else {
            return Err(Error::Topology(format!(
                "ARX_GID_INDEX={ix}, but {} port {} has no readable GID at index {ix} \
                 (readable: {}); unset ARX_GID_INDEX to resolve it per device, or pick one \
                 from `show_gids`",
                d.name,
                port.port,
                port.gids
                    .iter()
                    .map(|e| e.index.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        };
        notes.push(format!(
            "{}: GID index {ix} from ARX_GID_INDEX (override)",
            d.name
        ));
        if !(e.is_roce_v2() && e.is_ipv4_mapped() && own(e)) {
            notes.push(format!(
                "{WARN}{}: ARX_GID_INDEX={ix} is {} {} on {}, not a RoCE v2 IPv4 GID on {}",
                d.name,
                e.kind.as_deref().unwrap_or("of unknown type"),
                format_gid(&e.gid),
                e.ndev.as_deref().unwrap_or("?"),
                d.netdevs.join("/")
            ));
        }
        let nd = e
            .ndev
            .clone()
            .or_else(|| d.netdevs.first().cloned())
            .unwrap_or_default();
        return Ok((e.clone(), nd));
    }
    let mut skipped = Vec::new();
    for e in &port.gids {
        if !e.is_roce_v2() {
            continue;
        }
        if !e.is_ipv4_mapped() {
            continue;
        }
        if !own(e) {
            skipped.push(format!(
                "index {} on {} (not the device's own netdev)",
                e.index,
                e.ndev.as_deref().unwrap_or("an unreadable netdev")
            ));
            continue;
        }
        if !skipped.is_empty() {
            notes.push(format!("{}: skipped GID {}", d.name, skipped.join(", ")));
        }
        let nd = e.ndev.clone().unwrap_or_default();
        notes.push(format!(
            "{}: GID index {} = {} (RoCE v2, IPv4-mapped, on {})",
            d.name,
            e.index,
            format_gid(&e.gid),
            nd
        ));
        return Ok((e.clone(), nd));
    }
    let table = if port.gids.is_empty() {
        "no readable GIDs".to_string()
    } else {
        port.gids
            .iter()
            .map(|e| {
                format!(
                    "{}: {} {} on {}",
                    e.index,
                    e.kind.as_deref().unwrap_or("?"),
                    format_gid(&e.gid),
                    e.ndev.as_deref().unwrap_or("?")
                )
            })
            .collect::<Vec<_>>()
            .join("; ")
    };
    Err(Error::Topology(format!(
        "{} port {}: no RoCE v2 IPv4-mapped GID on its own netdev {} (found {table}). \
         Give {} an IPv4 address (ip addr add <a.b.c.d/nn> dev {}; netplan apply), \
         or set ARX_GID_INDEX",
        d.name,
        port.port,
        if d.netdevs.is_empty() {
            "(none found)".to_string()
        } else {
            d.netdevs.join("/")
        },
        d.netdevs
            .first()
            .map(String::as_str)
            .unwrap_or("the netdev"),
        d.netdevs.first().map(String::as_str).unwrap_or("<netdev>"),
    )))
}

fn lane(d: &DeviceInfo, cfg: &Config, notes: &mut Vec<String>) -> Result<LaneDevice> {
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
    Ok(LaneDevice {
        name: d.name.clone(),
        port: port.port,
        gid_index: g.index,
        gid: g.gid,
        active_mtu,
        netdev,
        pci: d.pci.clone(),
        root: d.root.clone(),
    })
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

fn pcie_notes(lanes: &[&DeviceInfo], notes: &mut Vec<String>) {
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

fn choose_proxy_cpu(
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

/// Chooses lanes and the proxy core from a [`Discovery`], for local rank
/// `local` of its node.
pub fn select_from(
    disc: &Discovery,
    cfg: &Config,
    me: &ThreadCpus,
    local: &LocalRank,
) -> Result<Selection> {
    let mut notes = disc.notes.clone();
    let chosen: Vec<&DeviceInfo> = match &cfg.devices {
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
            v
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
            r?
        }
    };
    let mut lanes = Vec::with_capacity(2);
    for d in &chosen {
        if let Some(l) = lanes.iter().find(|l: &&LaneDevice| l.name == d.name) {
            lanes.push(l.clone());
            continue;
        }
        lanes.push(lane(d, cfg, &mut notes)?);
    }
    if lanes[0].active_mtu != lanes[1].active_mtu {
        notes.push(format!(
            "{WARN}lane MTUs differ ({} {} vs {} {})",
            lanes[0].name, lanes[0].active_mtu, lanes[1].name, lanes[1].active_mtu
        ));
    }
    pcie_notes(&chosen, &mut notes);
    let proxy_cpu = choose_proxy_cpu(disc, &chosen, cfg, me, local, &mut notes);
    for n in notes.iter().filter(|n| n.starts_with(WARN)) {
        log::warn!("arx topology: {}", &n[WARN.len()..]);
    }
    Ok(Selection {
        lanes,
        proxy_cpu,
        notes,
    })
}

/// As [`select`], on a sysfs tree under `sysfs_root` and hwloc from `hwloc`,
/// for a thread with CPU context `me`.
pub fn select_in(
    sysfs_root: &Path,
    hwloc: HwlocSource<'_>,
    cfg: &Config,
    me: &ThreadCpus,
    local: &LocalRank,
) -> Result<Selection> {
    let disc = discover_in(sysfs_root, hwloc)?;
    select_from(&disc, cfg, me, local)
}

/// Discovers RDMA devices and chooses the two lanes, and the proxy core of
/// local rank `local` (its own among the node's ranks' proxies).
pub fn select(cfg: &Config, local: &LocalRank) -> Result<Selection> {
    select_in(
        Path::new("/"),
        HwlocSource::Live,
        cfg,
        &ThreadCpus::of_current_thread(),
        local,
    )
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

// -------------------------------------------------------------- memlock --

fn human(b: u64) -> String {
    if b == u64::MAX {
        "unlimited".into()
    } else if b >= 1 << 30 {
        format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64)
    } else if b >= 1 << 20 {
        format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)
    } else {
        format!("{} KiB", b >> 10)
    }
}

fn check_memlock_with(needed: usize, soft: u64, hard: u64) -> Result<()> {
    if soft == u64::MAX || soft >= needed as u64 {
        return Ok(());
    }
    Err(Error::Topology(format!(
        "RLIMIT_MEMLOCK is {} (hard {}), but RDMA registration needs {} locked: raise it \
         before starting the ranks: `ulimit -l unlimited` in the launching shell (up to the \
         hard limit), `memlock unlimited` for the user in /etc/security/limits.conf, \
         `--ulimit memlock=-1` for containers (docker/podman), and under Slurm \
         `srun --propagate=MEMLOCK` (or PropagateResourceLimits in slurm.conf) with a raised \
         limit for slurmd (LimitMEMLOCK=infinity)",
        human(soft),
        human(hard),
        human(needed as u64)
    )))
}

/// Locked bytes one instance registers, about: send\[2\]\[slot\] and
/// recv\[2\]\[world\]\[slot\] plus a page-rounded control block and flags
/// (an estimate for reports; the fabric checks the real region size).
pub fn memlock_needed(slot_bytes: usize, world: usize) -> usize {
    slot_bytes
        .saturating_mul(2)
        .saturating_mul(world.saturating_add(1))
        .saturating_add(1 << 20)
}

/// Fails with an explanation when RLIMIT_MEMLOCK is below `needed` bytes.
pub fn check_memlock(needed: usize) -> Result<()> {
    let (soft, hard) = hwloc::memlock_limit().map_err(|e| Error::Os {
        call: "getrlimit(RLIMIT_MEMLOCK)",
        object: "this process".into(),
        detail: e,
    })?;
    check_memlock_with(needed, soft, hard)
}

// --------------------------------------------------------------- report --

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
    let memlock = hwloc::memlock_limit();
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
    use std::path::PathBuf;

    fn fixture(case: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/topology")
            .join(case)
    }

    fn cfg_with(vars: &[(&str, &str)]) -> Config {
        let vars: Vec<(String, String)> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Config::resolve_with(&Overrides::default(), move |k| {
            vars.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
        })
        .unwrap()
    }

    fn sel(case: &str, vars: &[(&str, &str)]) -> Result<Selection> {
        select_in(
            &fixture(case),
            HwlocSource::Off,
            &cfg_with(vars),
            &ThreadCpus::default(),
            &LocalRank::ALONE,
        )
    }

    fn names(s: &Selection) -> Vec<&str> {
        s.lanes.iter().map(|l| l.name.as_str()).collect()
    }

    fn has_note(s: &Selection, needle: &str) -> bool {
        s.notes.iter().any(|n| n.contains(needle))
    }

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
    fn missing_rocev2_gid_is_a_clear_error() {
        let e = sel("no_rocev2", &[]).unwrap_err();
        let m = e.to_string();
        assert!(matches!(e, Error::Topology(_)), "{e:?}");
        for needle in [
            "rocep1s0f0",
            "no RoCE v2 IPv4-mapped GID",
            "enp1s0f0np0",
            "ip addr add",
            "ARX_GID_INDEX",
            "2: IB/RoCE v1",
        ] {
            assert!(m.contains(needle), "missing {needle:?} in {m}");
        }
    }

    #[test]
    fn gid_index_is_resolved_per_device() {
        let s = sel("spark_gid_3_and_4", &[]).unwrap();
        assert_eq!(names(&s), ["rocep1s0f0", "roceP2p1s0f0"]);
        assert_eq!(s.lanes[0].gid_index, 3);
        assert_eq!(s.lanes[1].gid_index, 4);
        assert_eq!(s.lanes[1].gid[12..], [10, 0, 2, 10]);
    }

    #[test]
    fn vlan_ipv6_and_unreadable_gids_are_skipped() {
        let s = sel("spark_vlan", &[]).unwrap();
        assert_eq!(s.lanes[0].gid_index, 8);
        assert_eq!(s.lanes[0].netdev, "enp1s0f0np0");
        assert_eq!(s.lanes[0].gid[12..], [10, 0, 0, 10]);
        assert_eq!(s.lanes[1].gid_index, 3);
        assert!(has_note(&s, "enp1s0f0np0.100"), "{:#?}", s.notes);
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
    fn arx_gid_index_override_is_honoured() {
        let s = sel("spark_both", &[("ARX_GID_INDEX", "2")]).unwrap();
        assert!(s.lanes.iter().all(|l| l.gid_index == 2));
        assert!(has_note(&s, "ARX_GID_INDEX"));
        // Index 2 is RoCE v1 here: honoured, with a warning.
        assert!(s.warnings().any(|n| n.contains("not a RoCE v2 IPv4 GID")));

        let e = sel("spark_both", &[("ARX_GID_INDEX", "5")]).unwrap_err();
        assert!(e.to_string().contains("no readable GID at index 5"), "{e}");
    }

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
    fn memlock_message_says_how_to_raise_it() {
        let e = check_memlock_with(64 << 20, 8 << 20, 8 << 20).unwrap_err();
        let m = e.to_string();
        for needle in [
            "8.0 MiB",
            "64.0 MiB",
            "ulimit -l unlimited",
            "--ulimit memlock=-1",
            "--propagate=MEMLOCK",
            "limits.conf",
        ] {
            assert!(m.contains(needle), "missing {needle:?} in {m}");
        }
        assert!(check_memlock_with(64 << 20, u64::MAX, u64::MAX).is_ok());
        assert!(check_memlock_with(64 << 20, 64 << 20, 64 << 20).is_ok());
        assert!(check_memlock(0).is_ok());
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
