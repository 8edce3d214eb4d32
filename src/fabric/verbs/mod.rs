//! The Verbs fabric: RDMA writes over RC queue pairs, on the devices each
//! peer's route names.
//!
//! Routes ([`route`](crate::topology::route)): every rank all-gathers its
//! addressed devices (name, PCIe root, function, IPv4 address and prefix)
//! and plans, identically on every rank, how each peer is reached: directly,
//! over one or two *rails* of two lanes each (lane 0 and lane 1 on two PCIe
//! roots of the port cabled to that peer; two cables to one peer give two
//! rails), or through a *relay* (a common neighbour forwards the partials:
//! the diagonals of a 4-ring, see `relay.rs`). Only the devices some route
//! uses are opened.
//!
//! Per device: a context, a protection domain, the region registered once
//! (`LOCAL_WRITE | REMOTE_WRITE`, never relaxed ordering: the flag must not
//! overtake its data on PCIe), and one completion queue. Per (peer, rail,
//! lane): an RC queue pair on that lane's device. Every rank all-gathers its
//! endpoints (per device GID, MTU, rkey; per peer, rail and lane the device,
//! QPN and PSN) over MPI in a small versioned record, then moves its QPs
//! INIT → RTR → RTS; the closing `Bootstrap::agree` is also the barrier that
//! guarantees every peer's QPs are ready to receive before anyone writes.
//!
//! Per call `seq`, for every directly linked peer `r+1, r+2, …`, on rail
//! `seq % rails` and for each lane, one `ibv_post_send` carries two chained
//! WRs on that lane's QP: the lane's part of `send[p]` into the peer's
//! `recv[p][r]` (omitted when the part is empty), then the 8-byte flag word,
//! INLINE (copied at post time; it is a value on our stack), into the peer's
//! `flags[p][r][lane]`. RC delivers the writes of one QP in order, so the
//! flag never lands before its data. Successive calls may take different
//! rails (different QPs): each parity has its own slots and flags, and call
//! `seq + 2` reuses the rail of `seq`, so every slot is rewritten on the QP
//! that wrote it last.
//!
//! Selective signalling, counted per QP ([`Ledger`](ledger::Ledger)): a WR
//! is signalled every [`SIGNAL_EVERY`] WRs and when it makes the send queue
//! full; a signalled completion retires every earlier WR of its QP. A post that
//! would overfill the queue polls until there is room, bounded by the
//! timeout. Each QP's ledger records which call every outstanding WR
//! completes, and [`Fabric::completed_through`] is the last call every QP
//! has completed: the proxy publishes it as `ctrl.sent` (the send slot of
//! that call may be overwritten; a QP with nothing outstanding holds no call
//! back). Copy-engine staging waits for `sent` on
//! every call, so with `ARX_STAGING=copy` the last WR of every call is
//! signalled on every QP, and `sent` follows each call within an
//! acknowledgement's time. Otherwise an unsignalled tail left by an idle
//! proxy is flushed after [`FLUSH_AFTER`] by re-writing the last flag word
//! signalled (idempotent), so that [`Fabric::quiescent`] becomes true and
//! shutdown can drain.
//!
//! Every completion queue holds a completion for every WR that can be
//! outstanding on the QPs that share it ([`cq_depth`](ledger::cq_depth)): a
//! QP in error flushes each of its WRs with a completion, signalled or not,
//! and an overflowing CQ would lose them. Flushed WRs count as completed,
//! so after a failure the fabric becomes quiescent once the broken QPs are
//! flushed and the healthy ones have delivered (the proxy then releases
//! `sent`).
//!
//! On a failed post or completion this rank records the error (the proxy
//! raises the abort word) and, to spare its peers the full timeout, writes
//! "poisoned" flag words (dtype INVALID,
//! [`POISON_COUNT`](crate::dtype::POISON_COUNT)) for its last call and the
//! next into every peer it can still reach through a healthy QP: a
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
//! `Arc` of its parents, so children are destroyed before their parents
//! whatever the drop order, and the region stays mapped until it is
//! deregistered.
//!
//! Files, by concern (as NCCL's `net_ib/`); every tuning constant is here:
//!
//! * `wrappers.rs`: RAII wrappers (device list, context, PD, MR, CQ) and
//!   `Device`, one device's objects;
//! * `qp.rs`: RC queue pairs, their INIT → RTR → RTS transitions in the type;
//! * `endpoint.rs`: the endpoint record ranks exchange to connect;
//! * `connect.rs`: [`connect()`]: route planning, devices, QPs, exchange,
//!   transitions; a QP that cannot connect, or fails later, says whether its
//!   device's GID moved since start-up (`topology::gid_drift`);
//! * `ledger.rs`: per-QP send accounting (signalling, per-call completion)
//!   and CQ sizing, testable without a device;
//! * `post.rs`: posting, reaping, poisoning, tail flush and kick;
//! * `relay.rs`: forwarding a neighbour's partial to a rank it has no link
//!   to, and why the slot it reads is not overwritten meanwhile.
//!
//! All `unsafe` of the fabric lives in `wrappers.rs`, `qp.rs` and `post.rs`.
//!
//! [`Selection`]: crate::topology::Selection

