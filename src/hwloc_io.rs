//! Topology's FFI, in one place: hwloc's I/O objects and CPU kinds through
//! bindings that build.rs generates from `<hwloc.h>` (the hwloc2 crate cannot
//! see I/O objects, FACTS.md), and `getrlimit(RLIMIT_MEMLOCK)`.
//!
//! Everything here returns plain Rust data; no hwloc pointer leaves this
//! module.

use std::path::Path;

/// An OpenFabrics OS device as hwloc sees it.
#[derive(Debug, Clone, Default)]
pub(crate) struct HwOsDev {
    /// RDMA device name (`rocep1s0f0`).
    pub name: String,
    /// PCI address of the function it hangs off.
    pub pci: Option<String>,
    /// PCI address of the bridge right below the host bridge (the root port).
    pub root: Option<String>,
    /// CPUs of the device's nearest non-I/O ancestor.
    pub local_cpus: Vec<usize>,
}

/// One CPU kind (hwloc ≥ 2.4), in hwloc's order: least to most performant.
#[derive(Debug, Clone, Default)]
pub(crate) struct HwCpuKind {
    /// PUs of that kind.
    pub pus: Vec<usize>,
    /// hwloc's efficiency rank (-1 unknown).
    pub efficiency: i32,
    /// Name/value infos (`CoreType`, `FrequencyMaxMHz`, ...).
    pub infos: Vec<(String, String)>,
}

/// What topology needs from hwloc.
#[derive(Debug, Clone, Default)]
pub(crate) struct HwTopology {
    /// hwloc's runtime version (`2.9.0`).
    pub version: String,
    /// `live` or the XML path.
    pub source: String,
    /// PUs of the machine.
    pub online: Vec<usize>,
    /// OpenFabrics OS devices.
    pub devices: Vec<HwOsDev>,
    /// CPU kinds.
    pub kinds: Vec<HwCpuKind>,
}

impl HwTopology {
    /// The most performant kind's PUs among `online`, and why; None when
    /// hwloc has no usable kinds (one kind, or unknown efficiencies).
    pub fn big_cores(&self, online: &[usize]) -> Option<(Vec<usize>, String)> {
        if self.kinds.len() < 2 {
            return None;
        }
        let describe = |k: &HwCpuKind| {
            k.infos
                .iter()
                .map(|(n, v)| format!("{n}={v}"))
                .collect::<Vec<_>>()
                .join(" ")
        };
        // hwloc lists kinds from least to most performant when it knows
        // their efficiencies; without them the order means nothing, so look
        // for a Cortex-X name instead.
        let kind = if self.kinds.iter().all(|k| k.efficiency >= 0) {
            self.kinds.iter().max_by_key(|k| k.efficiency)?
        } else {
            self.kinds.iter().find(|k| {
                k.infos
                    .iter()
                    .any(|(_, v)| v.contains("X925") || v.contains("Cortex-X"))
            })?
        };
        let pus: Vec<usize> = kind
            .pus
            .iter()
            .copied()
            .filter(|p| online.is_empty() || online.contains(p))
            .collect();
        if pus.is_empty() {
            return None;
        }
        Some((pus, format!("hwloc CPU kind {}", describe(kind))))
    }
}

/// Loads hwloc's view of the live machine (`xml` None) or of an XML file.
pub(crate) fn load(xml: Option<&Path>) -> Result<HwTopology, String> {
    let _ = xml;
    Err("hwloc I/O discovery is not built yet".into())
}

/// `getrlimit(RLIMIT_MEMLOCK)`: (soft, hard) in bytes, `u64::MAX` for
/// unlimited.
pub(crate) fn memlock_limit() -> Result<(u64, u64), String> {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `r` is a valid, writable rlimit for the duration of the call.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut r) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error().to_string());
    }
    // rlim_t is u64 on Linux targets, but not by definition.
    #[allow(clippy::unnecessary_cast)]
    let conv = |v: libc::rlim_t| {
        if v == libc::RLIM_INFINITY {
            u64::MAX
        } else {
            v as u64
        }
    };
    Ok((conv(r.rlim_cur), conv(r.rlim_max)))
}
