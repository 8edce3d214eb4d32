//! Relaying: forwarding a neighbour's partial to a rank it has no link to
//! (the diagonals of a 4-ring, see [`route`](crate::topology::route)).
//!
//! Rank `x` writes its partial and flags into this rank's `recv[p][x]` and
//! `flags[p][x][lane]` as it does for every direct peer (this rank needs
//! them for its own sum anyway), and with them the bytes the call's pattern
//! gives `y` (for a reduce-scatter step, `y`'s shard besides this rank's;
//! each lane's part of each range before that lane's flag). The proxy
//! watches those flags and, for each lane whose flag shows the next call of
//! `x`, writes that lane's part of what the pattern gives `y` and then the
//! same flag word into `y`'s `recv[p][x]` and `flags[p][x][lane]`, on this
//! rank's QP to `y` (RC order: the flag after the data). To `y` the partial looks as if `x` had written it: every
//! check of the flag word (seq, dtype, count, poison) holds unchanged, and
//! `y` sums in rank order as always, so the bits equal a direct one-shot.
//!
//! # Why the slot is not overwritten while it is forwarded
//!
//! `x` writes call `s + 2` into `recv[p][x]` only after it has finished
//! call `s + 1`, which needs this rank's partial of `s + 1`. This rank posts
//! that partial to `x` only once every forward of `x`'s calls up to `s` has
//! *completed* (the NIC has read the slot and `y` acknowledged):
//! [`VerbsFabric::relay_wait`] holds the post until then, bounded by the
//! call timeout. This rank itself finished call `s` (so `x`'s flag of `s`
//! had arrived and the forward was posted) before it could publish `s + 1`.
//! On `y`'s side, `recv[p][x]` is rewritten (by this rank) for `s + 2` only
//! after `x` finished `s + 1`, which needed `y`'s partial of `s + 1`, sent
//! after `y` had consumed `s`.

use std::collections::VecDeque;
use std::time::Instant;

use super::post::Write;
use super::{VerbsFabric, LANES};
use crate::error::{Error, Result};
use crate::protocol::flag_seq;
use crate::spin::Backoff;

/// One lane of a relay: the next call of the source to forward, and the
/// forwards posted but not yet complete.
#[derive(Debug, Default)]
struct LaneForward {
    /// The next call of the source to forward (from 1).
    next: u64,
    /// `(link, WR count of its flag, call)`, in posting order.
    pending: VecDeque<(usize, u64, u64)>,
}

/// What this rank forwards from `from` to `to`.
#[derive(Debug)]
pub(super) struct Relay {
    pub(super) from: usize,
    pub(super) to: usize,
    lanes: [LaneForward; LANES],
}

impl Relay {
    pub(super) fn new(from: usize, to: usize) -> Self {
        Relay {
            from,
            to,
            lanes: [0; LANES].map(|_| LaneForward {
                next: 1,
                pending: VecDeque::new(),
            }),
        }
    }

    /// Every forward of `from`'s calls up to `seq` has completed.
    fn done_through(&self, seq: u64) -> bool {
        self.lanes
            .iter()
            .all(|l| l.next > seq && l.pending.front().map_or(true, |&(_, _, s)| s > seq))
    }
}

impl VerbsFabric {
    /// Forwards every partial that has arrived and retires the completed
    /// forwards. Returns whether it posted anything.
    pub(super) fn forward(&mut self) -> Result<bool> {
        let mut posted = false;
        for k in 0..self.relays.len() {
            let (from, to) = (self.relays[k].from, self.relays[k].to);
            for lane in 0..LANES {
                // Retire: a forward is complete once its flag's WR is.
                while let Some(&(i, count, _)) = self.relays[k].lanes[lane].pending.front() {
                    if self.links[i].ledger.completed() < count {
                        break;
                    }
                    self.relays[k].lanes[lane].pending.pop_front();
                }
                loop {
                    let next = self.relays[k].lanes[lane].next;
                    let p = (next & 1) as usize;
                    let off = self.layout.flag_offset(p, from, lane);
                    // Acquire: the data of the call was written before its
                    // flag (RC order, no relaxed ordering); the NIC reads it
                    // after the post below.
                    let word = self
                        .region
                        .u64_at(off)
                        .load(std::sync::atomic::Ordering::Acquire);
                    // The seq is the word's upper half: an RDMA write that
                    // lands in pieces lands in address order (soft-RoCE's
                    // copy) or whole (a NIC's aligned 8 bytes), so a word
                    // showing the next seq is whole; were it not, the
                    // forward would carry a word the receiver refuses
                    // (an error naming this peer, never a wrong sum).
                    if u64::from(flag_seq(word)) != next & 0xffff_ffff || word == 0 {
                        break;
                    }
                    self.forward_one(k, lane, next, word)?;
                    self.relays[k].lanes[lane].next = next + 1;
                    posted = true;
                }
            }
            let _ = to;
        }
        Ok(posted)
    }

