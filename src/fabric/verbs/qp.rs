//! RC queue pairs, with their state in the type: [`Qp::create`] gives a
//! `Qp<Init>`, [`Qp::into_rtr`] (once the peer's QP is known) a `Qp<Rtr>`,
//! [`Qp::into_rts`] a `Qp<Rts>`, and only a `Qp<Rts>` posts. Each transition
//! is one `ibv_modify_qp` with its attributes and mask spelled out.

use std::ffi::c_int;
use std::marker::PhantomData;
use std::ptr::NonNull;
use std::sync::Arc;

use rdma_sys::*;

use super::wrappers::{destroy_on_drop, Cq, Device, Pd};
use super::{
    errno_text, gid_text, mtu_bytes, verbs_err, ACK_TIMEOUT, HOP_LIMIT, INLINE_BYTES, RETRY_CNT,
    RNR_RETRY, RQ_DEPTH, SQ_DEPTH,
};
use crate::error::Result;

/// Created, bound to its port; remote peers may write into our MR.
pub(super) enum Init {}
/// Ready to receive: bound to the peer's QP.
pub(super) enum Rtr {}
/// Ready to send.
pub(super) enum Rts {}

/// One QP's far end as its peer announced it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct RemoteQp {
    pub(super) gid: [u8; 16],
    pub(super) qpn: u32,
    pub(super) psn: u32,
}

/// The QP itself, destroyed on drop (before its PD and CQ: it holds an
/// `Arc` of each). Every state shares it.
struct Handle {
    raw: NonNull<ibv_qp>,
    peer: usize,
    lane: usize,
    pd: Arc<Pd>,
    _cq: Arc<Cq>,
}

// Nothing posts on a QP being dropped: its owner is gone.
destroy_on_drop!(Handle, ibv_destroy_qp, |q| format!(
    "peer {}, lane {}",
    q.peer, q.lane
));

// SAFETY: as for the other wrappers (see `wrappers.rs`): every verb is
// thread-safe, and the handle moves between threads only with its owner.
unsafe impl Send for Handle {}

/// An RC queue pair to one peer on one lane, in state `S`.
pub(super) struct Qp<S> {
    h: Handle,
    port: u8,
    gid_index: u32,
    /// Our initial send PSN (the peer's receive PSN).
    psn: u32,
    /// Send WRs the provider granted (at most [`SQ_DEPTH`]).
    depth: u64,
    _state: PhantomData<S>,
}

fn zeroed_attr() -> ibv_qp_attr {
    // SAFETY: ibv_qp_attr is plain old data (integers and unions of them).
    unsafe { std::mem::zeroed() }
}

impl<S> Qp<S> {
    pub(super) fn peer(&self) -> usize {
        self.h.peer
    }

    pub(super) fn lane(&self) -> usize {
        self.h.lane
    }

    /// The QP number, for the peer to connect to.
    pub(super) fn qpn(&self) -> u32 {
        // SAFETY: a live QP; qp_num is set at creation and never changes.
        unsafe { (*self.h.raw.as_ptr()).qp_num }
    }

    pub(super) fn psn(&self) -> u32 {
        self.psn
    }

    /// Most send WRs outstanding at once.
    pub(super) fn depth(&self) -> u64 {
        self.depth
    }

    fn device_name(&self) -> &str {
        &self.h.pd.ctx.name
    }

    fn modify(
        &self,
        call: &'static str,
        attr: &mut ibv_qp_attr,
        mask: ibv_qp_attr_mask,
        what: impl FnOnce() -> String,
    ) -> Result<()> {
        // SAFETY: a live QP; `attr` holds every field `mask` names.
        let rc = unsafe { ibv_modify_qp(self.h.raw.as_ptr(), attr, mask.0 as c_int) };
        if rc != 0 {
            return Err(verbs_err(
                call,
                self.device_name(),
                Some(self.peer()),
                Some(self.lane()),
                format!("{} ({})", errno_text(rc), what()),
            ));
        }
        Ok(())
    }

    fn into_state<T>(self) -> Qp<T> {
        Qp {
            h: self.h,
            port: self.port,
            gid_index: self.gid_index,
            psn: self.psn,
            depth: self.depth,
            _state: PhantomData,
        }
    }
}

