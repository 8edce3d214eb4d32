//! The Verbs fabric: RDMA writes over RC queue pairs, one device per lane.
//!
//! Per device (a lane's device from [`topology::select`]; two lanes may share
//! one): a context, a protection domain, the region registered once
//! (`LOCAL_WRITE | REMOTE_WRITE`, never relaxed ordering: the flag must not
//! overtake its data on PCIe), and one completion queue. Per (peer, lane): an
//! RC queue pair. Every rank all-gathers its endpoints (GID, MTU, rkey, QPNs
//! and PSNs) over MPI in a small versioned record, then moves its QPs
//! INIT → RTR → RTS; the closing [`Bootstrap::agree`] is also the barrier that
//! guarantees every peer's QPs are ready to receive before anyone writes.
//!
//! Per call, for every peer `r+1, r+2, …` and each lane, one `ibv_post_send`
//! carries two chained WRs on that lane's QP: the lane's part of `send[p]`
//! into the peer's `recv[p][r]` (omitted when the part is empty), then the
//! 8-byte flag word, INLINE (copied at post time; it is a value on our
//! stack), into the peer's `flags[p][r][lane]`. RC delivers the writes of one
//! QP in order, so the flag never lands before its data.
//!
//! Selective signalling, counted per QP ([`Ledger`]): a WR is signalled
//! every [`SIGNAL_EVERY`] WRs and when it makes the send queue full; a
//! signalled completion retires every earlier WR of its QP. A post that
//! would overfill the queue polls until there is room, bounded by the
//! timeout. Each QP's ledger records which call every outstanding WR
//! completes, and [`Fabric::completed_through`] is the last call every QP
//! has completed: the proxy publishes it as `ctrl.sent` (the send slot of
//! that call may be overwritten). Copy-engine staging waits for `sent` on
//! every call, so with `ARX_STAGING=copy` the last WR of every call is
//! signalled on every QP, and `sent` follows each call within an
//! acknowledgement's time. Otherwise an unsignalled tail left by an idle
//! proxy is flushed after [`FLUSH_AFTER`] by re-writing the last flag word
//! signalled (idempotent), so that [`Fabric::quiescent`] becomes true and
//! shutdown can drain.
//!
//! Every completion queue holds a completion for every WR that can be
//! outstanding on the QPs that share it ([`cq_depth`]): a QP in error
//! flushes each of its WRs with a completion, signalled or not, and an
//! overflowing CQ would lose them. Flushed WRs count as completed, so after
//! a failure the fabric becomes quiescent once the broken QPs are flushed
//! and the healthy ones have delivered (the proxy then releases `sent`).
//!
//! On a failed post or completion this rank records the error (the proxy
//! raises the abort word) and, to spare its peers the full timeout, writes
//! "poisoned" flag words (dtype INVALID, [`POISON_COUNT`]) for its last call
//! and the next into every peer it can still reach through a healthy QP: a
//! peer waiting on this rank then fails at once with [`Error::CallMismatch`]
//! naming this rank. A rank whose inputs for the call had all arrived before
//! the failure was known keeps its (correct) result and fails on its next
//! call instead: this rank when every peer's partial came before its failed
//! send completed, a peer when this rank's sends to it went out before the
//! broken one. No rank ever returns a wrong sum.
//!
//! A rank closes its QPs only after a bounded barrier (see `Arx`'s drop):
//! a completion means the peer acknowledged, so once every rank has drained
//! its own sends nobody still waits for an acknowledgement.
//!
//! Resource lifetime is right by construction: each verbs object holds an
//! `Arc` of its parents (QP → PD, CQ; MR → PD and the region it registers;
//! PD, CQ → context), so children are destroyed before their parents
//! whatever the drop order, and the region stays mapped until it is
//! deregistered.
//! All `unsafe` of the fabric lives in this file.

use std::ffi::{c_int, CStr};
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdma_sys::*;

use crate::bootstrap::Bootstrap;
use crate::config::{Config, Staging};
use crate::dtype::POISON_COUNT;
use crate::error::{Error, Result};
use crate::fabric::Fabric;
use crate::layout::{flag_word, Layout, Region};
use crate::spin::Backoff;
use crate::topology::{self, LaneDevice};

const LANES: usize = crate::abi::ARX_LANES as usize;
/// Send-queue depth per QP (WRs). Each call uses at most 2 per QP.
const SQ_DEPTH: u32 = 128;
/// Receive-queue depth per QP (RDMA WRITE consumes no receive WR; one
/// keeps every provider happy).
const RQ_DEPTH: u32 = 1;
/// Signal one WR in this many per QP (and, with per-call completion, the
/// last WR of every call).
const SIGNAL_EVERY: u64 = 16;
/// Bytes of inline data requested per WR (the flag needs 8).
const INLINE_BYTES: u32 = 64;
/// Completions reaped per `ibv_poll_cq`.
const POLL_BATCH: usize = 32;
/// After this long without a post, an unsignalled tail is flushed.
const FLUSH_AFTER: Duration = Duration::from_millis(2);
/// A QP with WRs outstanding and no completion for this long gets one more
/// (signalled, idempotent) flag write. Never needed on a healthy NIC, where
/// completions come within microseconds; soft-RoCE in Linux 6.1 was seen to
/// leave posted WRs unprocessed until the next post rang the doorbell again.
const KICK_AFTER: Duration = Duration::from_millis(200);
/// `progress` calls between two checks for stalled QPs.
const KICK_CHECK_EVERY: u32 = 256;
/// Local ACK timeout exponent: 4.096 µs × 2^14 ≈ 67 ms (perftest's default).
const ACK_TIMEOUT: u8 = 14;
/// Retransmissions before a WR fails with RETRY_EXC_ERR. Not 7: soft-RoCE
/// (rxe) treats retry_cnt 7 like rnr_retry 7, as "retry forever", so a dead
/// peer would never produce a completion error there.
const RETRY_CNT: u8 = 6;
/// RNR retries (7 = infinite; unused: RDMA WRITE consumes no receive WR).
const RNR_RETRY: u8 = 7;
/// Hop limit of the GRH (RoCE v2 is routable; 1 would stop at a router).
const HOP_LIMIT: u8 = 64;
/// Bits of a WR id that hold the QP's WR count; the QP index sits above.
const WR_COUNT_BITS: u32 = 48;
const WR_COUNT_MASK: u64 = (1 << WR_COUNT_BITS) - 1;

/// `errno` as text.
fn errno_text(rc: c_int) -> String {
    // Verbs return either -1 with errno set, or a positive errno.
    let code = if rc > 0 {
        rc
    } else {
        std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
    };
    std::io::Error::from_raw_os_error(code).to_string()
}

fn verbs_err(
    call: &'static str,
    device: &str,
    peer: Option<usize>,
    lane: Option<usize>,
    detail: impl Into<String>,
) -> Error {
    Error::Verbs {
        call,
        device: device.to_string(),
        peer,
        lane,
        detail: detail.into(),
    }
}

fn mtu_bytes(m: ibv_mtu::Type) -> u32 {
    match m {
        ibv_mtu::IBV_MTU_256 => 256,
        ibv_mtu::IBV_MTU_512 => 512,
        ibv_mtu::IBV_MTU_1024 => 1024,
        ibv_mtu::IBV_MTU_2048 => 2048,
        ibv_mtu::IBV_MTU_4096 => 4096,
        _ => 0,
    }
}

fn gid_text(g: &[u8; 16]) -> String {
    std::net::Ipv6Addr::from(*g).to_string()
}

// ------------------------------------------------------------ verbs objects

/// An open device context; closed on drop (after every child, which holds
/// an `Arc` of it).
struct Context {
    raw: NonNull<ibv_context>,
    name: String,
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: opened by ibv_open_device; every child holds an Arc of us,
        // so none is alive any more.
        let rc = unsafe { ibv_close_device(self.raw.as_ptr()) };
        if rc != 0 {
            log::warn!(
                "arx verbs: ibv_close_device({}) failed: {}",
                self.name,
                errno_text(rc)
            );
        }
    }
}

/// The device list, freed on drop (opened contexts stay valid).
struct DeviceList {
    raw: NonNull<*mut ibv_device>,
    len: usize,
}

