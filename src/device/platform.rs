//! What the GPU side does differently on an integrated GPU (GB10, the DGX
//! Spark's), decided from the device's attributes, never from its name or
//! architecture: read once when the GPU side starts, logged, and shown by
//! `examples/doctor`.
//!
//! On an integrated GPU there is one memory: "pinned host memory" is the
//! GPU's own, and a coherent one (GB10: NVLink-C2C, the GPU walks the CPU's
//! page tables) reaches any memory the CPU maps. What that changes, and what
//! it does not (docs/GPU.md, "Integrated GPUs", says the same for users):
//!
//! * **The mapped region** (Verbs fabric; the Shm fabric's segment is always
//!   registered): a discrete GPU gets it from `cuMemHostAlloc(DEVICEMAP |
//!   PORTABLE)`, pinned system memory it reaches over PCIe. An integrated GPU
//!   that reaches pageable memory through the host's page tables gets the
//!   same anonymous `mmap` the host device side uses, registered with
//!   `cuMemHostRegister(DEVICEMAP | PORTABLE)`: the CPU (the proxy polls it,
//!   the NIC writes it) keeps ordinary cached memory, which the GPU sees
//!   coherently. An integrated GPU without that coherence (older Jetson
//!   parts) keeps `cuMemHostAlloc`, whose memory the driver maps so that both
//!   sides agree.
//! * **Staging default: SM on both.** On a discrete GPU SM stores into the
//!   region are posted PCIe writes and were measured faster than a
//!   copy-engine copy plus the `ctrl.sent` handoff (docs/GPU.md); on an
//!   integrated GPU they are stores to its own memory, and a copy engine
//!   would add a launch and the handoff for nothing. `ARX_STAGING` still
//!   overrides.
//! * **Cache operators: the same on both.** Flags are polled with
//!   `ld.acquire.sys`, which is what a coherent GPU needs too; peers'
//!   partials are read with `ld.global.cv` (fetched again, never a stale
//!   cached line). On a coherent integrated GPU a cached load after the
//!   acquire would also be correct and might hit in L2, but that is a speed
//!   question nobody has measured on a GB10: the kernel keeps `.cv`.
//! * **Device-memory staging buffers: none on both.** The kernel stages into
//!   the mapped region directly; on an integrated GPU there is no other
//!   memory to stage through.
//! * **Device address of the region**: `cuMemHostGetDevicePointer` on both;
//!   with `CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM` it is the host address,
//!   which is reported.
//!
//! Nothing here has run on a GB10 (or any integrated GPU): the attribute
//! values below for GB10 are what its documentation implies, not read.

use std::fmt;

use cudarc::driver::{result, sys};

use crate::config::Staging;
use crate::error::{Error, Result};

/// The device attributes arx decides from (`CU_DEVICE_ATTRIBUTE_*`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuAttrs {
    /// `cuDeviceGetName`.
    pub name: String,
    /// `INTEGRATED`: the GPU shares the host's memory.
    pub integrated: bool,
    /// `CAN_MAP_HOST_MEMORY`: host memory can be mapped into the GPU (arx
    /// needs it).
    pub can_map_host_memory: bool,
    /// `PAGEABLE_MEMORY_ACCESS`: the GPU can access pageable host memory
    /// coherently.
    pub pageable_memory_access: bool,
    /// `PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES`: through the host's
    /// page tables (hardware coherence: ATS, NVLink-C2C).
    pub pageable_uses_host_page_tables: bool,
    /// `HOST_NATIVE_ATOMIC_SUPPORTED`: atomics between GPU and CPU are
    /// native (a coherent link).
    pub host_native_atomics: bool,
    /// `CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM`: registered host memory has
    /// the same address on the GPU.
    pub host_pointer_for_registered_mem: bool,
}

/// How the GPU side gets its mapped region on the Verbs fabric.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RegionAlloc {
    /// `cuMemHostAlloc(DEVICEMAP | PORTABLE)`: pinned memory from the
    /// driver (discrete GPUs; integrated ones without hardware coherence).
    HostAlloc,
    /// Anonymous `mmap` registered with `cuMemHostRegister(DEVICEMAP |
    /// PORTABLE)` (integrated GPUs that use the host's page tables).
    MmapRegister,
}

