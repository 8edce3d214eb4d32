//! RAII wrappers of the verbs objects, and [`Device`], the objects of one
//! device that its lanes share.
//!
//! Each object holds an `Arc` of its parents (PD, CQ → context; MR → PD and
//! the region it registers; a QP, see `qp.rs` → PD and CQ), so children are
//! destroyed before their parents whatever the drop order, and the region
//! stays mapped until it is deregistered. A failed destroy is logged, never
//! a panic: a destructor has no one to report to.

use std::ffi::{c_int, CStr};
use std::ptr::NonNull;
use std::sync::Arc;

use rdma_sys::*;

use super::{errno_text, gid_text, verbs_err};
use crate::error::{Error, Result};
use crate::layout::Region;
use crate::topology::LaneDevice;

/// `impl Drop` for a wrapper whose `raw` handle `$destroy` frees; a failure
/// is logged with `$what` (evaluated with `$this` bound to the wrapper)
/// naming the object.
macro_rules! destroy_on_drop {
    ($ty:ty, $destroy:ident, |$this:ident| $what:expr) => {
        impl Drop for $ty {
            fn drop(&mut self) {
                // SAFETY: `raw` came from the matching create call and is
                // destroyed here only, once. The children of this object hold
                // an `Arc` of it, so none is alive any more; what else must
                // hold is on the type.
                let rc = unsafe { $destroy(self.raw.as_ptr()) };
                if rc != 0 {
                    let $this = &*self;
                    log::warn!(
                        "arx verbs: {}({}) failed: {}",
                        stringify!($destroy),
                        $what,
                        super::errno_text(rc)
                    );
                }
            }
        }
    };
}
pub(super) use destroy_on_drop;

/// The device list, freed on drop (opened contexts stay valid).
pub(super) struct DeviceList {
    raw: NonNull<*mut ibv_device>,
    len: usize,
}

impl DeviceList {
    pub(super) fn get() -> Result<Self> {
        let mut n: c_int = 0;
        // SAFETY: plain call; `n` receives the count.
        let raw = unsafe { ibv_get_device_list(&mut n) };
        let Some(raw) = NonNull::new(raw) else {
            let err = std::io::Error::last_os_error();
            let reason = if err.raw_os_error() == Some(libc::ENOSYS) {
                "this kernel has no RDMA stack (ibv_get_device_list: ENOSYS); load ib_uverbs and the NIC's RDMA driver".to_string()
            } else {
                format!("ibv_get_device_list failed: {err}")
            };
            return Err(Error::Unavailable {
                what: "RDMA (libibverbs)",
                reason,
            });
        };
        let list = DeviceList {
            raw,
            len: n.max(0) as usize,
        };
        if list.len == 0 {
            return Err(Error::Unavailable {
                what: "an RDMA device",
                reason: "libibverbs lists no device (is the NIC's RDMA driver loaded, and /dev/infiniband visible in this container?)".into(),
            });
        }
        Ok(list)
    }

    fn names(&self) -> Vec<String> {
        (0..self.len).map(|i| self.name(i)).collect()
    }

    fn name(&self, i: usize) -> String {
        // SAFETY: i < len entries of a live list; each name is a C string
        // owned by the device.
        unsafe {
            let dev = *self.raw.as_ptr().add(i);
            let p = ibv_get_device_name(dev);
            if p.is_null() {
                String::new()
            } else {
                CStr::from_ptr(p).to_string_lossy().into_owned()
            }
        }
    }

    fn open(&self, name: &str) -> Result<Arc<Context>> {
        let i = (0..self.len)
            .find(|&i| self.name(i) == name)
            .ok_or_else(|| {
                verbs_err(
                    "ibv_get_device_list",
                    name,
                    None,
                    None,
                    format!("no such device (present: {})", self.names().join(", ")),
                )
            })?;
        // SAFETY: a device of the live list.
        let raw = unsafe { ibv_open_device(*self.raw.as_ptr().add(i)) };
        let raw = NonNull::new(raw).ok_or_else(|| {
            verbs_err(
                "ibv_open_device",
                name,
                None,
                None,
                format!(
                    "{} (is /dev/infiniband/uverbs* accessible?)",
                    errno_text(-1)
                ),
            )
        })?;
        Ok(Arc::new(Context {
            raw,
            name: name.to_string(),
        }))
    }
}

impl Drop for DeviceList {
    fn drop(&mut self) {
        // SAFETY: the list came from ibv_get_device_list.
        unsafe { ibv_free_device_list(self.raw.as_ptr()) };
    }
}

/// An open device context; closed on drop, after every child (each holds
/// an `Arc` of it).
pub(super) struct Context {
    raw: NonNull<ibv_context>,
    /// The device's name (`rocep1s0f0`), for errors and logs.
    pub(super) name: String,
}