impl Qp<Init> {
    /// Creates an RC QP on `dev`'s PD and CQ facing `peer` on `lane`, and
    /// moves it RESET → INIT: the port, and remote peers may write into our
    /// MR.
    pub(super) fn create(dev: &Device, peer: usize, lane: usize) -> Result<Self> {
        // SAFETY: ibv_qp_init_attr is plain old data.
        let mut init: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = dev.cq.as_ptr();
        init.recv_cq = dev.cq.as_ptr();
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
        let raw = unsafe { ibv_create_qp(dev.pd.as_ptr(), &mut init) };
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
            h: Handle {
                raw,
                peer,
                lane,
                pd: Arc::clone(&dev.pd),
                _cq: Arc::clone(&dev.cq),
            },
            port: dev.sel.port,
            gid_index: dev.sel.gid_index,
            psn: rand::random::<u32>() & 0x00ff_ffff,
            depth: u64::from(init.cap.max_send_wr.min(SQ_DEPTH)),
            _state: PhantomData,
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
        let mut a = zeroed_attr();
        a.qp_state = ibv_qp_state::IBV_QPS_INIT;
        a.pkey_index = 0;
        a.port_num = qp.port;
        a.qp_access_flags = ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0;
        let mask = ibv_qp_attr_mask::IBV_QP_STATE
            | ibv_qp_attr_mask::IBV_QP_PKEY_INDEX
            | ibv_qp_attr_mask::IBV_QP_PORT
            | ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS;
        qp.modify("ibv_modify_qp(INIT)", &mut a, mask, || {
            format!("port {}", qp.port)
        })?;
        Ok(qp)
    }

    /// INIT → RTR: the remote QP, its GID (RoCE v2 needs a GRH) and the
    /// path MTU.
    pub(super) fn into_rtr(self, remote: &RemoteQp, mtu: ibv_mtu::Type) -> Result<Qp<Rtr>> {
        let mut a = zeroed_attr();
        a.qp_state = ibv_qp_state::IBV_QPS_RTR;
        a.path_mtu = mtu;
        a.dest_qp_num = remote.qpn;
        a.rq_psn = remote.psn;
        a.max_dest_rd_atomic = 1;
        a.min_rnr_timer = 12;
        a.ah_attr.is_global = 1;
        a.ah_attr.grh.dgid = ibv_gid { raw: remote.gid };
        a.ah_attr.grh.sgid_index = self.gid_index as u8;
        a.ah_attr.grh.hop_limit = HOP_LIMIT;
        a.ah_attr.grh.traffic_class = 0;
        a.ah_attr.grh.flow_label = 0;
        a.ah_attr.dlid = 0;
        a.ah_attr.sl = 0;
        a.ah_attr.src_path_bits = 0;
        a.ah_attr.port_num = self.port;
        let mask = ibv_qp_attr_mask::IBV_QP_STATE
            | ibv_qp_attr_mask::IBV_QP_AV
            | ibv_qp_attr_mask::IBV_QP_PATH_MTU
            | ibv_qp_attr_mask::IBV_QP_DEST_QPN
            | ibv_qp_attr_mask::IBV_QP_RQ_PSN
            | ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC
            | ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER;
        self.modify("ibv_modify_qp(RTR)", &mut a, mask, || {
            format!(
                "remote GID {} QPN {:#x}, local GID index {}, MTU {}",
                gid_text(&remote.gid),
                remote.qpn,
                self.gid_index,
                mtu_bytes(mtu)
            )
        })?;
        Ok(self.into_state())
    }
}

impl Qp<Rtr> {
    /// RTR → RTS: our send PSN, the ACK timeout and the retry counts.
    pub(super) fn into_rts(self) -> Result<Qp<Rts>> {
        let mut a = zeroed_attr();
        a.qp_state = ibv_qp_state::IBV_QPS_RTS;
        a.sq_psn = self.psn;
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
        self.modify("ibv_modify_qp(RTS)", &mut a, mask, || {
            format!("sq_psn {:#x}", self.psn)
        })?;
        Ok(self.into_state())
    }
}

impl Qp<Rts> {
    /// Posts the chain of WRs that starts at `wr` (`ibv_post_send`). On
    /// failure, returns the error code and the first WR the provider
    /// refused (those before it were posted).
    ///
    /// # Safety
    ///
    /// `wr` starts a valid chain of `ibv_send_wr` (each `next` the following
    /// WR or null) whose SGEs are valid for the duration of the call (the
    /// provider copies WRs and SGEs, and INLINE data, when posting). The
    /// local memory of a non-INLINE SGE lies in a region registered on this
    /// QP's PD and stays valid until its WR completes.
    pub(super) unsafe fn post_send(
        &self,
        wr: *mut ibv_send_wr,
    ) -> std::result::Result<(), (c_int, *mut ibv_send_wr)> {
        let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
        // SAFETY: a live QP in RTS; the caller vouches for the chain.
        let rc = unsafe { ibv_post_send(self.h.raw.as_ptr(), wr, &mut bad) };
        if rc != 0 {
            return Err((rc, bad));
        }
        Ok(())
    }

    /// Any state → ERR, so that the next send here fails: fault injection
    /// for tests ([`Fabric::inject_fault`](crate::fabric::Fabric::inject_fault)).
    pub(super) fn inject_error(&self) -> Result<()> {
        let mut a = zeroed_attr();
        a.qp_state = ibv_qp_state::IBV_QPS_ERR;
        self.modify(
            "ibv_modify_qp(ERR)",
            &mut a,
            ibv_qp_attr_mask::IBV_QP_STATE,
            || "fault injection".into(),
        )
    }
}