/// What arx found on a GPU and chose for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuPlatform {
    /// What the device reported.
    pub attrs: GpuAttrs,
    /// The region's allocation on the Verbs fabric (the Shm fabric's
    /// segment is registered whatever this says).
    pub region: RegionAlloc,
    /// The staging used when `ARX_STAGING` is not set.
    pub staging_default: Staging,
    /// How the kernel reads peers' partials (a PTX load).
    pub payload_loads: &'static str,
    /// How it polls peers' flags.
    pub flag_polls: &'static str,
    /// Whether device-memory staging buffers are used.
    pub device_staging_buffers: bool,
}

impl GpuPlatform {
    /// The choices for a device with attributes `attrs`; fails when the
    /// device cannot map host memory at all.
    pub fn decide(attrs: GpuAttrs) -> Result<Self> {
        if !attrs.can_map_host_memory {
            return Err(Error::Unavailable {
                what: "the GPU device side",
                reason: format!("{} cannot map host memory", attrs.name),
            });
        }
        let coherent = attrs.integrated && attrs.pageable_uses_host_page_tables;
        Ok(GpuPlatform {
            region: if coherent {
                RegionAlloc::MmapRegister
            } else {
                RegionAlloc::HostAlloc
            },
            staging_default: Staging::Sm,
            payload_loads: "ld.global.cv",
            flag_polls: "ld.acquire.sys",
            device_staging_buffers: false,
            attrs,
        })
    }

    /// Reads CUDA device `ordinal`'s attributes and decides (the driver is
    /// initialised: `device::gpu::device_count` succeeded).
    pub(crate) fn read(ordinal: usize) -> Result<Self> {
        let err = |call: &'static str| {
            move |e: result::DriverError| Error::Cuda {
                call,
                detail: format!("device {ordinal}: {e}"),
            }
        };
        let d = result::device::get(ordinal as i32).map_err(err("cuDeviceGet"))?;
        let attr = |a: sys::CUdevice_attribute| -> Result<bool> {
            // SAFETY: `d` is a valid device of an initialised driver.
            let v = unsafe { result::device::get_attribute(d, a) }
                .map_err(err("cuDeviceGetAttribute"))?;
            Ok(v != 0)
        };
        use sys::CUdevice_attribute::*;
        let attrs = GpuAttrs {
            name: result::device::get_name(d).map_err(err("cuDeviceGetName"))?,
            integrated: attr(CU_DEVICE_ATTRIBUTE_INTEGRATED)?,
            can_map_host_memory: attr(CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY)?,
            pageable_memory_access: attr(CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS)?,
            pageable_uses_host_page_tables: attr(
                CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES,
            )?,
            host_native_atomics: attr(CU_DEVICE_ATTRIBUTE_HOST_NATIVE_ATOMIC_SUPPORTED)?,
            host_pointer_for_registered_mem: attr(
                CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM,
            )?,
        };
        Self::decide(attrs)
    }
}

fn yes(b: bool) -> &'static str {
    if b {
        "yes"
    } else {
        "no"
    }
}

