//! Fabrics: how a rank's partial and its flags reach every peer.
//!
//! A fabric is driven by the proxy thread only. For call `seq` (parity
//! `p = seq & 1`) it moves, for every peer `q` in the order `r+1, r+2, …`
//! and for each lane, the lane's part ([`Layout::lane_range`]) of this rank's
//! `send[p]` into `q`'s `recv[p][r]`, then the flag word into `q`'s
//! `flags[p][r][lane]`, such that the flag is never visible before its data.

use crate::error::Result;

pub(crate) mod delayed;
pub(crate) mod shm;
pub(crate) mod verbs;

#[allow(unused_imports)]
pub(crate) use crate::layout::Layout;

/// One transport, driven by the proxy thread.
pub(crate) trait Fabric: Send {
    /// Short name for logs and the perf header ("shm", "verbs").
    fn name(&self) -> &'static str;
    /// Sends call `seq`'s partial (`bytes` bytes of `send[seq & 1]`) and the
    /// flag word `flag` to every peer. Must not wait on remote progress
    /// without bound.
    fn post(&mut self, seq: u64, bytes: usize, flag: u64) -> Result<()>;
    /// Reaps completions; an error names the peer, lane and device.
    fn progress(&mut self) -> Result<()>;
    /// True once everything posted has completed locally.
    fn quiescent(&self) -> bool;
    /// One line describing the fabric (devices, GIDs, MTU, segment).
    fn describe(&self) -> String;
    /// Puts the endpoint to `peer` on `lane` into an error state (fault
    /// injection for tests: the next send there fails).
    fn inject_fault(&mut self, peer: usize, lane: usize) -> Result<()> {
        Err(crate::error::Error::Unavailable {
            what: "fault injection",
            reason: format!(
                "the {} fabric has no endpoint to break (peer {peer}, lane {lane})",
                self.name()
            ),
        })
    }
    /// The CPU the topology chose for the proxy thread, if any.
    fn proxy_cpu(&self) -> Option<usize> {
        None
    }
    /// True when tearing down this rank's endpoints could fail a peer's
    /// sends still awaiting acknowledgement (RC queue pairs): the instance
    /// then closes collectively (drain, barrier, destroy).
    fn needs_collective_close(&self) -> bool {
        false
    }
}
