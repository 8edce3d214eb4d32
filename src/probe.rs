//! What [`Arx::probe_rails`](crate::Arx::probe_rails) measures: per rail and
//! lane of every directly linked peer, the one-way latency of an RDMA
//! write (as `ib_write_lat` reports it: half the median round trip of a
//! ping-pong) and the bandwidth of back-to-back writes (as `ib_write_bw`),
//! over exactly the queue pair the all-reduce uses there.
//!
//! # How
//!
//! Every rank visits the pairs `(a, b)`, `a < b`, in one global order
//! (lexicographic) and runs those it belongs to; the smallest pair not yet
//! finished always has both ranks free, so the schedule needs no other
//! synchronization and cannot deadlock. Per pair, rail and lane, on that
//! lane's queue pair:
//!
//! 1. a handshake (`a` writes its probe word, `b` answers): from here on
//!    both ranks are inside the probe, so data may land in their slots;
//! 2. per latency size `s`: `warmup` rounds, then `iters` timed rounds of
//!    `a` writing `s` bytes and then an 8-byte word into `b`, `b` waiting
//!    for the word and answering the same way. Each side times its own
//!    round trips (`a` from its ping to the answer, `b` from its answer to
//!    the next ping); one-way latency is half of each;
//! 3. bandwidth, each direction in turn: the sender posts `writes` writes
//!    of `bw_bytes` bytes back to back, then the word; the receiver answers
//!    with a word. One untimed run, then `bw_runs` timed ones; a rank
//!    reports the median of its own sending direction.
//!
//! Data goes from the writer's send slot 0 into the peer's receive slot
//! `recv[0][writer]` (the protocol writes every slot before it reads it),
//! the word into the peer's probe word ([`Layout::probe_offset`], after the
//! flag array: no flag check and no relay reads it). Before its first
//! handshake a rank posts what it still has to forward for a relay and
//! waits until every write it posted has completed; after each queue pair
//! and at the end it waits again, so no probe write is in flight when the
//! probe returns.
//!
//! [`Layout::probe_offset`]: crate::Layout::probe_offset

use std::time::Duration;

use crate::error::{Error, Result};

/// What to measure; the same on every rank (the handshake compares a
/// digest of it and fails naming the peer when it differs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeOptions {
    /// Data bytes of each latency ping (besides the 8-byte word); each at
    /// most the slot size. Default 8 B and 8 KiB.
    pub sizes: Vec<usize>,
    /// Timed round trips per size. Default 1000.
    pub iters: usize,
    /// Untimed round trips before them. Default 100.
    pub warmup: usize,
    /// Bytes of each bandwidth write; at most the slot size (0: the slot
    /// size, at most 1 MiB). Default 0.
    pub bw_bytes: usize,
    /// Writes per bandwidth run. Default 32.
    pub writes: usize,
    /// Timed bandwidth runs per direction (after one untimed). 0 skips the
    /// bandwidth measurement. Default 3.
    pub bw_runs: usize,
}

impl Default for ProbeOptions {
    fn default() -> Self {
        ProbeOptions {
            sizes: vec![8, 8192],
            iters: 1000,
            warmup: 100,
            bw_bytes: 0,
            writes: 32,
            bw_runs: 3,
        }
    }
}

impl ProbeOptions {
    /// Checks the options against a slot of `slot` bytes; returns the
    /// bandwidth write size to use.
    pub(crate) fn check(&self, slot: usize) -> Result<usize> {
        if let Some(s) = self.sizes.iter().find(|&&s| s > slot) {
            return Err(Error::InvalidArgument(format!(
                "probe size {s} bytes exceeds the slot of {slot} bytes"
            )));
        }
        if self.iters == 0 && !self.sizes.is_empty() {
            return Err(Error::InvalidArgument("probe iters 0".into()));
        }
        if self.bw_bytes > slot {
            return Err(Error::InvalidArgument(format!(
                "probe bandwidth write of {} bytes exceeds the slot of {slot} bytes",
                self.bw_bytes
            )));
        }
        if self.bw_runs > 0 && self.writes == 0 {
            return Err(Error::InvalidArgument("probe writes 0".into()));
        }
        let big = if self.bw_bytes == 0 {
            slot.min(1 << 20)
        } else {
            self.bw_bytes
        };
        if self.bw_runs > 0 && u32::try_from(big).is_err() {
            return Err(Error::InvalidArgument(format!(
                "probe bandwidth write of {big} bytes does not fit one work request"
            )));
        }
        Ok(big)
    }