/// `GPU: <name>, integrated: yes/no (attributes), chose: ...`.
impl fmt::Display for GpuPlatform {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let a = &self.attrs;
        let region = match self.region {
            RegionAlloc::HostAlloc => "cuMemHostAlloc",
            RegionAlloc::MmapRegister => "mmap + cuMemHostRegister",
        };
        let staging = match self.staging_default {
            Staging::Sm => "sm",
            Staging::CopyEngine => "copy",
        };
        write!(
            f,
            "GPU: {}, integrated: {} (pageable memory access: {}, via host page tables: {}, \
             host-native atomics: {}, host pointer usable on the GPU: {}), chose: region {region} \
             (verbs fabric; shm segment registered), staging default {staging}, flags polled \
             with {}, partials read with {}, device staging buffers: {}",
            a.name,
            yes(a.integrated),
            yes(a.pageable_memory_access),
            yes(a.pageable_uses_host_page_tables),
            yes(a.host_native_atomics),
            yes(a.host_pointer_for_registered_mem),
            self.flag_polls,
            self.payload_loads,
            if self.device_staging_buffers {
                "yes"
            } else {
                "none"
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An H200 (PCIe): discrete, no access to pageable memory.
    fn h200() -> GpuAttrs {
        GpuAttrs {
            name: "NVIDIA H200 NVL".into(),
            integrated: false,
            can_map_host_memory: true,
            pageable_memory_access: false,
            pageable_uses_host_page_tables: false,
            host_native_atomics: false,
            host_pointer_for_registered_mem: true,
        }
    }

    /// A GB10 as its documentation describes it (not read from one):
    /// integrated, coherent over NVLink-C2C through the host's page tables.
    fn gb10() -> GpuAttrs {
        GpuAttrs {
            name: "NVIDIA GB10".into(),
            integrated: true,
            can_map_host_memory: true,
            pageable_memory_access: true,
            pageable_uses_host_page_tables: true,
            host_native_atomics: true,
            host_pointer_for_registered_mem: true,
        }
    }

    #[test]
    fn a_discrete_gpu_gets_pinned_host_memory() {
        let p = GpuPlatform::decide(h200()).unwrap();
        assert_eq!(p.region, RegionAlloc::HostAlloc);
        assert_eq!(p.staging_default, Staging::Sm);
        assert!(!p.device_staging_buffers);
        let line = p.to_string();
        assert!(
            line.starts_with("GPU: NVIDIA H200 NVL, integrated: no")
                && line.contains("chose: region cuMemHostAlloc"),
            "{line}"
        );
    }

    #[test]
    fn a_coherent_integrated_gpu_registers_ordinary_memory() {
        let p = GpuPlatform::decide(gb10()).unwrap();
        assert_eq!(p.region, RegionAlloc::MmapRegister);
        assert_eq!(p.staging_default, Staging::Sm);
        assert_eq!(p.payload_loads, "ld.global.cv");
        assert_eq!(p.flag_polls, "ld.acquire.sys");
        assert!(!p.device_staging_buffers);
        let line = p.to_string();
        assert!(
            line.starts_with("GPU: NVIDIA GB10, integrated: yes")
                && line.contains("region mmap + cuMemHostRegister"),
            "{line}"
        );
    }

    #[test]
    fn the_decision_follows_attributes_not_names() {
        // Named like a GB10 but reporting a discrete GPU's attributes.
        let p = GpuPlatform::decide(GpuAttrs {
            name: "NVIDIA GB10".into(),
            ..h200()
        })
        .unwrap();
        assert_eq!(p.region, RegionAlloc::HostAlloc);
        // Integrated without coherence through the host's page tables (an
        // older Jetson): the driver's pinned memory.
        let p = GpuPlatform::decide(GpuAttrs {
            pageable_memory_access: false,
            pageable_uses_host_page_tables: false,
            host_native_atomics: false,
            ..gb10()
        })
        .unwrap();
        assert_eq!(p.region, RegionAlloc::HostAlloc);
        // A discrete GPU with ATS (a GH200): coherent, but its own memory
        // is not the host's; pinned host memory as on any discrete GPU.
        let p = GpuPlatform::decide(GpuAttrs {
            pageable_memory_access: true,
            pageable_uses_host_page_tables: true,
            host_native_atomics: true,
            ..h200()
        })
        .unwrap();
        assert_eq!(p.region, RegionAlloc::HostAlloc);
    }

    #[test]
    fn a_gpu_that_cannot_map_host_memory_is_refused() {
        let e = GpuPlatform::decide(GpuAttrs {
            can_map_host_memory: false,
            ..gb10()
        })
        .unwrap_err()
        .to_string();
        assert!(e.contains("NVIDIA GB10 cannot map host memory"), "{e}");
    }
}
