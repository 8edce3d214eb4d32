//! RDMA device discovery and selection (hwloc + sysfs), proxy pinning.
//!
//! Finds every RDMA device that could carry a lane (ACTIVE, with a RoCE v2
//! IPv4 GID on its own netdev, and that address's prefix), picks the
//! primary lanes (one device per PCIe root for the lowest port ACTIVE on
//! both roots), reads MTU and PCIe link, checks RLIMIT_MEMLOCK, and chooses
//! the proxy's core. Which devices reach which peer is decided later, from
//! every rank's devices, by [`route::plan`] (per-peer routes: a 3-Spark
//! ring reaches each neighbour through the port cabled to it).
//!
//! # Where each part lives
//!
//! * `sysfs.rs`: discovery, [`discover_in`]: devices, ports, GIDs, PCIe links
//!   and CPUs from sysfs, completed and cross-checked by hwloc (`hwloc.rs`,
//!   the hwloc FFI).
//! * `gid.rs`: the GID choice, per device.
//! * `choose.rs`: the primary lanes and the candidates; PCIe link warnings.
//! * `route.rs`: per-peer routes from every rank's candidates (subnet
//!   matching, rails, relays, the fallback to primary lanes).
//! * `ifaddr.rs`: the netdevs' IPv4 addresses and prefixes (`getifaddrs`).
//! * `cpu.rs`: the proxy's CPU per local rank; [`pin_current_thread`].
//! * `memlock.rs`: [`memlock_needed`], [`check_memlock`], [`memlock_limits`].
//! * `ibv.rs`: [`ibv_devices`], the devices libibverbs itself lists.
//! * `report.rs`: [`report`], what `examples/doctor` prints.
//! * `mod.rs`: the types, and [`select`], which runs discovery, the lane
//!   choice and the proxy CPU choice in turn.
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

mod choose;
mod cpu;
mod gid;
mod hwloc;
mod ibv;
mod ifaddr;
mod memlock;
mod report;
pub mod route;
mod sysfs;
#[cfg(test)]
mod test_util;

use std::path::Path;

use crate::config::Config;
use crate::error::Result;

pub use cpu::pin_current_thread;
pub(crate) use cpu::{
    allowed_cpus, choose_shm_cpus, claimed_cpus, cpu_words, sole_bound_cpu, CpuClaim, ShmCpus,
    ShmRank,
};
pub use gid::{format_gid, gid_drift};
pub use ibv::ibv_devices;
pub use ifaddr::{network, IfAddr};
pub use memlock::{check_memlock, memlock_limits, memlock_needed};
pub use report::{report, report_in};
pub use sysfs::discover_in;
pub(crate) use sysfs::shm_cpu_info;

use choose::{candidates, lane_devices, lanes_on, pcie_notes};
use cpu::choose_proxy_cpu;
use sysfs::{parse_bdf, parse_gts};

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
    /// PCI function: the physical port on a Spark's ConnectX-7 (0 for
    /// software devices).
    pub function: u32,
    /// The IPv4 address of the GID (IPv4-mapped RoCE v2), if any.
    pub ipv4: Option<std::net::Ipv4Addr>,
    /// The prefix length of that address on the netdev, when the netdev
    /// shows it (see `ifaddr.rs`): per-peer routes match subnets with it.
    pub prefix: Option<u8>,
}

impl LaneDevice {
    /// What other ranks learn of this device for route planning.
    pub fn port_addr(&self) -> route::PortAddr {
        route::PortAddr {
            name: self.name.clone(),
            root: self.root.clone(),
            function: self.function,
            ipv4: self.ipv4,
            prefix: self.prefix,
        }
    }
}

/// What topology chose for this rank.
#[derive(Debug, Clone)]
pub struct Selection {
    /// Lane 0 and lane 1 devices (the same device twice for a one-root NIC):
    /// the primary lanes, the port topology chooses alone. Peers are reached
    /// through the devices of [`Selection::candidates`] that
    /// [`route::plan`] picks; the primary lanes are its fallback.
    pub lanes: Vec<LaneDevice>,
    /// Every device that could carry a lane: ACTIVE, with a RoCE v2 IPv4 GID,
    /// in discovery order (PCIe root, function). With `ARX_DEVICES`, the
    /// named devices only.
    pub candidates: Vec<LaneDevice>,
    /// `ARX_DEVICES` chose the devices (every peer on the primary lanes).
    pub fixed: bool,
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

