//! The data path: posting a call's writes, reaping completions into the
//! per-QP ledgers, poisoning peers after a failure, and flushing or kicking
//! unsignalled tails.

use std::ffi::CStr;
use std::time::Instant;

use rdma_sys::*;

use super::ledger::{Ledger, MAX_CHAIN};
use super::qp::{Qp, Rts};
use super::{errno_text, verbs_err, VerbsFabric, KICK_AFTER, POLL_BATCH};
use crate::dtype::POISON_COUNT;
use crate::error::{Error, Result};
use crate::fabric::Fabric;
use crate::layout::flag_word;
use crate::protocol;
use crate::spin::Backoff;
use crate::topology::route::Route;

/// Bits of a WR id that hold the QP's WR count; the link index sits above.
const WR_COUNT_BITS: u32 = 48;
const WR_COUNT_MASK: u64 = (1 << WR_COUNT_BITS) - 1;

/// One connection: the QP to a peer on one rail and lane, with its send
/// accounting.
pub(super) struct Link {
    pub(super) qp: Qp<Rts>,
    /// Index of the lane's device in `VerbsFabric::devices`.
    pub(super) dev: usize,
    /// The rail (of the routes to this peer) the QP belongs to.
    pub(super) rail: usize,
    /// The peer's region as its device on the far end sees it.
    pub(super) remote: RemoteRegion,
    /// The far end's GID.
    pub(super) remote_gid: [u8; 16],
    /// The far end's device name and GID index (for `describe` and the
    /// rail probe).
    pub(super) remote_dev: (String, u32),
    /// The path MTU in bytes (the smaller of the two ports' active MTUs).
    pub(super) path_mtu: u32,
    pub(super) ledger: Ledger,
    /// The last flag written (remote address, word), for a tail flush.
    last_flag: Option<(u64, u64)>,
    /// A completion on this QP failed: it is in the error state.
    broken: bool,
    /// Last time a completion (or a kick) was seen for this QP.
    last_progress: Instant,
}

impl Link {
    /// `qp`, on device `dev` of the fabric, rail `rail`, to a peer whose
    /// region is `remote`, with nothing posted yet.
    pub(super) fn new(
        qp: Qp<Rts>,
        dev: usize,
        rail: usize,
        remote: RemoteRegion,
        remote_gid: [u8; 16],
        remote_dev: (String, u32),
        path_mtu: u32,
    ) -> Self {
        Link {
            ledger: Ledger::new(qp.depth()),
            qp,
            dev,
            rail,
            remote,
            remote_gid,
            remote_dev,
            path_mtu,
            last_flag: None,
            broken: false,
            last_progress: Instant::now(),
        }
    }
}

/// A peer's region as seen from one lane's device.
#[derive(Debug, Clone, Copy)]
pub(super) struct RemoteRegion {
    pub(super) addr: u64,
    pub(super) rkey: u32,
}

/// One WR to be chained: local source (address, length, lkey; INLINE when
/// lkey is None), remote destination.
pub(super) struct Write {
    pub(super) local: u64,
    pub(super) len: u32,
    pub(super) lkey: Option<u32>,
    pub(super) remote: u64,
    pub(super) rkey: u32,
}