impl DeviceList {
    fn get() -> Result<Self> {
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

/// A protection domain.
struct Pd {
    raw: NonNull<ibv_pd>,
    ctx: Arc<Context>,
}

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
}

impl Drop for Pd {
    fn drop(&mut self) {
        // SAFETY: allocated by ibv_alloc_pd; QPs and MRs hold an Arc of us,
        // so none is alive any more.
        let rc = unsafe { ibv_dealloc_pd(self.raw.as_ptr()) };
        if rc != 0 {
            log::warn!(
                "arx verbs: ibv_dealloc_pd({}) failed: {}",
                self.ctx.name,
                errno_text(rc)
            );
        }
    }
}

/// The region's registration on one device. It holds the region (as an
/// `Arc`), so the memory stays mapped until the MR is deregistered, whoever
/// drops last (a proxy thread left detached included).
struct Mr {
    raw: NonNull<ibv_mr>,
    pd: Arc<Pd>,
    region: Arc<Region>,
}

impl Mr {
    fn register(pd: &Arc<Pd>, region: &Arc<Region>) -> Result<Self> {
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

    fn lkey(&self) -> u32 {
        // SAFETY: a live MR; lkey is set at registration and never changes.
        unsafe { (*self.raw.as_ptr()).lkey }
    }

    fn rkey(&self) -> u32 {
        // SAFETY: as for lkey.
        unsafe { (*self.raw.as_ptr()).rkey }
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: registered by ibv_reg_mr; no QP uses it once the fabric is
        // being dropped. The region (our Arc) is released only after this.
        let rc = unsafe { ibv_dereg_mr(self.raw.as_ptr()) };
        if rc != 0 {
            log::warn!(
                "arx verbs: ibv_dereg_mr({}, {} bytes) failed: {}",
                self.pd.ctx.name,
                self.region.len(),
                errno_text(rc)
            );
        }
    }
}

/// A completion queue.
struct Cq {
    raw: NonNull<ibv_cq>,
    ctx: Arc<Context>,
}

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
}

impl Drop for Cq {
    fn drop(&mut self) {
        // SAFETY: created by ibv_create_cq; QPs hold an Arc of us.
        let rc = unsafe { ibv_destroy_cq(self.raw.as_ptr()) };
        if rc != 0 {
            log::warn!(
                "arx verbs: ibv_destroy_cq({}) failed: {}",
                self.ctx.name,
                errno_text(rc)
            );
        }
    }
}

// ------------------------------------------------------------ send accounting

/// Most WRs in one chain (a call's data and flag; poisoned flags: 2 calls × 2
/// lanes).
const MAX_CHAIN: usize = 4;

/// Entries a completion queue shared by `qps` QPs needs. A QP in error
/// completes every WR it has outstanding (a flush), signalled or not, so the
/// queue must hold every WR that can be outstanding on all of them: the send
/// queue as [`Ledger::has_room`] bounds it, and the receive queue (no receive
/// is ever posted; counted all the same). A full CQ drops completions — the
/// poisoned flags' that tell peers about a failure among them.
fn cq_depth(qps: usize) -> usize {
    (qps * (SQ_DEPTH + RQ_DEPTH) as usize).max(16)
}

/// The send accounting of one QP, kept apart from the verbs calls so that
/// it can be tested without a device: WR counts, which WRs to signal, and
/// which call each outstanding WR completes.
///
/// WRs are counted from 1 per QP. The completion of WR `c` (signalled, or
/// flushed by a QP in error) retires every WR up to `c`: RC completes one
/// QP's WRs in order.
#[derive(Debug)]
struct Ledger {
    /// WRs ever posted; WRs known complete; count at the last signalled WR.
    posted: u64,
    completed: u64,
    signaled: u64,
    /// Most WRs outstanding (the send queue depth granted, at most
    /// [`SQ_DEPTH`]).
    depth: u64,
    /// The last call with a WR on this QP.
    last_seq: u64,
    /// Every WR of this call and of the calls before it has completed.
    done_seq: u64,
    /// `seq_at[c % depth]`: the call complete on this QP once WR `c`
    /// completes. Unique among outstanding WRs: at most `depth` are.
    seq_at: Box<[u64]>,
}

impl Ledger {
    fn new(depth: u64) -> Self {
        let depth = depth.max(1);
        Ledger {
            posted: 0,
            completed: 0,
            signaled: 0,
            depth,
            last_seq: 0,
            done_seq: 0,
            seq_at: vec![0; depth as usize].into_boxed_slice(),
        }
    }

    fn outstanding(&self) -> u64 {
        self.posted - self.completed
    }

    /// True if `n` more WRs fit without overfilling the send queue.
    fn has_room(&self, n: u64) -> bool {
        self.outstanding() + n <= self.depth
    }

    /// Which WRs of a chain of `len` to signal (bit k: WR k): one every
    /// [`SIGNAL_EVERY`], the one that fills the queue (a full queue must be
    /// able to drain), and the last when `signal_last` (per-call completion,
    /// or a tail that must complete observably).
    fn plan(&self, len: usize, signal_last: bool) -> u32 {
        let mut signaled = self.signaled;
        let mut bits = 0;
        for k in 0..len {
            let count = self.posted + k as u64 + 1;
            if count - signaled >= SIGNAL_EVERY
                || count - self.completed >= self.depth
                || (signal_last && k + 1 == len)
            {
                bits |= 1 << k;
                signaled = count;
            }
        }
        bits
    }

    /// Records that the first `n` WRs of a chain of `len` planned as `plan`
    /// were posted. The chain's last WR completes call `seq`; its other WRs
    /// (and every WR of a chain with `seq` None: a re-written flag, poisoned
    /// flags) complete only what this QP had before.
    fn commit(&mut self, n: usize, len: usize, plan: u32, seq: Option<u64>) {
        let before = self.last_seq;
        for k in 0..n {
            let count = self.posted + 1;
            let upto = match seq {
                Some(s) if k + 1 == len => s,
                _ => before,
            };
            self.seq_at[(count % self.depth) as usize] = upto;
            if plan & (1 << k) != 0 {
                self.signaled = count;
            }
            self.posted = count;
        }
        if n == len {
            if let Some(s) = seq {
                self.last_seq = s;
            }
        }
    }