    /// Posts the forward of lane `lane` of `from`'s call `seq` (flag `word`).
    fn forward_one(&mut self, k: usize, lane: usize, seq: u64, word: u64) -> Result<()> {
        let (from, to) = (self.relays[k].from, self.relays[k].to);
        let nrails = self.rails[to].len();
        if nrails == 0 {
            return Err(Error::Proxy(format!(
                "relay of rank {from} to rank {to}: no link to rank {to}"
            )));
        }
        let i = self.rails[to][(seq % nrails as u64) as usize][lane];
        let p = (seq & 1) as usize;
        // What the call's pattern gives `to` of `from`'s partial (a
        // poisoned or refused call carries no data: the flag alone); `from`
        // sent this lane's part of it to this rank before the flag.
        let slot = self.layout.slot_bytes();
        let range = crate::protocol::placed_range(word, self.layout.world(), from, to, slot, slot);
        let part = crate::protocol::lane_part(&range, lane);
        let rr = self.links[i].remote;
        let recv = self.layout.recv_offset(p, from) as u64;
        let lkey = self.devices[self.links[i].dev].mr.lkey();
        let flag_wr = Write {
            local: &word as *const u64 as u64,
            len: 8,
            lkey: None,
            remote: rr.addr + self.layout.flag_offset(p, from, lane) as u64,
            rkey: rr.rkey,
        };
        if part.is_empty() {
            self.reserve(i, 1)?;
            self.post_chain(i, &[flag_wr], true, None)?;
        } else {
            let data = Write {
                local: self.base + recv + part.start as u64,
                len: part.len() as u32,
                lkey: Some(lkey),
                remote: rr.addr + recv + part.start as u64,
                rkey: rr.rkey,
            };
            self.reserve(i, 2)?;
            self.post_chain(i, &[data, flag_wr], true, None)?;
        }
        let count = self.links[i].ledger.posted();
        self.relays[k].lanes[lane]
            .pending
            .push_back((i, count, seq));
        Ok(())
    }

    /// Before this rank's call `seq` goes to `q`: waits (bounded by the
    /// timeout) until every forward of `q`'s calls before `seq` completed.
    pub(super) fn relay_wait(&mut self, q: usize, seq: u64) -> Result<()> {
        if !self.relays.iter().any(|r| r.from == q) {
            return Ok(());
        }
        let ready = |f: &VerbsFabric| {
            f.relays
                .iter()
                .filter(|r| r.from == q)
                .all(|r| r.done_through(seq.saturating_sub(1)))
        };
        let start = Instant::now();
        let mut backoff = Backoff::new(crate::config::SpinMode::Adaptive, 1000);
        loop {
            self.reap()?;
            self.forward()?;
            if ready(self) {
                return Ok(());
            }
            if start.elapsed() > self.timeout {
                let r = self.relays.iter().find(|r| r.from == q).map_or(0, |r| r.to);
                return Err(Error::Timeout {
                    during: "verbs relay (forwarding a neighbour's partial)",
                    waited: start.elapsed(),
                    detail: format!(
                        "rank {q}'s calls before {seq} were not all forwarded to rank {r} and \
                         acknowledged; is rank {r} alive and its link up?"
                    ),
                });
            }
            backoff.idle();
        }
    }
}
