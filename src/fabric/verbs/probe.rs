//! The rail probe over the fabric's own queue pairs (see [`crate::probe`]
//! for the schedule and what is measured).
//!
//! Probe words are `digest << 32 | n`: `n` counts the words exchanged with
//! that peer (both ends count alike, [`VerbsFabric::probe_words`]), the
//! digest is the options' ([`ProbeOptions::digest`]), so ranks called with
//! different options fail at the first handshake naming each other.
//!
//! A waiter accepts any word at or past the one it expects: words mostly
//! alternate, but the last word of one queue pair's exchange and the first
//! of the next can come from the same rank back to back (the pinger
//! answers the last bandwidth run, then opens the next handshake), and the
//! second then overwrites the first, possibly before the peer read it.
//! Words to a peer land in the order they are sent: one queue pair's in
//! RC order, and a rank lets every write on a queue pair complete before
//! it moves to the next; so a word never goes back to an older one.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::post::Write;
use super::{VerbsFabric, KICK_AFTER, LANES};
use crate::error::{Error, Result};
use crate::probe::{one_way, Bandwidth, ProbeOptions, RailProbe};
use crate::spin::Backoff;
use crate::topology::route::Route;

/// Spins before a waiting probe starts to yield: round trips on a real NIC
/// take microseconds and must not be inflated by a sleep.
const PROBE_HOT_SPINS: u32 = 1 << 14;

/// The queue pair being probed, for its posts, waits and errors.
#[derive(Clone, Copy)]
struct At {
    /// Index into `links`.
    i: usize,
    peer: usize,
    rail: usize,
    lane: usize,
    digest: u32,
}