mod connect;
mod endpoint;
mod ledger;
mod post;
mod probe;
mod qp;
mod relay;
mod wrappers;

pub(crate) use connect::connect;

use std::ffi::c_int;
use std::time::{Duration, Instant};

use rdma_sys::ibv_mtu;

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::fabric::Fabric;
use crate::layout::{Layout, Region};
use crate::topology::route::{Plan, Route};
use post::Link;
use wrappers::Device;

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

/// RC QPs to every directly linked peer, per rail and lane; forwarding
/// for the peers this rank relays between.
pub(crate) struct VerbsFabric {
    // Field order is drop order: QPs, then the devices (CQ, MR, PD,
    // context), then the region; the Arcs inside make this right regardless.
    links: Vec<Link>,
    devices: Vec<Device>,
    /// `rails[q][rail][lane]`: index into `links` (empty for this rank and
    /// for peers reached through a relay).
    rails: Vec<Vec<[usize; LANES]>>,
    /// The partials this rank forwards (a 4-ring's diagonals).
    relays: Vec<relay::Relay>,
    /// Per peer, the last probe word written to or read from it (both
    /// ends count the same; see [`crate::probe`]).
    probe_words: Vec<u64>,
    /// The last probe word posted (link, remote address, word), for a kick.
    probe_last: Option<(usize, u64, u64)>,
    /// The routes, for `describe` and errors.
    plan: Plan,
    layout: Layout,
    base: u64,
    timeout: Duration,
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
    /// This rank told its peers it leaves ([`VerbsFabric::depart`]): a
    /// failure now (a departure write to a peer that already destroyed its
    /// queue pairs) poisons no one.
    departed: bool,
    /// `progress` calls since the last stall check.
    polls: u32,
    /// The settings (the GID choice, re-run when a QP fails).
    cfg: crate::config::Config,
    /// The region (flags read by the relay; kept mapped while registered).
    region: Arc<Region>,
    /// The proxy's CPU, claimed while this fabric lives so that the
    /// process's next instance pins its proxy elsewhere
    /// ([`crate::topology::LocalRank::claimed_cpus`]).
    _claim: crate::topology::CpuClaim,
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

    fn tell_failed(&mut self, seq: u64) {
        // A failed fabric has told its peers already (`fail`).
        if self.failed.is_none() {
            self.poison(seq, crate::dtype::FAILED_COUNT);
        }
    }

    fn tell_departed(&mut self, last: u64) {
        if self.failed.is_none() {
            self.depart(last);
        }
    }

    fn inject_fault(&mut self, peer: usize, lane: usize) -> Result<()> {
        let i = *self
            .rails
            .get(peer)
            .and_then(|r| r.first())
            .and_then(|r| r.get(lane))
            .ok_or_else(|| {
                Error::InvalidArgument(format!("no QP to peer {peer} lane {lane} (rail 0)"))
            })?;
        self.links[i].qp.inject_error()
    }