    /// WR `count` completed (successfully or flushed): every WR up to it is
    /// retired. Counts not outstanding (stale or foreign) change nothing.
    fn complete(&mut self, count: u64) {
        if count > self.completed && count <= self.posted {
            self.completed = count;
            self.done_seq = self.seq_at[(count % self.depth) as usize];
        }
    }
}

/// An RC queue pair to one peer on one lane, with its send accounting.
struct Qp {
    raw: NonNull<ibv_qp>,
    peer: usize,
    lane: usize,
    /// Index of the lane's device in `VerbsFabric::devices`.
    dev: usize,
    /// Our initial send PSN (the peer's receive PSN).
    psn: u32,
    ledger: Ledger,
    /// The last flag written (remote address, word), for a tail flush.
    last_flag: Option<(u64, u64)>,
    /// A completion on this QP failed: it is in the error state.
    broken: bool,
    /// Last time a completion (or a kick) was seen for this QP.
    last_progress: Instant,
    _pd: Arc<Pd>,
    _cq: Arc<Cq>,
}

impl Drop for Qp {
    fn drop(&mut self) {
        // SAFETY: created by ibv_create_qp; nothing posts on it any more.
        let rc = unsafe { ibv_destroy_qp(self.raw.as_ptr()) };
        if rc != 0 {
            log::warn!(
                "arx verbs: ibv_destroy_qp(peer {}, lane {}) failed: {}",
                self.peer,
                self.lane,
                errno_text(rc)
            );
        }
    }
}

/// One device serving one or two lanes.
struct Device {
    sel: LaneDevice,
    active_mtu: ibv_mtu::Type,
    gid: [u8; 16],
    // Field order is drop order; the Arcs make it right regardless.
    mr: Mr,
    cq: Arc<Cq>,
    pd: Arc<Pd>,
    ctx: Arc<Context>,
}

impl Device {
    fn open(
        list: &DeviceList,
        sel: &LaneDevice,
        region: &Arc<Region>,
        cq_depth: u32,
    ) -> Result<Self> {
        let ctx = list.open(&sel.name)?;
        let port = query_port(&ctx, sel.port)?;
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
        let gid = query_gid(&ctx, sel.port, sel.gid_index)?;
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

fn query_port(ctx: &Context, port: u8) -> Result<ibv_port_attr> {
    // SAFETY: ibv_port_attr is plain old data.
    let mut attr: ibv_port_attr = unsafe { std::mem::zeroed() };
    // SAFETY: a live context and an attribute struct of the size rdma-core
    // 44 expects (rdma-sys passes its size).
    let rc = unsafe { ___ibv_query_port(ctx.raw.as_ptr(), port, &mut attr) };
    if rc != 0 {
        return Err(verbs_err(
            "ibv_query_port",
            &ctx.name,
            None,
            None,
            format!("port {port}: {}", errno_text(rc)),
        ));
    }
    Ok(attr)
}

fn query_gid(ctx: &Context, port: u8, index: u32) -> Result<[u8; 16]> {
    let mut gid = ibv_gid { raw: [0; 16] };
    // SAFETY: a live context; `gid` is 16 writable bytes.
    let rc = unsafe { ibv_query_gid(ctx.raw.as_ptr(), port, index as c_int, &mut gid) };
    // SAFETY: every bit pattern is a valid [u8; 16].
    let raw = unsafe { gid.raw };
    if rc != 0 || raw == [0; 16] {
        return Err(verbs_err(
            "ibv_query_gid",
            &ctx.name,
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

// Thread safety of the wrappers below: libibverbs objects may be used from
// any thread (every verb is thread-safe); the wrappers hold only the handle
// and immutable data, and after `connect` the fabric is used by the proxy
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
// SAFETY: as above.
unsafe impl Send for Qp {}

// ------------------------------------------------------------ QP states

fn create_qp(dev: &Device, peer: usize, lane: usize, dev_index: usize) -> Result<Qp> {
    // SAFETY: ibv_qp_init_attr is plain old data.
    let mut init: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
    init.send_cq = dev.cq.raw.as_ptr();
    init.recv_cq = dev.cq.raw.as_ptr();
    init.qp_type = ibv_qp_type::IBV_QPT_RC;
    init.sq_sig_all = 0;
    init.cap = ibv_qp_cap {
        max_send_wr: SQ_DEPTH,
        max_recv_wr: RQ_DEPTH,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: INLINE_BYTES,
    };
    // SAFETY: a live PD and CQ; `init` is filled in above.
    let raw = unsafe { ibv_create_qp(dev.pd.raw.as_ptr(), &mut init) };
    let raw = NonNull::new(raw).ok_or_else(|| {
        verbs_err(
            "ibv_create_qp",
            &dev.ctx.name,
            Some(peer),
            Some(lane),
            format!(
                "RC, {SQ_DEPTH} send WRs, {INLINE_BYTES} inline bytes: {}",
                errno_text(-1)
            ),
        )
    })?;
    let qp = Qp {
        raw,
        peer,
        lane,
        dev: dev_index,
        psn: rand::random::<u32>() & 0x00ff_ffff,
        ledger: Ledger::new(u64::from(init.cap.max_send_wr.min(SQ_DEPTH))),
        last_flag: None,
        broken: false,
        last_progress: Instant::now(),
        _pd: Arc::clone(&dev.pd),
        _cq: Arc::clone(&dev.cq),
    };
    if init.cap.max_inline_data < 8 {
        return Err(verbs_err(
            "ibv_create_qp",
            &dev.ctx.name,
            Some(peer),
            Some(lane),
            format!(
                "the device grants {} inline bytes; the flag word needs 8",
                init.cap.max_inline_data
            ),
        ));
    }
    Ok(qp)
}

fn modify(
    qp: &Qp,
    dev: &Device,
    call: &'static str,
    attr: &mut ibv_qp_attr,
    mask: ibv_qp_attr_mask,
    what: impl FnOnce() -> String,
) -> Result<()> {
    // SAFETY: a live QP; `attr` holds every field `mask` names.
    let rc = unsafe { ibv_modify_qp(qp.raw.as_ptr(), attr, mask.0 as c_int) };
    if rc != 0 {
        return Err(verbs_err(
            call,
            &dev.ctx.name,
            Some(qp.peer),
            Some(qp.lane),
            format!("{} ({})", errno_text(rc), what()),
        ));
    }
    Ok(())
}

fn zeroed_attr() -> ibv_qp_attr {
    // SAFETY: ibv_qp_attr is plain old data (integers and unions of them).
    unsafe { std::mem::zeroed() }
}

/// RESET → INIT: the port, and remote peers may write into our MR.
fn to_init(qp: &Qp, dev: &Device) -> Result<()> {
    let mut a = zeroed_attr();
    a.qp_state = ibv_qp_state::IBV_QPS_INIT;
    a.pkey_index = 0;
    a.port_num = dev.sel.port;
    a.qp_access_flags = ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0;
    let mask = ibv_qp_attr_mask::IBV_QP_STATE
        | ibv_qp_attr_mask::IBV_QP_PKEY_INDEX
        | ibv_qp_attr_mask::IBV_QP_PORT
        | ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS;
    modify(qp, dev, "ibv_modify_qp(INIT)", &mut a, mask, || {
        format!("port {}", dev.sel.port)
    })
}

/// INIT → RTR: the remote QP, its GID (RoCE v2 needs a GRH) and the path MTU.
fn to_rtr(qp: &Qp, dev: &Device, remote: &RemoteQp, mtu: ibv_mtu::Type) -> Result<()> {
    let mut a = zeroed_attr();
    a.qp_state = ibv_qp_state::IBV_QPS_RTR;
    a.path_mtu = mtu;
    a.dest_qp_num = remote.qpn;
    a.rq_psn = remote.psn;
    a.max_dest_rd_atomic = 1;
    a.min_rnr_timer = 12;
    a.ah_attr.is_global = 1;
    a.ah_attr.grh.dgid = ibv_gid { raw: remote.gid };
    a.ah_attr.grh.sgid_index = dev.sel.gid_index as u8;
    a.ah_attr.grh.hop_limit = HOP_LIMIT;
    a.ah_attr.grh.traffic_class = 0;
    a.ah_attr.grh.flow_label = 0;
    a.ah_attr.dlid = 0;
    a.ah_attr.sl = 0;
    a.ah_attr.src_path_bits = 0;
    a.ah_attr.port_num = dev.sel.port;
    let mask = ibv_qp_attr_mask::IBV_QP_STATE
        | ibv_qp_attr_mask::IBV_QP_AV
        | ibv_qp_attr_mask::IBV_QP_PATH_MTU
        | ibv_qp_attr_mask::IBV_QP_DEST_QPN
        | ibv_qp_attr_mask::IBV_QP_RQ_PSN
        | ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC
        | ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER;
    modify(qp, dev, "ibv_modify_qp(RTR)", &mut a, mask, || {
        format!(
            "remote GID {} QPN {:#x}, local GID index {}, MTU {}",
            gid_text(&remote.gid),
            remote.qpn,
            dev.sel.gid_index,
            mtu_bytes(mtu)
        )
    })
}

/// RTR → RTS: our send PSN, the ACK timeout and the retry counts.
/// Any state → ERR: used only to inject a fault in tests ([`Fabric::inject_fault`]).
fn to_err(qp: &Qp, dev: &Device) -> Result<()> {
    let mut a = zeroed_attr();
    a.qp_state = ibv_qp_state::IBV_QPS_ERR;
    modify(
        qp,
        dev,
        "ibv_modify_qp(ERR)",
        &mut a,
        ibv_qp_attr_mask::IBV_QP_STATE,
        || "fault injection".into(),
    )
}

fn to_rts(qp: &Qp, dev: &Device) -> Result<()> {
    let mut a = zeroed_attr();
    a.qp_state = ibv_qp_state::IBV_QPS_RTS;
    a.sq_psn = qp.psn;
    a.timeout = ACK_TIMEOUT;
    a.retry_cnt = RETRY_CNT;
    a.rnr_retry = RNR_RETRY;
    a.max_rd_atomic = 1;
    let mask = ibv_qp_attr_mask::IBV_QP_STATE
        | ibv_qp_attr_mask::IBV_QP_SQ_PSN
        | ibv_qp_attr_mask::IBV_QP_TIMEOUT
        | ibv_qp_attr_mask::IBV_QP_RETRY_CNT
        | ibv_qp_attr_mask::IBV_QP_RNR_RETRY
        | ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC;
    modify(qp, dev, "ibv_modify_qp(RTS)", &mut a, mask, || {
        format!("sq_psn {:#x}", qp.psn)
    })
}

// ------------------------------------------------------------ endpoint record

/// "ARXV" as a little-endian u32: the endpoint record's magic.
const ENDPOINT_MAGIC: u32 = 0x5658_5241;
/// Bump on any change to the endpoint record.
const ENDPOINT_VERSION: u16 = 1;
const HEADER_BYTES: usize = 4 + 2 + 2 + 4 + 4 + 8 + 8;
const LANE_FIXED_BYTES: usize = 16 + 4 + 4 + 4 + 4;

/// One QP's far end as a peer announced it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct RemoteQp {
    gid: [u8; 16],
    qpn: u32,
    psn: u32,
}

/// One lane of a rank's endpoint record.
#[derive(Debug, Clone, PartialEq, Eq)]
struct LaneRecord {
    gid: [u8; 16],
    gid_index: u32,
    rkey: u32,
    /// `ibv_mtu` code of the port's active MTU.
    mtu: u32,
    /// (QPN, PSN) of the QP facing each rank (0, 0 for itself).
    qps: Vec<(u32, u32)>,
}

/// What a rank tells every other rank to connect to it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Endpoint {
    world: u32,
    rank: u32,
    addr: u64,
    len: u64,
    lanes: Vec<LaneRecord>,
}

impl Endpoint {
    fn encoded_len(world: usize, lanes: usize) -> usize {
        HEADER_BYTES + lanes * (LANE_FIXED_BYTES + world * 8)
    }

    /// Little-endian: magic, version, lane count, world, rank, region
    /// address and length, then per lane GID, GID index, rkey, MTU code, a
    /// reserved word and (QPN, PSN) per rank.
    fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(Self::encoded_len(self.world as usize, self.lanes.len()));
        b.extend_from_slice(&ENDPOINT_MAGIC.to_le_bytes());
        b.extend_from_slice(&ENDPOINT_VERSION.to_le_bytes());
        b.extend_from_slice(&(self.lanes.len() as u16).to_le_bytes());
        b.extend_from_slice(&self.world.to_le_bytes());
        b.extend_from_slice(&self.rank.to_le_bytes());
        b.extend_from_slice(&self.addr.to_le_bytes());
        b.extend_from_slice(&self.len.to_le_bytes());
        for l in &self.lanes {
            b.extend_from_slice(&l.gid);
            b.extend_from_slice(&l.gid_index.to_le_bytes());
            b.extend_from_slice(&l.rkey.to_le_bytes());
            b.extend_from_slice(&l.mtu.to_le_bytes());
            b.extend_from_slice(&0u32.to_le_bytes());
            for &(qpn, psn) in &l.qps {
                b.extend_from_slice(&qpn.to_le_bytes());
                b.extend_from_slice(&psn.to_le_bytes());
            }
        }
        b
    }

    /// Decodes `rank`'s record and checks it against what this rank expects;
    /// every error names that rank.
    fn decode(rank: usize, world: usize, region_len: usize, b: &[u8]) -> Result<Self> {
        let bad = |what: String| Error::PeerFailed {
            peer: rank,
            reason: format!("its verbs endpoint record is unusable: {what}"),
        };
        if b.len() < HEADER_BYTES {
            return Err(bad(format!(
                "{} bytes, shorter than the {HEADER_BYTES}-byte header (another arx build?)",
                b.len()
            )));
        }
        let u16_at = |o: usize| u16::from_le_bytes([b[o], b[o + 1]]);
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"));
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"));
        if u32_at(0) != ENDPOINT_MAGIC {
            return Err(bad(format!("magic {:#x}", u32_at(0))));
        }
        if u16_at(4) != ENDPOINT_VERSION {
            return Err(bad(format!(
                "version {}, this build speaks {ENDPOINT_VERSION}",
                u16_at(4)
            )));
        }
        let lanes = u16_at(6) as usize;
        if lanes != LANES {
            return Err(bad(format!("{lanes} lanes announced, {LANES} needed")));
        }
        let (w, r) = (u32_at(8) as usize, u32_at(12) as usize);
        if w != world || r != rank {
            return Err(bad(format!(
                "it says rank {r} of {w}, expected rank {rank} of {world}"
            )));
        }
        let want = Self::encoded_len(world, lanes);
        if b.len() != want {
            return Err(bad(format!("{} bytes, expected {want}", b.len())));
        }
        let (addr, len) = (u64_at(16), u64_at(24));
        if addr == 0 || len != region_len as u64 {
            return Err(bad(format!(
                "region at {addr:#x} of {len} bytes, expected {region_len} bytes"
            )));
        }
        let mut out = Endpoint {
            world: w as u32,
            rank: r as u32,
            addr,
            len,
            lanes: Vec::with_capacity(lanes),
        };
        let mut o = HEADER_BYTES;
        for lane in 0..lanes {
            let gid: [u8; 16] = b[o..o + 16].try_into().expect("16 bytes");
            if gid == [0; 16] {
                return Err(bad(format!("lane {lane} has no GID")));
            }
            let mtu = u32_at(o + 24);
            if mtu_bytes(mtu) == 0 {
                return Err(bad(format!("lane {lane} has MTU code {mtu}")));
            }
            let mut l = LaneRecord {
                gid,
                gid_index: u32_at(o + 16),
                rkey: u32_at(o + 20),
                mtu,
                qps: Vec::with_capacity(world),
            };
            o += LANE_FIXED_BYTES;
            for q in 0..world {
                let (qpn, psn) = (u32_at(o), u32_at(o + 4));
                if q != rank && (qpn == 0 || qpn > 0x00ff_ffff || psn > 0x00ff_ffff) {
                    return Err(bad(format!(
                        "lane {lane} QP for rank {q}: QPN {qpn:#x}, PSN {psn:#x}"
                    )));
                }
                l.qps.push((qpn, psn));
                o += 8;
            }
            out.lanes.push(l);
        }
        Ok(out)
    }
}

// ------------------------------------------------------------ the fabric

/// A peer's region as seen from one lane's device.
#[derive(Debug, Clone, Copy)]
struct RemoteRegion {
    addr: u64,
    rkey: u32,
}

/// RC QPs to every peer on both lanes.
pub(crate) struct VerbsFabric {
    // Field order is drop order: QPs, then the devices (CQ, MR, PD,
    // context); the Arcs inside make this right regardless.
    qps: Vec<Qp>,
    devices: Vec<Device>,
    /// Device index of each lane.
    lane_dev: [usize; LANES],
    /// Index into `qps` of (peer, lane): `qp_index[peer * LANES + lane]`.
    qp_index: Vec<usize>,
    /// Each peer's region per lane: `remote[peer * LANES + lane]`.
    remote: Vec<RemoteRegion>,
    layout: Layout,
    base: u64,
    timeout: Duration,
    path_mtu: [u32; LANES],
    /// Last seq posted.
    last_seq: u64,
    last_post: Instant,
    /// Signal the last WR of every call on every QP, so that
    /// [`Fabric::completed_through`] follows each call (copy-engine staging
    /// waits for it); otherwise one WR in [`SIGNAL_EVERY`].
    signal_each_call: bool,
    /// Some QP has WRs posted after its last signalled one.
    tail: bool,
    /// The first failed completion; later calls return it again.
    failed: Option<Error>,
    /// `progress` calls since the last stall check.
    polls: u32,
    /// The proxy core the topology chose (ARX_PROXY_CPU wins there).
    proxy_cpu: Option<usize>,
}

/// What `open_local` made: devices, the device of each lane, QPs (in INIT)
/// and the index of (peer, lane) into them.
struct Local {
    devices: Vec<Device>,
    lane_dev: [usize; LANES],
    qps: Vec<Qp>,
    qp_index: Vec<usize>,
}

fn open_local(layout: &Layout, region: &Arc<Region>, lanes: &[LaneDevice]) -> Result<Local> {
    if lanes.len() != LANES {
        return Err(Error::Topology(format!(
            "selection has {} lanes, the Verbs fabric needs {LANES}",
            lanes.len()
        )));
    }
    let world = layout.world();
    let me = layout.rank();
    let mut names: Vec<&str> = Vec::new();
    let mut lane_dev = [0usize; LANES];
    for (l, d) in lanes.iter().enumerate() {
        lane_dev[l] = match names.iter().position(|n| *n == d.name) {
            Some(i) => i,
            None => {
                names.push(&d.name);
                names.len() - 1
            }
        };
    }
    let qps_per_dev = |i: usize| (world - 1) * lane_dev.iter().filter(|&&d| d == i).count();
    // Pinned by the provider besides the region: send queues (a WQE with
    // inline data takes up to 256 bytes) and CQs (up to 128 bytes a CQE).
    let cqes: usize = (0..names.len()).map(|i| cq_depth(qps_per_dev(i))).sum();
    let needed = names.len() * region.len()
        + (world - 1) * LANES * (SQ_DEPTH as usize) * 256
        + cqes * 128
        + (1 << 20);
    topology::check_memlock(needed)?;

    let list = DeviceList::get()?;
    let mut devices = Vec::with_capacity(names.len());
    for (i, name) in names.iter().enumerate() {
        let sel = lanes
            .iter()
            .find(|d| d.name == *name)
            .expect("name from lanes");
        let depth = u32::try_from(cq_depth(qps_per_dev(i))).map_err(|_| {
            verbs_err(
                "ibv_create_cq",
                name,
                None,
                None,
                format!("{} QPs need too many CQ entries", qps_per_dev(i)),
            )
        })?;
        devices.push(Device::open(&list, sel, region, depth)?);
    }
    drop(list);

    let mut qps = Vec::with_capacity((world - 1) * LANES);
    let mut qp_index = vec![usize::MAX; world * LANES];
    for step in 1..world {
        let q = (me + step) % world;
        for lane in 0..LANES {
            let d = lane_dev[lane];
            let qp = create_qp(&devices[d], q, lane, d)?;
            to_init(&qp, &devices[d])?;
            qp_index[q * LANES + lane] = qps.len();
            qps.push(qp);
        }
    }
    Ok(Local {
        devices,
        lane_dev,
        qps,
        qp_index,
    })
}

/// Creates the QPs, exchanges their numbers over `boot` and connects them.
/// Collective: a failure on any rank fails every rank.
pub(crate) fn connect(
    boot: &Bootstrap,
    cfg: &Config,
    layout: &Layout,
    region: &Arc<Region>,
    local_rank: topology::LocalRank,
) -> Result<VerbsFabric> {
    let world = layout.world();
    let me = layout.rank();
    let local = topology::select(cfg, &local_rank)
        .and_then(|sel| open_local(layout, region, &sel.lanes).map(|l| (sel, l)));
    let (
        sel,
        Local {
            devices,
            lane_dev,
            qps,
            qp_index,
        },
    ) = boot.agree("verbs devices", local)?;
    let qp_ref = |q: usize, lane: usize| &qps[qp_index[q * LANES + lane]];

    let mine = Endpoint {
        world: world as u32,
        rank: me as u32,
        addr: region.as_ptr() as u64,
        len: region.len() as u64,
        lanes: (0..LANES)
            .map(|lane| {
                let dev = &devices[lane_dev[lane]];
                LaneRecord {
                    gid: dev.gid,
                    gid_index: dev.sel.gid_index,
                    rkey: dev.mr.rkey(),
                    mtu: dev.active_mtu,
                    qps: (0..world)
                        .map(|q| {
                            if q == me {
                                (0, 0)
                            } else {
                                // SAFETY: a live QP; qp_num is set at creation.
                                let qpn = unsafe { (*qp_ref(q, lane).raw.as_ptr()).qp_num };
                                (qpn, qp_ref(q, lane).psn)
                            }
                        })
                        .collect(),
                }
            })
            .collect(),
    };
    let all = boot.all_gather_bytes("verbs endpoints", &mine.encode())?;

    let connected = (|| -> Result<(Vec<RemoteRegion>, [u32; LANES])> {
        if all.len() != world {
            return Err(Error::Mpi {
                call: "MPI_Iallgather",
                detail: format!("{} endpoint records for {world} ranks", all.len()),
            });
        }
        let eps = all
            .iter()
            .enumerate()
            .map(|(r, b)| Endpoint::decode(r, world, region.len(), b))
            .collect::<Result<Vec<_>>>()?;
        let mut remote = vec![RemoteRegion { addr: 0, rkey: 0 }; world * LANES];
        let mut path_mtu = [u32::MAX; LANES];
        for step in 1..world {
            let q = (me + step) % world;
            for lane in 0..LANES {
                let dev = &devices[lane_dev[lane]];
                let theirs = &eps[q].lanes[lane];
                let (qpn, psn) = theirs.qps[me];
                let mtu = dev.active_mtu.min(theirs.mtu);
                let qp = qp_ref(q, lane);
                to_rtr(
                    qp,
                    dev,
                    &RemoteQp {
                        gid: theirs.gid,
                        qpn,
                        psn,
                    },
                    mtu,
                )?;
                to_rts(qp, dev)?;
                path_mtu[lane] = path_mtu[lane].min(mtu_bytes(mtu));
                remote[q * LANES + lane] = RemoteRegion {
                    addr: eps[q].addr,
                    rkey: theirs.rkey,
                };
            }
        }
        Ok((remote, path_mtu))
    })();
    // Also the barrier: nobody writes before every peer's QPs are in RTR.
    let (remote, path_mtu) = boot.agree("verbs connect", connected)?;

    let fabric = VerbsFabric {
        qps,
        devices,
        lane_dev,
        qp_index,
        remote,
        layout: *layout,
        base: region.as_ptr() as u64,
        timeout: cfg.timeout,
        path_mtu,
        last_seq: 0,
        last_post: Instant::now(),
        signal_each_call: cfg.staging == Staging::CopyEngine,
        tail: false,
        failed: None,
        polls: 0,
        proxy_cpu: sel.proxy_cpu,
    };
    log::info!("arx verbs: rank {me}: {}", fabric.describe());
    Ok(fabric)
}

/// One WR to be chained: local source (address, length, lkey; INLINE when
/// lkey is None), remote destination.
struct Write {
    local: u64,
    len: u32,
    lkey: Option<u32>,
    remote: u64,
    rkey: u32,
}

impl VerbsFabric {
    /// Posts call `seq` to every peer (see [`Fabric::post`]).
    fn post_all(&mut self, seq: u64, bytes: usize, flag: u64) -> Result<()> {
        let p = (seq & 1) as usize;
        let me = self.layout.rank();
        let world = self.layout.world();
        let src = self.base + self.layout.send_offset(p) as u64;
        let dst_data = self.layout.recv_offset(p, me) as u64;
        for step in 1..world {
            let q = (me + step) % world;
            for lane in 0..LANES {
                let i = self.qp_index[q * LANES + lane];
                let rr = self.remote[q * LANES + lane];
                let part = Layout::lane_range(bytes, lane);
                let flag_remote = rr.addr + self.layout.flag_offset(p, me, lane) as u64;
                let lkey = self.devices[self.lane_dev[lane]].mr.lkey();
                let data = Write {
                    local: src + part.start as u64,
                    len: part.len() as u32,
                    lkey: Some(lkey),
                    remote: rr.addr + dst_data + part.start as u64,
                    rkey: rr.rkey,
                };
                // INLINE: the word is copied when posted; `flag` is a value.
                let flag_wr = Write {
                    local: &flag as *const u64 as u64,
                    len: 8,
                    lkey: None,
                    remote: flag_remote,
                    rkey: rr.rkey,
                };
                let each = self.signal_each_call;
                if part.is_empty() {
                    self.reserve(i, 1)?;
                    self.post_chain(i, &[flag_wr], each, Some(seq))?;
                } else {
                    self.reserve(i, 2)?;
                    self.post_chain(i, &[data, flag_wr], each, Some(seq))?;
                }
                self.qps[i].last_flag = Some((flag_remote, flag));
            }
        }
        self.last_seq = seq;
        self.last_post = Instant::now();
        Ok(())
    }

    /// Records the first failure and tells every peer still reachable
    /// (poisoned flags for `seq` and `seq + 1`), so they fail at once naming
    /// this rank instead of timing out.
    fn fail(&mut self, e: Error, seq: u64) -> Error {
        if self.failed.is_none() {
            self.failed = Some(e.clone());
            self.poison(seq);
        }
        e
    }

    fn device_name(&self, qp: &Qp) -> &str {
        &self.devices[qp.dev].ctx.name
    }

    /// Room for `n` more WRs on QP `i`, polling (bounded) while it is full.
    fn reserve(&mut self, i: usize, n: u64) -> Result<()> {
        if self.qps[i].ledger.has_room(n) {
            return Ok(());
        }
        let start = Instant::now();
        let mut backoff = Backoff::new(crate::config::SpinMode::Adaptive, 1000);
        loop {
            self.progress()?;
            let qp = &self.qps[i];
            if qp.ledger.has_room(n) {
                return Ok(());
            }
            if start.elapsed() > self.timeout {
                return Err(Error::Timeout {
                    during: "verbs send queue (waiting for completions)",
                    waited: start.elapsed(),
                    detail: format!(
                        "device {}, peer {}, lane {}: {} WRs outstanding of {}; the peer's NIC does not acknowledge",
                        self.device_name(qp),
                        qp.peer,
                        qp.lane,
                        qp.ledger.outstanding(),
                        qp.ledger.depth
                    ),
                });
            }
            backoff.idle();
        }
    }

    /// Posts `writes` as one chain on QP `i` (room must be reserved).
    /// `signal_last` signals the last WR whatever the count; the chain's
    /// last WR completes call `seq` on this QP (None: a chain that completes
    /// no new call, see [`Ledger::commit`]).
    fn post_chain(
        &mut self,
        i: usize,
        writes: &[Write],
        signal_last: bool,
        seq: Option<u64>,
    ) -> Result<()> {
        debug_assert!(!writes.is_empty() && writes.len() <= MAX_CHAIN);
        // SAFETY: ibv_sge and ibv_send_wr are plain old data.
        let mut sges: [ibv_sge; MAX_CHAIN] = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let mut wrs: [ibv_send_wr; MAX_CHAIN] = unsafe { std::mem::zeroed() };
        let qp = &mut self.qps[i];
        if qp.ledger.outstanding() == 0 {
            // The stall clock starts when the QP stops being idle.
            qp.last_progress = Instant::now();
        }
        let n = writes.len().min(MAX_CHAIN);
        if n == 0 {
            return Ok(());
        }
        let plan = qp.ledger.plan(n, signal_last);
        for (k, w) in writes.iter().take(n).enumerate() {
            let count = qp.ledger.posted + k as u64 + 1;
            sges[k] = ibv_sge {
                addr: w.local,
                length: w.len,
                lkey: w.lkey.unwrap_or(0),
            };
            let wr = &mut wrs[k];
            wr.wr_id = ((i as u64) << WR_COUNT_BITS) | (count & WR_COUNT_MASK);
            wr.sg_list = &mut sges[k];
            wr.num_sge = 1;
            wr.opcode = ibv_wr_opcode::IBV_WR_RDMA_WRITE;
            let mut flags = 0;
            if w.lkey.is_none() {
                flags |= ibv_send_flags::IBV_SEND_INLINE.0;
            }
            if plan & (1 << k) != 0 {
                flags |= ibv_send_flags::IBV_SEND_SIGNALED.0;
            }
            wr.send_flags = flags;
            wr.wr.rdma = rdma_t {
                remote_addr: w.remote,
                rkey: w.rkey,
            };
        }
        for k in 0..n - 1 {
            let next: *mut ibv_send_wr = &mut wrs[k + 1];
            wrs[k].next = next;
        }
        let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
        // SAFETY: a live QP in RTS; the chain and its SGEs live on this
        // stack frame for the duration of the call (the provider copies
        // them, and INLINE data is copied at post time); non-inline SGEs
        // point into our registered region.
        let rc = unsafe { ibv_post_send(qp.raw.as_ptr(), wrs.as_mut_ptr(), &mut bad) };
        if rc != 0 {
            // The WRs before `bad` were posted (they will complete, or be
            // flushed, and must be counted); the provider refused the rest
            // (e.g. the QP is in error): later posts must not use this QP,
            // the poison goes through another.
            let accepted = wrs[..n]
                .iter()
                .position(|w| std::ptr::eq(w, bad))
                .unwrap_or(0);
            qp.ledger.commit(accepted, n, plan, seq);
            qp.broken = true;
            let (peer, lane) = (qp.peer, qp.lane);
            return Err(verbs_err(
                "ibv_post_send",
                &self.devices[qp.dev].ctx.name,
                Some(peer),
                Some(lane),
                format!("{} (WR {accepted} of a chain of {n})", errno_text(rc)),
            ));
        }
        qp.ledger.commit(n, n, plan, seq);
        if qp.ledger.signaled != qp.ledger.posted {
            self.tail = true;
        }
        Ok(())
    }

    /// Polls every CQ dry and retires the completed WRs in their QPs'
    /// ledgers, failed and flushed ones included (each is then no longer
    /// outstanding). Returns the first failed completion.
    fn reap(&mut self) -> Result<()> {
        // SAFETY: ibv_wc is plain old data.
        let mut wcs: [ibv_wc; POLL_BATCH] = unsafe { std::mem::zeroed() };
        let mut first_err: Option<Error> = None;
        let mut now_cached: Option<Instant> = None;
        for d in 0..self.devices.len() {
            loop {
                // SAFETY: a live CQ; `wcs` has room for POLL_BATCH entries.
                let n = unsafe {
                    ibv_poll_cq(
                        self.devices[d].cq.raw.as_ptr(),
                        POLL_BATCH as c_int,
                        wcs.as_mut_ptr(),
                    )
                };
                if n < 0 {
                    first_err.get_or_insert_with(|| {
                        verbs_err(
                            "ibv_poll_cq",
                            &self.devices[d].ctx.name,
                            None,
                            None,
                            errno_text(-1),
                        )
                    });
                    break;
                }
                for wc in &wcs[..n as usize] {
                    let i = (wc.wr_id >> WR_COUNT_BITS) as usize;
                    let Some(qp) = self.qps.get_mut(i) else {
                        continue;
                    };
                    // Counts below 2^48 per QP: the low bits are the count.
                    qp.ledger.complete(wc.wr_id & WR_COUNT_MASK);
                    if wc.status == ibv_wc_status::IBV_WC_SUCCESS {
                        qp.last_progress = *now_cached.get_or_insert_with(Instant::now);
                        continue;
                    }
                    qp.broken = true;
                    if first_err.is_some() {
                        continue;
                    }
                    // SAFETY: ibv_wc_status_str returns a static string.
                    let status = unsafe { CStr::from_ptr(ibv_wc_status_str(wc.status)) }
                        .to_string_lossy()
                        .into_owned();
                    let (peer, lane, dev) = (qp.peer, qp.lane, qp.dev);
                    first_err = Some(verbs_err(
                        "completion",
                        &self.devices[dev].ctx.name,
                        Some(peer),
                        Some(lane),
                        format!(
                            "{status} (status {}, vendor error {:#x}, WR {} of this QP); \
                             is peer {peer} alive and its link up?",
                            wc.status,
                            wc.vendor_err,
                            wc.wr_id & WR_COUNT_MASK
                        ),
                    ));
                }
                if (n as usize) < POLL_BATCH {
                    break;
                }
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Writes poisoned flags for `seq` and `seq + 1` into every peer this
    /// rank can still reach, so that peers waiting on it fail at once.
    fn poison(&mut self, seq: u64) {
        let world = self.layout.world();
        let me = self.layout.rank();
        for step in 1..world {
            let q = (me + step) % world;
            // Any healthy QP to q can write every flag of ours there: its
            // device's rkey covers the whole region.
            let Some(lane) = (0..LANES).find(|&l| !self.qps[self.qp_index[q * LANES + l]].broken)
            else {
                continue;
            };
            let i = self.qp_index[q * LANES + lane];
            let rr = self.remote[q * LANES + lane];
            let words: Vec<(u64, u64)> = [seq, seq + 1]
                .iter()
                .flat_map(|&s| {
                    let p = (s & 1) as usize;
                    let word = flag_word(s, crate::abi::ARX_DTYPE_INVALID, POISON_COUNT);
                    (0..LANES).map(move |l| (p, l, word)).collect::<Vec<_>>()
                })
                .map(|(p, l, word)| (rr.addr + self.layout.flag_offset(p, me, l) as u64, word))
                .collect();
            if !self.qps[i].ledger.has_room(words.len() as u64) {
                continue;
            }
            let writes: Vec<Write> = words
                .iter()
                .map(|(remote, word)| Write {
                    local: word as *const u64 as u64,
                    len: 8,
                    lkey: None,
                    remote: *remote,
                    rkey: rr.rkey,
                })
                .collect();
            if let Err(e) = self.post_chain(i, &writes, true, None) {
                log::warn!("arx verbs: could not tell peer {q} about the failure: {e}");
            }
        }
    }

    /// Re-writes each QP's last flag, signalled, so that an unsignalled tail
    /// completes observably (or, with `stalled`, so that a QP whose WRs have
    /// not completed for [`KICK_AFTER`] is kicked). Idempotent at the peer:
    /// the same word again, ordered after the original on the same QP.
    fn flush_tails(&mut self, stalled: bool) -> Result<()> {
        let now = Instant::now();
        if !stalled {
            self.tail = false;
        }
        for i in 0..self.qps.len() {
            let qp = &mut self.qps[i];
            if qp.broken || !qp.ledger.has_room(1) {
                continue;
            }
            if stalled {
                if qp.ledger.outstanding() == 0 || now - qp.last_progress < KICK_AFTER {
                    continue;
                }
                log::debug!(
                    "arx verbs: peer {} lane {}: {} WRs outstanding for {:?}; kicking",
                    qp.peer,
                    qp.lane,
                    qp.ledger.outstanding(),
                    now - qp.last_progress
                );
                qp.last_progress = now;
            } else if qp.ledger.signaled == qp.ledger.posted {
                continue;
            }
            let qp = &self.qps[i];
            let Some((remote, word)) = qp.last_flag else {
                continue;
            };
            let rkey = self.remote[qp.peer * LANES + qp.lane].rkey;
            self.post_chain(
                i,
                &[Write {
                    local: &word as *const u64 as u64,
                    len: 8,
                    lkey: None,
                    remote,
                    rkey,
                }],
                true,
                None,
            )?;
        }
        Ok(())
    }
}

impl Fabric for VerbsFabric {
    fn name(&self) -> &'static str {
        "verbs"
    }

    fn post(&mut self, seq: u64, bytes: usize, flag: u64) -> Result<()> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        self.post_all(seq, bytes, flag)
            .map_err(|e| self.fail(e, seq))
    }

    fn inject_fault(&mut self, peer: usize, lane: usize) -> Result<()> {
        let i = *self
            .qp_index
            .get(peer * LANES + lane)
            .ok_or_else(|| Error::InvalidArgument(format!("no QP to peer {peer} lane {lane}")))?;
        let qp = &self.qps[i];
        to_err(qp, &self.devices[qp.dev])
    }

    fn progress(&mut self) -> Result<()> {
        // Reap even after a failure: flushed WRs must be counted so that
        // `quiescent` can tell the proxy that nothing is outstanding.
        let reaped = self.reap();
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        if let Err(e) = reaped {
            let seq = self.last_seq;
            return Err(self.fail(e, seq));
        }
        if self.tail && self.last_post.elapsed() > FLUSH_AFTER {
            self.flush_tails(false)?;
        }
        self.polls += 1;
        if self.polls >= KICK_CHECK_EVERY {
            self.polls = 0;
            self.flush_tails(true)?;
        }
        Ok(())
    }

    fn proxy_cpu(&self) -> Option<usize> {
        self.proxy_cpu
    }

    fn needs_collective_close(&self) -> bool {
        true
    }

    fn quiescent(&self) -> bool {
        self.qps.iter().all(|q| q.ledger.outstanding() == 0)
    }

    fn completed_through(&self, _posted: u64) -> u64 {
        // Every call goes to every QP, so a call is complete once every QP
        // has completed it.
        self.qps
            .iter()
            .map(|q| q.ledger.done_seq)
            .min()
            .unwrap_or(self.last_seq)
    }

    fn describe(&self) -> String {
        let lanes: Vec<String> = (0..LANES)
            .map(|l| {
                let d = &self.devices[self.lane_dev[l]];
                format!(
                    "lane {l}: {} port {} GID[{}] {} MTU {} (path {})",
                    d.ctx.name,
                    d.sel.port,
                    d.sel.gid_index,
                    gid_text(&d.gid),
                    mtu_bytes(d.active_mtu),
                    self.path_mtu[l]
                )
            })
            .collect();
        format!(
            "{}; {} RC QPs, send queue {SQ_DEPTH}, signal every {SIGNAL_EVERY}{}",
            lanes.join("; "),
            self.qps.len(),
            if self.signal_each_call {
                " and each call's last"
            } else {
                ""
            }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn endpoint(world: usize, rank: usize) -> Endpoint {
        Endpoint {
            world: world as u32,
            rank: rank as u32,
            addr: 0x7f00_0000_0000,
            len: 1 << 20,
            lanes: (0..LANES)
                .map(|l| LaneRecord {
                    gid: [l as u8 + 1; 16],
                    gid_index: 3,
                    rkey: 0x1234 + l as u32,
                    mtu: ibv_mtu::IBV_MTU_4096,
                    qps: (0..world)
                        .map(|q| {
                            if q == rank {
                                (0, 0)
                            } else {
                                (0x100 + q as u32, 0x42)
                            }
                        })
                        .collect(),
                })
                .collect(),
        }
    }

    #[test]
    fn endpoint_round_trips() {
        for world in [2, 3, 16] {
            for rank in 0..world {
                let e = endpoint(world, rank);
                let b = e.encode();
                assert_eq!(b.len(), Endpoint::encoded_len(world, LANES));
                assert_eq!(Endpoint::decode(rank, world, 1 << 20, &b).unwrap(), e);
            }
        }
    }

    /// The endpoint record's byte layout is the wire format between builds:
    /// pinned here (the hex came from the encoder before the shared codec).
    #[test]
    fn endpoint_layout_is_pinned() {
        let b: String = endpoint(3, 1)
            .encode()
            .iter()
            .map(|x| format!("{x:02x}"))
            .collect();
        let lane = |gid: &str, rkey: &str| {
            [gid, "03000000", rkey, "05000000", "00000000"].concat()
                // (QPN, PSN) facing ranks 0, 1 (itself), 2.
                + "0001000042000000" + "0000000000000000" + "0201000042000000"
        };
        let want = [
            "41525856", // "ARXV"
            "0100",     // version
            "0200",     // lanes
            "03000000", // world
            "01000000", // rank
            "00000000007f0000",
            "0000100000000000",
        ]
        .concat()
            + &lane(&"01".repeat(16), "34120000")
            + &lane(&"02".repeat(16), "35120000");
        assert_eq!(b, want);
    }

    fn rejects(b: &[u8], rank: usize, needle: &str) {
        match Endpoint::decode(rank, 3, 1 << 20, b) {
            Err(Error::PeerFailed { peer, reason }) => {
                assert_eq!(peer, rank);
                assert!(reason.contains(needle), "{reason} lacks {needle}");
            }
            other => panic!("expected a rejection naming {needle}, got {other:?}"),
        }
    }

    #[test]
    fn bad_endpoints_name_the_rank() {
        let good = endpoint(3, 2).encode();
        rejects(&good[..10], 2, "shorter");
        rejects(&good[..good.len() - 1], 2, "bytes, expected");
        let mut b = good.clone();
        b[0] ^= 1;
        rejects(&b, 2, "magic");
        let mut b = good.clone();
        b[4] = 9;
        rejects(&b, 2, "version");
        let mut e = endpoint(3, 2);
        e.lanes.pop();
        rejects(&e.encode(), 2, "1 lanes");
        let mut e = endpoint(3, 2);
        e.lanes[1].gid = [0; 16];
        rejects(&e.encode(), 2, "lane 1 has no GID");
        let mut e = endpoint(3, 2);
        e.lanes[0].qps[1] = (0, 0);
        rejects(&e.encode(), 2, "QP for rank 1");
        let mut e = endpoint(3, 2);
        e.len = 4096;
        rejects(&e.encode(), 2, "region");
        rejects(&endpoint(3, 1).encode(), 2, "expected rank 2");
    }

    /// A model of one QP on an RC provider: WRs complete in order; a
    /// completion is reported for a signalled WR, or for every WR once the
    /// QP is in error (flush).
    struct Model {
        ledger: Ledger,
        /// (count, call it belongs to or None, signalled) of every WR posted.
        wrs: Vec<(u64, Option<u64>, bool)>,
        /// WRs the "NIC" has executed.
        executed: usize,
        /// The last call whose every WR the NIC has executed.
        truly_done: u64,
    }

    impl Model {
        fn new(depth: u64) -> Self {
            Model {
                ledger: Ledger::new(depth),
                wrs: Vec::new(),
                executed: 0,
                truly_done: 0,
            }
        }

        /// Posts call `seq` (`len` WRs) or, with `seq` None, an extra
        /// chain; false when the queue has no room.
        fn post(&mut self, len: usize, signal_last: bool, seq: Option<u64>) -> bool {
            if !self.ledger.has_room(len as u64) {
                return false;
            }
            let plan = self.ledger.plan(len, signal_last);
            for k in 0..len {
                let count = self.ledger.posted + k as u64 + 1;
                let call = if k + 1 == len { seq } else { None };
                self.wrs.push((count, call, plan & (1 << k) != 0));
            }
            self.ledger.commit(len, len, plan, seq);
            true
        }

        /// The NIC executes `n` more WRs; their completions are reaped.
        fn run(&mut self, n: usize, flushed: bool) {
            let end = self.executed.saturating_add(n).min(self.wrs.len());
            for &(count, call, signalled) in &self.wrs[self.executed..end] {
                // Calls are posted in order, each ending with its WR.
                if let Some(c) = call {
                    self.truly_done = c;
                }
                if signalled || flushed {
                    self.ledger.complete(count);
                }
            }
            self.executed = end;
        }
    }

    #[test]
    fn per_call_signalling_completes_every_call_without_a_flush() {
        let mut m = Model::new(u64::from(SQ_DEPTH));
        for seq in 1..=1000u64 {
            // Calls alternate between data + flag and a flag alone.
            let len = if seq % 3 == 0 { 1 } else { 2 };
            assert!(m.post(len, true, Some(seq)));
            m.run(len, false);
            assert_eq!(m.ledger.done_seq, seq, "call {seq}");
            assert_eq!(m.ledger.outstanding(), 0);
        }
    }

    #[test]
    fn done_seq_never_runs_ahead_of_the_nic() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(0xa5c3);
        for signal_last in [false, true] {
            let mut m = Model::new(u64::from(SQ_DEPTH));
            let mut seq = 0;
            for _ in 0..20_000 {
                match rng.gen_range(0..10) {
                    0..=4 => {
                        let len = rng.gen_range(1..=2);
                        if m.post(len, signal_last, Some(seq + 1)) {
                            seq += 1;
                        }
                    }
                    // A re-written flag (tail flush, kick).
                    5 => {
                        m.post(1, true, None);
                    }
                    _ => m.run(rng.gen_range(0..4), false),
                }
                assert!(m.ledger.done_seq <= m.truly_done);
                assert!(m.ledger.outstanding() <= m.ledger.depth);
                if signal_last && m.executed == m.wrs.len() {
                    assert_eq!(m.ledger.done_seq, seq);
                }
            }
            // An idle QP whose tail was flushed has completed everything.
            m.run(usize::MAX, false);
            m.post(1, true, None);
            m.run(1, false);
            assert_eq!(m.ledger.done_seq, seq);
            assert_eq!(m.ledger.outstanding(), 0);
        }
    }

    #[test]
    fn signal_every_16_and_when_filling_the_queue() {
        let mut m = Model::new(u64::from(SQ_DEPTH));
        for seq in 1..=8 {
            m.post(2, false, Some(seq));
        }
        let signalled: Vec<u64> = m.wrs.iter().filter(|w| w.2).map(|w| w.0).collect();
        assert_eq!(signalled, [16]);
        // Nothing completes: the WR that fills the queue is signalled.
        let mut m = Model::new(8);
        for seq in 1..=4 {
            assert!(m.post(2, false, Some(seq)));
        }
        assert!(!m.post(1, false, Some(5)));
        assert!(m.wrs.last().unwrap().2, "the WR filling the queue");
        m.run(8, false);
        assert_eq!((m.ledger.outstanding(), m.ledger.done_seq), (0, 4));
    }

    #[test]
    fn a_flushed_queue_has_nothing_outstanding() {
        let mut m = Model::new(u64::from(SQ_DEPTH));
        let mut seq = 0;
        while m.post(2, false, Some(seq + 1)) {
            seq += 1;
        }
        m.run(5, false);
        assert!(m.ledger.outstanding() > 0);
        // The QP goes to error: every WR left completes (flushed).
        m.run(usize::MAX, true);
        assert_eq!(m.ledger.outstanding(), 0);
        assert_eq!(m.ledger.done_seq, seq);
        // A stale or foreign count changes nothing.
        m.ledger.complete(3);
        m.ledger.complete(u64::MAX);
        assert_eq!(
            (m.ledger.completed, m.ledger.done_seq),
            (m.ledger.posted, seq)
        );
    }

    #[test]
    fn a_partly_posted_chain_counts_what_was_posted() {
        let mut l = Ledger::new(16);
        let plan = l.plan(2, true);
        l.commit(2, 2, plan, Some(1));
        let plan = l.plan(2, true);
        // The provider took the data WR of call 2 but not its flag.
        l.commit(1, 2, plan, Some(2));
        assert_eq!((l.posted, l.last_seq), (3, 1));
        l.complete(3);
        assert_eq!((l.outstanding(), l.done_seq), (0, 1));
    }

    /// Every WR the ledger lets a QP have outstanding gets a completion
    /// when the QP fails (flush): a CQ shared by `qps` QPs must hold them
    /// all, whatever the mix of calls, re-written flags and poisoned flags.
    #[test]
    fn cq_holds_every_wr_that_a_failure_can_flush() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(0x0cc0);
        // QPs sharing one CQ: a peer per lane, or both lanes on one device,
        // from 2 ranks to the largest world.
        let max_qps = 2 * (crate::abi::ARX_MAX_WORLD as usize - 1);
        for qps in [1, 2, 3, 4, 7, 14, 15, 30, 62, max_qps] {
            let mut worst = 0u64;
            for signal_last in [false, true] {
                let mut models: Vec<Model> =
                    (0..qps).map(|_| Model::new(u64::from(SQ_DEPTH))).collect();
                let mut seq = 0;
                // Post calls until some QP is full, as the proxy does (a
                // call goes to every QP), with a few re-written flags.
                loop {
                    seq += 1;
                    let len = rng.gen_range(1..=2);
                    if !models.iter().all(|m| m.ledger.has_room(len as u64)) {
                        break;
                    }
                    for m in &mut models {
                        assert!(m.post(len, signal_last, Some(seq)));
                        if rng.gen_range(0..20) == 0 {
                            m.post(1, true, None);
                        }
                    }
                }
                // Then a failure: poisoned flags where room is left, and
                // every QP fills up to its limit.
                for m in &mut models {
                    m.post(MAX_CHAIN, true, None);
                    while m.post(1, true, None) {}
                }
                let flushed: u64 = models.iter().map(|m| m.ledger.outstanding()).sum();
                worst = worst.max(flushed);
                assert!(
                    flushed + (qps as u64) * u64::from(RQ_DEPTH) <= cq_depth(qps) as u64,
                    "{qps} QPs: {flushed} completions, CQ of {}",
                    cq_depth(qps)
                );
            }
            // The bound is reached: nothing smaller would do.
            assert_eq!(worst, qps as u64 * u64::from(SQ_DEPTH));
        }
    }

    #[test]
    fn mtu_codes() {
        assert_eq!(mtu_bytes(ibv_mtu::IBV_MTU_1024), 1024);
        assert_eq!(mtu_bytes(ibv_mtu::IBV_MTU_4096), 4096);
        assert_eq!(mtu_bytes(0), 0);
    }
}