destroy_on_drop!(Context, ibv_close_device, |c| c.name);

impl Context {
    fn query_port(&self, port: u8) -> Result<ibv_port_attr> {
        // SAFETY: ibv_port_attr is plain old data.
        let mut attr: ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: a live context and an attribute struct of the size
        // rdma-core 44 expects (rdma-sys passes its size).
        let rc = unsafe { ___ibv_query_port(self.raw.as_ptr(), port, &mut attr) };
        if rc != 0 {
            return Err(verbs_err(
                "ibv_query_port",
                &self.name,
                None,
                None,
                format!("port {port}: {}", errno_text(rc)),
            ));
        }
        Ok(attr)
    }

    fn query_gid(&self, port: u8, index: u32) -> Result<[u8; 16]> {
        let mut gid = ibv_gid { raw: [0; 16] };
        // SAFETY: a live context; `gid` is 16 writable bytes.
        let rc = unsafe { ibv_query_gid(self.raw.as_ptr(), port, index as c_int, &mut gid) };
        // SAFETY: every bit pattern is a valid [u8; 16].
        let raw = unsafe { gid.raw };
        if rc != 0 || raw == [0; 16] {
            return Err(verbs_err(
                "ibv_query_gid",
                &self.name,
                None,
                None,
                format!(
                    "port {port} GID index {index} is {}: set ARX_GID_INDEX to the RoCE v2 IPv4 GID (`show_gids`)",
                    if rc != 0 { errno_text(rc) } else { "empty".into() }
                ),
            ));
        }
        Ok(raw)
    }
}

/// A protection domain; deallocated after its QPs and MRs (each holds an
/// `Arc` of it).
pub(super) struct Pd {
    raw: NonNull<ibv_pd>,
    pub(super) ctx: Arc<Context>,
}

destroy_on_drop!(Pd, ibv_dealloc_pd, |p| p.ctx.name);

impl Pd {
    fn new(ctx: &Arc<Context>) -> Result<Arc<Self>> {
        // SAFETY: a live context.
        let raw = unsafe { ibv_alloc_pd(ctx.raw.as_ptr()) };
        let raw = NonNull::new(raw)
            .ok_or_else(|| verbs_err("ibv_alloc_pd", &ctx.name, None, None, errno_text(-1)))?;
        Ok(Arc::new(Pd {
            raw,
            ctx: Arc::clone(ctx),
        }))
    }

    pub(super) fn as_ptr(&self) -> *mut ibv_pd {
        self.raw.as_ptr()
    }
}

/// The region's registration on one device. It holds the region (as an
/// `Arc`), so the memory stays mapped until the MR is deregistered, whoever
/// drops last (a proxy thread left detached included). No QP may still
/// write from it when it is dropped: [`VerbsFabric`](super::VerbsFabric)
/// destroys its QPs first.
pub(super) struct Mr {
    raw: NonNull<ibv_mr>,
    pd: Arc<Pd>,
    region: Arc<Region>,
}

destroy_on_drop!(Mr, ibv_dereg_mr, |m| format!(
    "{}, {} bytes",
    m.pd.ctx.name,
    m.region.len()
));

impl Mr {
    fn register(pd: &Arc<Pd>, region: &Arc<Region>) -> Result<Self> {
        region.check_pages("ibv_reg_mr")?;
        // Relaxed ordering is deliberately absent: it would let the NIC
        // commit the flag's PCIe write before the data's.
        let access = ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0
            | ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0;
        // SAFETY: the region is valid for `len` bytes and stays so while
        // the MR exists: the MR keeps an Arc of it.
        let raw = unsafe {
            ibv_reg_mr(
                pd.raw.as_ptr(),
                region.as_ptr().cast(),
                region.len(),
                access as c_int,
            )
        };
        let raw = NonNull::new(raw).ok_or_else(|| {
            let e = std::io::Error::last_os_error();
            let hint = match e.raw_os_error() {
                Some(libc::ENOMEM) | Some(libc::EPERM) => {
                    " (locked-memory limit? try `ulimit -l unlimited`, docker --ulimit memlock=-1)"
                }
                _ => "",
            };
            verbs_err(
                "ibv_reg_mr",
                &pd.ctx.name,
                None,
                None,
                format!("{} bytes: {e}{hint}", region.len()),
            )
        })?;
        Ok(Mr {
            raw,
            pd: Arc::clone(pd),
            region: Arc::clone(region),
        })
    }

    pub(super) fn lkey(&self) -> u32 {
        // SAFETY: a live MR; lkey is set at registration and never changes.
        unsafe { (*self.raw.as_ptr()).lkey }
    }