impl VerbsFabric {
    /// Posts call `seq` to every directly linked peer (see
    /// [`Fabric::post`]), over rail `seq % rails` of each; peers reached
    /// through a relay get it from their relay.
    pub(super) fn post_all(&mut self, seq: u64, bytes: usize, flag: u64) -> Result<()> {
        let p = (seq & 1) as usize;
        let me = self.layout.rank();
        let src = self.base + self.layout.send_offset(p) as u64;
        let dst_data = self.layout.recv_offset(p, me) as u64;
        let layout = self.layout;
        for q in layout.peers() {
            let nrails = self.rails[q].len();
            if nrails == 0 {
                continue;
            }
            // q overwrites the slot this rank forwards from only after this
            // call reaches it: forwards of its earlier calls must be done.
            self.relay_wait(q, seq)?;
            let rail = self.rails[q][(seq % nrails as u64) as usize];
            let ranges = self.ranges_for(q, flag, bytes);
            for (lane, &i) in rail.iter().enumerate() {
                let rr = self.links[i].remote;
                let flag_remote = rr.addr + self.layout.flag_offset(p, me, lane) as u64;
                let lkey = self.devices[self.links[i].dev].mr.lkey();
                // Each range's part on this lane, at the same offsets in
                // q's recv[p][me], then the flag (RC order: after them).
                let mut writes: Vec<Write> = ranges
                    .iter()
                    .map(|r| protocol::lane_part(r, lane))
                    .filter(|part| !part.is_empty())
                    .map(|part| Write {
                        local: src + part.start as u64,
                        len: part.len() as u32,
                        lkey: Some(lkey),
                        remote: rr.addr + dst_data + part.start as u64,
                        rkey: rr.rkey,
                    })
                    .collect();
                // INLINE: the word is copied when posted; `flag` is a value.
                writes.push(Write {
                    local: &flag as *const u64 as u64,
                    len: 8,
                    lkey: None,
                    remote: flag_remote,
                    rkey: rr.rkey,
                });
                let each = self.signal_each_call;
                self.reserve(i, writes.len() as u64)?;
                // Chains of at most MAX_CHAIN WRs; only the last (with the
                // flag) completes the call on this QP.
                let last = (writes.len() - 1) / MAX_CHAIN;
                for (k, chain) in writes.chunks(MAX_CHAIN).enumerate() {
                    if k == last {
                        self.post_chain(i, chain, each, Some(seq))?;
                    } else {
                        self.post_chain(i, chain, false, None)?;
                    }
                }
                self.links[i].last_flag = Some((flag_remote, flag));
            }
        }
        self.last_seq = seq;
        self.last_post = Instant::now();
        Ok(())
    }

    /// The byte ranges of this rank's partial that go to direct peer `q`
    /// for the call with flag word `flag`: what the call's pattern gives
    /// `q` itself, and what it gives each rank `q` relays this rank's
    /// partials to (which `q` forwards lane by lane, see `relay.rs`).
    /// Sorted, without duplicates or empty ranges, within `bytes`.
    fn ranges_for(&self, q: usize, flag: u64, bytes: usize) -> Vec<std::ops::Range<usize>> {
        let (world, me) = (self.layout.world(), self.layout.rank());
        let relayed = (0..world).filter(
            |&d| matches!(self.plan.routes.get(d), Some(Some(Route::Relay { via })) if *via == q),
        );
        let mut ranges: Vec<_> = std::iter::once(q)
            .chain(relayed)
            .map(|d| protocol::placed_range(flag, world, me, d, bytes, self.layout.slot_bytes()))
            .filter(|r| !r.is_empty())
            .collect();
        ranges.sort_by_key(|r| (r.start, r.end));
        ranges.dedup();
        ranges
    }

    /// Records the first failure and tells every peer still reachable
    /// (poisoned flags for `seq` and `seq + 1`), so they fail at once naming
    /// this rank instead of timing out.
    pub(super) fn fail(&mut self, e: Error, seq: u64) -> Error {
        if self.failed.is_none() {
            self.failed = Some(e.clone());
            // After the departure every call of this rank was delivered,
            // and a peer still calling learns of it from the departure word
            // (the write that failed went to a peer that had closed).
            if !self.departed {
                self.poison(seq, POISON_COUNT);
            }
        }
        e
    }

    pub(super) fn device_name(&self, link: &Link) -> &str {
        &self.devices[link.dev].ctx.name
    }

    /// Room for `n` more WRs on link `i`, polling (bounded) while it is full.
    pub(super) fn reserve(&mut self, i: usize, n: u64) -> Result<()> {
        if self.links[i].ledger.has_room(n) {
            return Ok(());
        }
        let start = Instant::now();
        let mut backoff = Backoff::new(crate::config::SpinMode::Adaptive, 1000);
        loop {
            self.progress()?;
            let link = &self.links[i];
            if link.ledger.has_room(n) {
                return Ok(());
            }
            if start.elapsed() > self.timeout {
                return Err(Error::Timeout {
                    during: "verbs send queue (waiting for completions)",
                    waited: start.elapsed(),
                    detail: format!(
                        "device {}, peer {}, rail {} lane {}: {} WRs outstanding of {}; the peer's NIC does not acknowledge",
                        self.device_name(link),
                        link.qp.peer(),
                        link.rail,
                        link.qp.lane(),
                        link.ledger.outstanding(),
                        link.ledger.depth()
                    ),
                });
            }
            backoff.idle();
        }
    }