    /// 32 bits that differ, in practice, between different options (FNV-1a
    /// over the fields), carried in every probe word.
    pub(crate) fn digest(&self, big: usize) -> u32 {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        let fields = [
            self.iters,
            self.warmup,
            big,
            self.writes,
            self.bw_runs,
            self.sizes.len(),
        ];
        for v in fields.iter().chain(self.sizes.iter()) {
            for b in (*v as u64).to_le_bytes() {
                h ^= u64::from(b);
                h = h.wrapping_mul(0x0100_0000_01b3);
            }
        }
        (h ^ (h >> 32)) as u32
    }
}

/// One-way latency of one size on one lane.
#[derive(Debug, Clone, PartialEq)]
pub struct Latency {
    /// Data bytes per ping (besides the 8-byte word).
    pub bytes: usize,
    /// Half the median round trip.
    pub median: Duration,
    /// Half the 99th-percentile round trip.
    pub p99: Duration,
    /// Round trips timed.
    pub samples: usize,
}

/// Bandwidth of this rank's writes on one lane.
#[derive(Debug, Clone, PartialEq)]
pub struct Bandwidth {
    /// Bytes per write.
    pub write_bytes: usize,
    /// Writes per run.
    pub writes: usize,
    /// Median over the timed runs of bytes / time (the time runs from the
    /// first post to the receiver's answer), in GB/s (10⁹ bytes a second).
    pub gbps: f64,
}

/// What the probe found for one lane of one rail to one peer, or that the
/// peer is reached through a relay and was not probed.
#[derive(Debug, Clone, PartialEq)]
pub struct RailProbe {
    /// The peer.
    pub peer: usize,
    /// `Some(via)`: no direct link; rank `via` relays, nothing was
    /// measured (every other field is empty or zero).
    pub relayed_by: Option<usize>,
    /// The rail (of the routes to this peer).
    pub rail: usize,
    /// The lane (0 or 1).
    pub lane: usize,
    /// This rank's RDMA device on that lane.
    pub device: String,
    /// The peer's device at the other end.
    pub peer_device: String,
    /// Path MTU in bytes (the smaller of the two ports' active MTUs).
    pub path_mtu: u32,
    /// This rank's GID index on `device`.
    pub gid_index: u32,
    /// The peer's GID index on `peer_device` (arx resolves it per device,
    /// so a difference is no problem).
    pub peer_gid_index: u32,
    /// One entry per [`ProbeOptions::sizes`], in that order.
    pub latency: Vec<Latency>,
    /// This rank's sending direction; None when `bw_runs` is 0.
    pub bandwidth: Option<Bandwidth>,
}

/// Median and 99th percentile (nearest rank) of round trips, halved.
pub(crate) fn one_way(bytes: usize, mut rtts: Vec<Duration>) -> Latency {
    rtts.sort();
    let n = rtts.len();
    let at = |q: f64| -> Duration {
        if n == 0 {
            return Duration::ZERO;
        }
        let k = ((q * n as f64).ceil() as usize).clamp(1, n) - 1;
        rtts[k] / 2
    };
    Latency {
        bytes,
        median: at(0.5),
        p99: at(0.99),
        samples: n,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_way_is_half_the_median_and_p99_round_trip() {
        let us = Duration::from_micros;
        let rtts: Vec<Duration> = (1..=100).rev().map(|k| us(2 * k)).collect();
        let l = one_way(8, rtts);
        assert_eq!(l.median, us(50));
        assert_eq!(l.p99, us(99));
        assert_eq!(l.samples, 100);
        let l = one_way(8, vec![us(10), us(30), us(20)]);
        assert_eq!(l.median, us(10));
        assert_eq!(l.p99, us(15));
    }

    #[test]
    fn options_are_checked_against_the_slot_and_digested() {
        let o = ProbeOptions::default();
        assert_eq!(o.check(4 << 20).unwrap(), 1 << 20);
        assert_eq!(o.check(65536).unwrap(), 65536);
        assert!(o.check(4096).is_err(), "8 KiB pings need an 8 KiB slot");
        let mut p = o.clone();
        p.iters += 1;
        assert_ne!(o.digest(1 << 20), p.digest(1 << 20));
        assert_ne!(o.digest(1 << 20), o.digest(1 << 19));
        let mut p = o.clone();
        p.sizes = vec![8];
        assert_ne!(o.digest(1 << 20), p.digest(1 << 20));
    }
}