    pub(super) fn rkey(&self) -> u32 {
        // SAFETY: as for lkey.
        unsafe { (*self.raw.as_ptr()).rkey }
    }
}

/// A completion queue; destroyed after its QPs (each holds an `Arc` of it).
pub(super) struct Cq {
    raw: NonNull<ibv_cq>,
    ctx: Arc<Context>,
}

destroy_on_drop!(Cq, ibv_destroy_cq, |c| c.ctx.name);

impl Cq {
    fn new(ctx: &Arc<Context>, depth: u32) -> Result<Arc<Self>> {
        // SAFETY: a live context; no channel, no completion vector needed
        // (the proxy polls).
        let raw = unsafe {
            ibv_create_cq(
                ctx.raw.as_ptr(),
                depth as c_int,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
            )
        };
        let raw = NonNull::new(raw).ok_or_else(|| {
            verbs_err(
                "ibv_create_cq",
                &ctx.name,
                None,
                None,
                format!("{depth} entries: {}", errno_text(-1)),
            )
        })?;
        Ok(Arc::new(Cq {
            raw,
            ctx: Arc::clone(ctx),
        }))
    }

    pub(super) fn as_ptr(&self) -> *mut ibv_cq {
        self.raw.as_ptr()
    }

    /// Reaps up to `wcs.len()` completions into `wcs` (`ibv_poll_cq`): how
    /// many, or the error.
    pub(super) fn poll(&self, wcs: &mut [ibv_wc]) -> Result<usize> {
        let room = c_int::try_from(wcs.len()).unwrap_or(c_int::MAX);
        // SAFETY: a live CQ; `wcs` has room for `room` entries.
        let n = unsafe { ibv_poll_cq(self.raw.as_ptr(), room, wcs.as_mut_ptr()) };
        usize::try_from(n)
            .map_err(|_| verbs_err("ibv_poll_cq", &self.ctx.name, None, None, errno_text(-1)))
    }
}

/// One device serving one or two lanes: its context, PD, the region's
/// registration, and the CQ its QPs share.
pub(super) struct Device {
    pub(super) sel: LaneDevice,
    pub(super) active_mtu: ibv_mtu::Type,
    pub(super) gid: [u8; 16],
    // Field order is drop order; the Arcs make it right regardless.
    pub(super) mr: Mr,
    pub(super) cq: Arc<Cq>,
    pub(super) pd: Arc<Pd>,
    pub(super) ctx: Arc<Context>,
}

impl Device {
    /// Opens `sel`'s device, checks that its port is active, and registers
    /// `region` with a CQ of `cq_depth` entries.
    pub(super) fn open(
        list: &DeviceList,
        sel: &LaneDevice,
        region: &Arc<Region>,
        cq_depth: u32,
    ) -> Result<Self> {
        let ctx = list.open(&sel.name)?;
        let port = ctx.query_port(sel.port)?;
        if port.state != ibv_port_state::IBV_PORT_ACTIVE {
            return Err(verbs_err(
                "ibv_query_port",
                &ctx.name,
                None,
                None,
                format!(
                    "port {} is not ACTIVE (state {}): check the cable / link (`ibv_devinfo -d {}`)",
                    sel.port, port.state, ctx.name
                ),
            ));
        }
        let gid = ctx.query_gid(sel.port, sel.gid_index)?;
        if gid != sel.gid && sel.gid != [0; 16] {
            log::warn!(
                "arx verbs: {} GID index {} is {} per ibv_query_gid but {} per sysfs; using the former",
                ctx.name,
                sel.gid_index,
                gid_text(&gid),
                gid_text(&sel.gid)
            );
        }
        let pd = Pd::new(&ctx)?;
        let mr = Mr::register(&pd, region)?;
        let cq = Cq::new(&ctx, cq_depth)?;
        Ok(Device {
            sel: sel.clone(),
            active_mtu: port.active_mtu,
            gid,
            mr,
            cq,
            pd,
            ctx,
        })
    }
}

// Thread safety of the wrappers: libibverbs objects may be used from any
// thread (every verb is thread-safe); the wrappers hold only the handle and
// immutable data, and after `connect` the fabric is used by the proxy
// thread alone.
// SAFETY: as above.
unsafe impl Send for Context {}
// SAFETY: as above.
unsafe impl Sync for Context {}
// SAFETY: as above.
unsafe impl Send for Pd {}
// SAFETY: as above.
unsafe impl Sync for Pd {}
// SAFETY: as above.
unsafe impl Send for Cq {}
// SAFETY: as above.
unsafe impl Sync for Cq {}
// SAFETY: as above.
unsafe impl Send for Mr {}