    /// Posts `writes` as one chain on link `i` (room must be reserved).
    /// `signal_last` signals the last WR whatever the count; the chain's
    /// last WR completes call `seq` on this QP (None: a chain that completes
    /// no new call, see [`Ledger::commit`]).
    pub(super) fn post_chain(
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
        let link = &mut self.links[i];
        if link.ledger.outstanding() == 0 {
            // The stall clock starts when the QP stops being idle.
            link.last_progress = Instant::now();
        }
        let n = writes.len().min(MAX_CHAIN);
        if n == 0 {
            return Ok(());
        }
        let plan = link.ledger.plan(n, signal_last);
        for (k, w) in writes.iter().take(n).enumerate() {
            let count = link.ledger.posted() + k as u64 + 1;
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
        // SAFETY: the chain and its SGEs live on this stack frame for the
        // duration of the call, the last WR's `next` is null (zeroed); INLINE
        // data is copied at post time; the other SGEs point into our region,
        // registered on the QP's PD (the device's MR, which outlives the QP
        // and keeps the region mapped).
        let posted = unsafe { link.qp.post_send(wrs.as_mut_ptr()) };
        if let Err((rc, bad)) = posted {
            // The WRs before `bad` were posted (they will complete, or be
            // flushed, and must be counted); the provider refused the rest
            // (e.g. the QP is in error): later posts must not use this QP,
            // the poison goes through another.
            let accepted = wrs[..n]
                .iter()
                .position(|w| std::ptr::eq(w, bad))
                .unwrap_or(0);
            link.ledger.commit(accepted, n, plan, seq);
            link.broken = true;
            let (peer, lane) = (link.qp.peer(), link.qp.lane());
            return Err(verbs_err(
                "ibv_post_send",
                &self.devices[link.dev].ctx.name,
                Some(peer),
                Some(lane),
                format!("{} (WR {accepted} of a chain of {n})", errno_text(rc)),
            ));
        }
        link.ledger.commit(n, n, plan, seq);
        if link.ledger.has_tail() {
            self.tail = true;
        }
        Ok(())
    }

    /// Polls every CQ dry and retires the completed WRs in their links'
    /// ledgers, failed and flushed ones included (each is then no longer
    /// outstanding). Returns the first failed completion.
    pub(super) fn reap(&mut self) -> Result<()> {
        // SAFETY: ibv_wc is plain old data.
        let mut wcs: [ibv_wc; POLL_BATCH] = unsafe { std::mem::zeroed() };
        let mut first_err: Option<Error> = None;
        let mut now_cached: Option<Instant> = None;
        for d in 0..self.devices.len() {
            loop {
                let n = match self.devices[d].cq.poll(&mut wcs) {
                    Ok(n) => n,
                    Err(e) => {
                        first_err.get_or_insert(e);
                        break;
                    }
                };
                for wc in &wcs[..n] {
                    let i = (wc.wr_id >> WR_COUNT_BITS) as usize;
                    let Some(link) = self.links.get_mut(i) else {
                        continue;
                    };
                    // Counts below 2^48 per QP: the low bits are the count.
                    link.ledger.complete(wc.wr_id & WR_COUNT_MASK);
                    if wc.status == ibv_wc_status::IBV_WC_SUCCESS {
                        link.last_progress = *now_cached.get_or_insert_with(Instant::now);
                        continue;
                    }
                    link.broken = true;
                    if first_err.is_some() {
                        continue;
                    }
                    // SAFETY: ibv_wc_status_str returns a static string.
                    let status = unsafe { CStr::from_ptr(ibv_wc_status_str(wc.status)) }
                        .to_string_lossy()
                        .into_owned();
                    let (peer, lane, dev) = (link.qp.peer(), link.qp.lane(), link.dev);
                    first_err = Some(super::connect::with_gid_drift(
                        verbs_err(
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
                        ),
                        &self.devices[dev].sel,
                        &self.cfg,
                    ));
                }
                if n < POLL_BATCH {
                    break;
                }
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Writes poisoned flags (count field `count`: [`POISON_COUNT`] when
    /// the fabric failed, [`FAILED_COUNT`](crate::dtype::FAILED_COUNT) for
    /// [`Fabric::tell_failed`](crate::fabric::Fabric::tell_failed)) for
    /// `seq` and `seq + 1` into every peer this rank can still reach
    /// directly, so that peers waiting on it fail at once. (A peer reached
    /// through a relay learns it from the relay, which forwards the poisoned
    /// words like any flag.)
    pub(super) fn poison(&mut self, seq: u64, count: usize) {
        let me = self.layout.rank();
        let layout = self.layout;
        for q in layout.peers() {
            let Some(i) = self.healthy_link(q) else {
                continue;
            };
            let rr = self.links[i].remote;
            let words: Vec<(u64, u64)> = [seq, seq + 1]
                .iter()
                .flat_map(|&s| {
                    let p = (s & 1) as usize;
                    let word = flag_word(s, crate::abi::ARX_DTYPE_INVALID, count);
                    (0..super::LANES)
                        .map(move |l| (p, l, word))
                        .collect::<Vec<_>>()
                })
                .map(|(p, l, word)| (rr.addr + self.layout.flag_offset(p, me, l) as u64, word))
                .collect();
            if !self.links[i].ledger.has_room(words.len() as u64) {
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

    /// A healthy QP to `q`, if this rank links to it directly: any can
    /// write every word of ours there (its device's rkey covers the whole
    /// region).
    fn healthy_link(&self, q: usize) -> Option<usize> {
        self.rails[q]
            .iter()
            .flatten()
            .copied()
            .find(|&i| !self.links[i].broken)
    }

    /// Writes the departure word ([`departed_word`](crate::fabric::departed_word)
    /// of `last`) into every peer this rank links to directly, signalled,
    /// on a healthy QP to it (see
    /// [`Fabric::tell_departed`](crate::fabric::Fabric::tell_departed)).
    /// The QP may not be the one that carried this rank's last flag to the
    /// peer: no order is needed, as the peer compares call numbers only
    /// (the word names the last call, and the drain before it saw every
    /// write through it complete, when it finished).
    pub(super) fn depart(&mut self, last: u64) {
        self.departed = true;
        let me = self.layout.rank();
        let word = crate::fabric::departed_word(last);
        let layout = self.layout;
        for q in layout.peers() {
            let Some(i) = self.healthy_link(q) else {
                continue;
            };
            if !self.links[i].ledger.has_room(1) {
                continue;
            }
            let rr = self.links[i].remote;
            // INLINE: the word is copied when posted; `word` is a value.
            let write = Write {
                local: &word as *const u64 as u64,
                len: 8,
                lkey: None,
                remote: rr.addr + self.layout.departed_offset(me) as u64,
                rkey: rr.rkey,
            };
            if let Err(e) = self.post_chain(i, &[write], true, None) {
                log::warn!("arx verbs: could not tell peer {q} that this rank leaves: {e}");
            }
        }
    }

    /// Re-writes each QP's last flag, signalled, so that an unsignalled tail
    /// completes observably (or, with `stalled`, so that a QP whose WRs have
    /// not completed for [`KICK_AFTER`] is kicked). Idempotent at the peer:
    /// the same word again, ordered after the original on the same QP.
    pub(super) fn flush_tails(&mut self, stalled: bool) -> Result<()> {
        let now = Instant::now();
        if !stalled {
            self.tail = false;
        }
        for i in 0..self.links.len() {
            let link = &mut self.links[i];
            if link.broken || !link.ledger.has_room(1) {
                continue;
            }
            if stalled {
                if link.ledger.outstanding() == 0 || now - link.last_progress < KICK_AFTER {
                    continue;
                }
                log::debug!(
                    "arx verbs: peer {} lane {}: {} WRs outstanding for {:?}; kicking",
                    link.qp.peer(),
                    link.qp.lane(),
                    link.ledger.outstanding(),
                    now - link.last_progress
                );
                link.last_progress = now;
            } else if !link.ledger.has_tail() {
                continue;
            }
            let link = &self.links[i];
            let Some((remote, word)) = link.last_flag else {
                continue;
            };
            let rkey = link.remote.rkey;
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