impl VerbsFabric {
    /// See [`crate::fabric::Fabric::probe_rails`]. A failure fails the
    /// fabric (its peers are told, as for a failed call): probe writes may
    /// still be in flight, and the ranks are no longer in step.
    pub(super) fn probe(&mut self, opts: &ProbeOptions) -> Result<Vec<RailProbe>> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let big = opts.check(self.layout.slot_bytes())?;
        match self.probe_all(opts, big) {
            Ok(v) => Ok(v),
            Err(e) => {
                let seq = self.last_seq;
                Err(self.fail(e, seq))
            }
        }
    }

    fn probe_all(&mut self, opts: &ProbeOptions, big: usize) -> Result<Vec<RailProbe>> {
        let me = self.layout.rank();
        let world = self.layout.world();
        // A neighbour's partial this rank still has to forward reads its
        // receive slot, which a probe may overwrite: forward it, and let
        // every write of the last call complete, before any handshake. (Its
        // flag is here: this rank's last call needed that partial too.)
        self.probe_drain(None)?;
        let digest = opts.digest(big);
        let mut out = Vec::new();
        for a in 0..world {
            for b in a + 1..world {
                if a != me && b != me {
                    continue;
                }
                let (peer, pinger) = if a == me { (b, true) } else { (a, false) };
                for rail in 0..self.rails[peer].len() {
                    for lane in 0..LANES {
                        let at = At {
                            i: self.rails[peer][rail][lane],
                            peer,
                            rail,
                            lane,
                            digest,
                        };
                        out.push(self.probe_one(at, pinger, opts, big)?);
                    }
                }
            }
        }
        for q in self.layout.peers() {
            if let Some(Route::Relay { via }) = self.plan.routes[q] {
                out.push(RailProbe {
                    peer: q,
                    relayed_by: Some(via),
                    rail: 0,
                    lane: 0,
                    device: String::new(),
                    peer_device: String::new(),
                    path_mtu: 0,
                    gid_index: 0,
                    peer_gid_index: 0,
                    latency: Vec::new(),
                    bandwidth: None,
                });
            }
        }
        self.probe_drain(None)?;
        out.sort_by_key(|p| (p.peer, p.rail, p.lane));
        Ok(out)
    }

    /// Probes one queue pair: handshake, ping-pong per size, bandwidth.
    fn probe_one(
        &mut self,
        at: At,
        pinger: bool,
        opts: &ProbeOptions,
        big: usize,
    ) -> Result<RailProbe> {
        // Handshake: after it both ends are in the probe, so data may land
        // in their receive slots.
        self.ping_pong(at, pinger, 0)?;
        let mut latency = Vec::with_capacity(opts.sizes.len());
        for &bytes in &opts.sizes {
            // Both ends run warmup + iters + 1 rounds; the pinger times its
            // rounds warmup..warmup+iters (ping to answer), the ponger the
            // same number (its answer to the next ping).
            let rounds = opts.warmup + opts.iters + 1;
            let mut rtts = Vec::with_capacity(opts.iters);
            let mut answered: Option<Instant> = None;
            for k in 0..rounds {
                if pinger {
                    let t = Instant::now();
                    self.ping_pong(at, true, bytes)?;
                    if k >= opts.warmup && k < opts.warmup + opts.iters {
                        rtts.push(t.elapsed());
                    }
                } else {
                    self.probe_wait(at)?;
                    if let (Some(t), true) = (answered, k > opts.warmup) {
                        rtts.push(t.elapsed());
                    }
                    answered = Some(Instant::now());
                    self.probe_send(at, bytes, 0, 0)?;
                }
            }
            latency.push(one_way(bytes, rtts));
        }
        let bandwidth = if opts.bw_runs == 0 {
            None
        } else {
            let mut mine = Vec::new();
            // The pinger sends first, then the ponger.
            for sender in [pinger, !pinger] {
                for run in 0..=opts.bw_runs {
                    if sender {
                        let t = Instant::now();
                        self.probe_send(at, 0, big, opts.writes)?;
                        self.probe_wait(at)?;
                        if run > 0 {
                            mine.push(t.elapsed());
                        }
                    } else {
                        self.probe_wait(at)?;
                        self.probe_send(at, 0, 0, 0)?;
                    }
                }
            }
            mine.sort();
            let t = mine[mine.len() / 2].as_secs_f64().max(1e-9);
            Some(Bandwidth {
                write_bytes: big,
                writes: opts.writes,
                gbps: (big * opts.writes) as f64 / t / 1e9,
            })
        };
        // No probe write to this peer may land after the next queue pair's
        // word (a kick re-posts an old word).
        self.probe_drain(Some(at))?;
        let link = &self.links[at.i];
        Ok(RailProbe {
            peer: at.peer,
            relayed_by: None,
            rail: at.rail,
            lane: at.lane,
            device: self.device_name(link).to_string(),
            peer_device: link.remote_dev.0.clone(),
            path_mtu: link.path_mtu,
            gid_index: self.devices[link.dev].sel.gid_index,
            peer_gid_index: link.remote_dev.1,
            latency,
            bandwidth,
        })
    }

    /// One round: the pinger writes `bytes` and its word, then waits for
    /// the answer; the ponger waits, then answers the same way.
    fn ping_pong(&mut self, at: At, pinger: bool, bytes: usize) -> Result<()> {
        if pinger {
            self.probe_send(at, bytes, 0, 0)?;
            self.probe_wait(at)
        } else {
            self.probe_wait(at)?;
            self.probe_send(at, bytes, 0, 0)
        }
    }

    /// Posts `writes` writes of `big` bytes, then `bytes` bytes and the next
    /// probe word in one chain (the word last: RC delivers one QP's writes
    /// in order), from this rank's send slot 0 into the peer's
    /// `recv[0][me]` and probe word.
    fn probe_send(&mut self, at: At, bytes: usize, big: usize, writes: usize) -> Result<()> {
        let me = self.layout.rank();
        let link = &self.links[at.i];
        let rr = link.remote;
        let lkey = self.devices[link.dev].mr.lkey();
        let local = self.base + self.layout.send_offset(0) as u64;
        let remote = rr.addr + self.layout.recv_offset(0, me) as u64;
        let data = |len: usize| Write {
            local,
            len: len as u32,
            lkey: Some(lkey),
            remote,
            rkey: rr.rkey,
        };
        for _ in 0..writes {
            self.probe_room(at, 1)?;
            // Unsignalled unless the ledger signals it (every few WRs and
            // when the queue fills): completions only make room.
            self.post_chain(at.i, &[data(big)], false, None)
                .map_err(|e| self.probe_err(at, e))?;
        }
        self.probe_words[at.peer] += 1;
        let word = (u64::from(at.digest) << 32) | (self.probe_words[at.peer] & 0xffff_ffff);
        let word_at = rr.addr + self.layout.probe_offset(me) as u64;
        // INLINE: the word is copied when posted; `word` is a value.
        let word_wr = Write {
            local: &word as *const u64 as u64,
            len: 8,
            lkey: None,
            remote: word_at,
            rkey: rr.rkey,
        };
        let posted = if bytes == 0 {
            self.probe_room(at, 1)?;
            self.post_chain(at.i, &[word_wr], true, None)
        } else {
            self.probe_room(at, 2)?;
            self.post_chain(at.i, &[data(bytes), word_wr], true, None)
        };
        posted.map_err(|e| self.probe_err(at, e))?;
        self.probe_last = Some((at.i, word_at, word));
        Ok(())
    }

    /// Waits (bounded by the timeout) for the peer's next probe word,
    /// reaping completions and re-posting this rank's last word when its
    /// QP seems stalled (as the data path's kick does).
    fn probe_wait(&mut self, at: At) -> Result<()> {
        self.probe_words[at.peer] += 1;
        let want = self.probe_words[at.peer] & 0xffff_ffff;
        let off = self.layout.probe_offset(at.peer);
        let start = Instant::now();
        let mut kicked = start;
        let mut backoff = Backoff::new(crate::config::SpinMode::Adaptive, PROBE_HOT_SPINS);
        let mut spins = 0u32;
        loop {
            // Acquire: the data written before the word (same QP) has
            // landed; the probe does not read it, but the next call may
            // overwrite it only after.
            let w = self.region.u64_at(off).load(Ordering::Acquire);
            // At or past `want` (mod 2^32; the region starts at 0, before
            // the first word 1).
            let ahead = (w as u32).wrapping_sub(want as u32);
            if w != 0 && ahead < 1 << 31 {
                // An RDMA write of the 8-byte word need not land at once
                // (soft-RoCE copies it in pieces: a digest with its upper
                // half still zero was read once in CI): a digest that
                // differs is judged only once the word has stopped
                // changing for a while.
                let ours = |w: u64| (w >> 32) as u32 == at.digest;
                let w = crate::spin::settle(
                    || self.region.u64_at(off).load(Ordering::Acquire),
                    w,
                    ours,
                    crate::spin::SETTLE,
                );
                if !ours(w) {
                    return Err(Error::PeerFailed {
                        peer: at.peer,
                        reason: format!(
                            "it probes rail {} lane {} with other options than rank {} (digest \
                             {:08x}, here {:08x}): call probe_rails with the same options on \
                             every rank",
                            at.rail,
                            at.lane,
                            self.layout.rank(),
                            w >> 32,
                            at.digest
                        ),
                    });
                }
                return Ok(());
            }
            spins += 1;
            if spins % 64 == 0 {
                self.reap().map_err(|e| self.probe_err(at, e))?;
                let now = Instant::now();
                if now - start > self.timeout {
                    return Err(self.probe_timeout(at, start.elapsed(), "an answer"));
                }
                if now - kicked > KICK_AFTER {
                    kicked = now;
                    self.probe_kick()?;
                }
            }
            backoff.idle();
        }
    }

    /// Re-posts this rank's last probe word (signalled, idempotent: the same
    /// word again, after the original on the same QP) if that QP still has
    /// writes outstanding.
    fn probe_kick(&mut self) -> Result<()> {
        let Some((i, remote, word)) = self.probe_last else {
            return Ok(());
        };
        let link = &self.links[i];
        if link.ledger.outstanding() == 0 || !link.ledger.has_room(1) {
            return Ok(());
        }
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
        )
    }

    /// Room for `n` WRs on the probed QP, reaping (bounded) until there is.
    fn probe_room(&mut self, at: At, n: u64) -> Result<()> {
        let start = Instant::now();
        let mut backoff = Backoff::new(crate::config::SpinMode::Adaptive, PROBE_HOT_SPINS);
        while !self.links[at.i].ledger.has_room(n) {
            self.reap().map_err(|e| self.probe_err(at, e))?;
            if start.elapsed() > self.timeout {
                return Err(self.probe_timeout(at, start.elapsed(), "send-queue room"));
            }
            backoff.idle();
        }
        Ok(())
    }

    /// Waits (bounded) until every write on `at`'s QP has completed (None:
    /// on every QP, running the proxy's progress meanwhile: a forward still
    /// due for a relay is posted, an unsignalled tail of the last call is
    /// flushed, a stalled QP kicked).
    fn probe_drain(&mut self, at: Option<At>) -> Result<()> {
        let start = Instant::now();
        let mut kicked = start;
        let mut backoff = Backoff::new(crate::config::SpinMode::Adaptive, PROBE_HOT_SPINS);
        loop {
            match at {
                None => {
                    crate::fabric::Fabric::progress(self)?;
                    if crate::fabric::Fabric::quiescent(self) {
                        self.probe_last = None;
                        return Ok(());
                    }
                }
                Some(at) => {
                    self.reap().map_err(|e| self.probe_err(at, e))?;
                    if self.links[at.i].ledger.outstanding() == 0 {
                        return Ok(());
                    }
                    if kicked.elapsed() > KICK_AFTER {
                        kicked = Instant::now();
                        self.probe_kick()?;
                    }
                }
            }
            if start.elapsed() > self.timeout {
                return Err(match at {
                    Some(at) => self.probe_timeout(at, start.elapsed(), "its writes to complete"),
                    None => Error::Timeout {
                        during: "rail probe (completing every write posted before it)",
                        waited: start.elapsed(),
                        detail: "writes of this rank are still outstanding; are the peers \
                                 alive and their links up?"
                            .into(),
                    },
                });
            }
            backoff.idle();
        }
    }

    fn where_(&self, at: At) -> String {
        let link = &self.links[at.i];
        format!(
            "rank {} rail {} lane {} ({} -> {})",
            at.peer,
            at.rail,
            at.lane,
            self.device_name(link),
            link.remote_dev.0
        )
    }

    fn probe_timeout(&self, at: At, waited: Duration, what: &str) -> Error {
        Error::Timeout {
            during: "rail probe",
            waited,
            detail: format!(
                "{}: waited for {what}; is rank {} in probe_rails too (it is collective, with \
                 the same options), alive, and its link up?",
                self.where_(at),
                at.peer
            ),
        }
    }

    /// Adds the rail to a verbs error (which names peer, lane and device).
    fn probe_err(&self, at: At, e: Error) -> Error {
        e.with_verbs_detail(" ", &format!("(rail probe, {})", self.where_(at)))
    }
}