    fn progress(&mut self) -> Result<bool> {
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
        let mut forwarded = false;
        if !self.relays.is_empty() {
            match self.forward() {
                Ok(f) => forwarded = f,
                Err(e) => {
                    let seq = self.last_seq;
                    return Err(self.fail(e, seq));
                }
            }
        }
        if self.tail && self.last_post.elapsed() > FLUSH_AFTER {
            self.flush_tails(false)?;
        }
        self.polls += 1;
        if self.polls >= KICK_CHECK_EVERY {
            self.polls = 0;
            self.flush_tails(true)?;
        }
        Ok(forwarded)
    }

    fn needs_collective_close(&self) -> bool {
        true
    }

    fn probe_rails(
        &mut self,
        opts: &crate::probe::ProbeOptions,
    ) -> Result<Vec<crate::probe::RailProbe>> {
        self.probe(opts)
    }

    fn quiescent(&self) -> bool {
        self.links.iter().all(|l| l.ledger.outstanding() == 0)
    }

    fn completed_through(&self, _posted: u64) -> u64 {
        // A call goes to one rail of every directly linked peer. A QP with
        // nothing outstanding has completed every call it carried; one with
        // WRs outstanding has completed calls up to its `done_seq`. Calls
        // that did not use a QP do not wait for it.
        self.links
            .iter()
            .filter(|l| l.ledger.outstanding() > 0)
            .map(|l| l.ledger.done_seq())
            .min()
            .unwrap_or(self.last_seq)
            .min(self.last_seq)
    }

    fn describe(&self) -> String {
        let me = self.layout.rank();
        let mut out = vec![format!(
            "{} device(s), {} RC QPs, send queue {SQ_DEPTH}, signal every {SIGNAL_EVERY}{}",
            self.devices.len(),
            self.links.len(),
            if self.signal_each_call {
                " and each call's last"
            } else {
                ""
            }
        )];
        for q in self.layout.peers() {
            match &self.plan.routes[q] {
                Some(Route::Relay { via }) => out.push(format!(
                    "route to rank {q}: relayed by rank {via} (no direct link)"
                )),
                Some(Route::Direct { how, .. }) => {
                    for (r, ix) in self.rails[q].iter().enumerate() {
                        let lanes: Vec<String> = ix
                            .iter()
                            .enumerate()
                            .map(|(l, &i)| {
                                let link = &self.links[i];
                                let d = &self.devices[link.dev];
                                format!(
                                    "lane {l} {} port {} {} {} GID[{}] {} -> {} {} GID[{}] MTU {}",
                                    d.ctx.name,
                                    d.sel.port,
                                    d.sel.netdev,
                                    match (d.sel.ipv4, d.sel.prefix) {
                                        (Some(a), Some(p)) =>
                                            format!("{}/{p}", crate::topology::network(a, p)),
                                        _ => "subnet ?".into(),
                                    },
                                    d.sel.gid_index,
                                    gid_text(&d.gid),
                                    link.remote_dev.0,
                                    gid_text(&link.remote_gid),
                                    link.remote_dev.1,
                                    link.path_mtu
                                )
                            })
                            .collect();
                        out.push(format!(
                            "route to rank {q} rail {r} ({how}): {}",
                            lanes.join("; ")
                        ));
                    }
                }
                None => {}
            }
        }
        for r in &self.relays {
            out.push(format!(
                "forwards rank {}'s partials to rank {} (relay of {me})",
                r.from, r.to
            ));
        }
        out.join("\n  ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mtu_codes() {
        assert_eq!(mtu_bytes(ibv_mtu::IBV_MTU_1024), 1024);
        assert_eq!(mtu_bytes(ibv_mtu::IBV_MTU_4096), 4096);
        assert_eq!(mtu_bytes(0), 0);
    }
}