    /// This rank's record for route planning: the candidates, and the
    /// primary lanes among them.
    pub fn ports(&self) -> route::RankPorts {
        let at = |l: &LaneDevice| {
            self.candidates
                .iter()
                .position(|c| c.name == l.name)
                .unwrap_or(0)
        };
        route::RankPorts {
            fixed: self.fixed,
            devices: self.candidates.iter().map(LaneDevice::port_addr).collect(),
            primary: [
                self.lanes.first().map_or(0, at),
                self.lanes.get(1).or(self.lanes.first()).map_or(0, at),
            ],
        }
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
    /// CPUs that live instances in the processes of this node's ranks
    /// pinned their proxies to: a second instance's proxy goes elsewhere
    /// while enough other CPUs remain. The same list on every rank of the
    /// node (gathered); empty when unknown.
    pub claimed_cpus: Vec<usize>,
}

impl LocalRank {
    /// The only rank on its node.
    pub const ALONE: LocalRank = LocalRank {
        index: 0,
        count: 1,
        main_cpus: Vec::new(),
        claimed_cpus: Vec::new(),
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
            claimed_cpus: Vec::new(),
        }
    }

    /// As [`LocalRank::among`], with the CPUs the node's ranks' main threads
    /// are bound to alone and the CPUs their processes' live instances
    /// claimed, learnt from every rank. Collective over `boot`.
    pub(crate) fn gather<S: AsRef<str>>(
        boot: &crate::bootstrap::Bootstrap,
        hosts: &[S],
        rank: usize,
    ) -> Result<Self> {
        let mut local = LocalRank::among(hosts, rank);
        let sole = cpu::sole_bound_cpu();
        // Little-endian words: the main thread's one CPU (u64::MAX: not
        // bound to one), then the claimed CPUs.
        let mine: Vec<u8> = std::iter::once(sole.map_or(u64::MAX, |c| c as u64))
            .chain(cpu::claimed_cpus().into_iter().map(|c| c as u64))
            .flat_map(u64::to_le_bytes)
            .collect();
        let all = boot.all_gather_bytes("main thread and claimed CPUs", &mine)?;
        for (r, b) in all.iter().enumerate() {
            let same_node = hosts.get(r).map(AsRef::as_ref) == hosts.get(rank).map(AsRef::as_ref);
            if !same_node || b.len() % 8 != 0 {
                continue;
            }
            let mut words = b
                .chunks_exact(8)
                .map(|w| u64::from_le_bytes(w.try_into().expect("8-byte chunk")))
                .map(|w| (w != u64::MAX).then(|| usize::try_from(w).ok()).flatten());
            if let Some(Some(c)) = words.next() {
                local.main_cpus.push(c);
            }
            local.claimed_cpus.extend(words.flatten());
        }
        for v in [&mut local.main_cpus, &mut local.claimed_cpus] {
            v.sort_unstable();
            v.dedup();
        }
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
    /// IPv4 addresses of the netdevs (`getifaddrs`, or a fixture's `ifaddrs`).
    pub addrs: Vec<IfAddr>,
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
    let chosen = lane_devices(disc, cfg, &mut notes)?;
    let lanes = lanes_on(&chosen, disc, cfg, &mut notes)?;
    let candidates = candidates(disc, &lanes, cfg);
    pcie_notes(&chosen, &mut notes);
    let proxy_cpu = choose_proxy_cpu(disc, &chosen, cfg, me, local, &mut notes);
    for n in notes.iter().filter(|n| n.starts_with(WARN)) {
        log::warn!("arx topology: {}", &n[WARN.len()..]);
    }
    Ok(Selection {
        lanes,
        candidates,
        fixed: cfg.devices.is_some(),
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
