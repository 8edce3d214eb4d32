//! RDMA device discovery and selection (hwloc + sysfs), proxy pinning.
//!
//! Picks one RDMA device per PCIe root for the physical port whose link is
//! ACTIVE on both roots, resolves each device's RoCE v2 GID on its own
//! netdev, reads MTU and PCIe link, checks RLIMIT_MEMLOCK, and chooses the
//! proxy's core.

use crate::config::Config;
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
    /// PCIe root (domain:bus of the root port), or the device name for
    /// software devices.
    pub root: String,
}

/// What topology chose for this rank.
#[derive(Debug, Clone)]
pub struct Selection {
    /// Lane 0 and lane 1 devices (the same device twice for a one-root NIC).
    pub lanes: Vec<LaneDevice>,
    /// CPU the proxy thread is pinned to, if any.
    pub proxy_cpu: Option<usize>,
    /// Why each choice was made, for logs and `doctor`.
    pub notes: Vec<String>,
}

/// Discovers RDMA devices and chooses the two lanes.
pub fn select(_cfg: &Config) -> Result<Selection> {
    Err(Error::Unavailable {
        what: "RDMA device selection",
        reason: "not implemented yet".into(),
    })
}

/// Pins the calling thread to `cpu`.
pub fn pin_current_thread(cpu: usize) -> Result<()> {
    Err(Error::Unavailable {
        what: "thread pinning",
        reason: format!("not implemented yet (cpu {cpu})"),
    })
}
