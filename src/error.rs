//! The one error type of arx.
//!
//! Every failing operation has its own variant, and each variant names what a
//! user needs to find the fault: the peer rank, the lane, the device, the MPI
//! or verbs call. Errors are `Clone` because an instance that failed returns
//! its first error again from every later call (a failed collective leaves the
//! ranks out of step, so nothing after it could be trusted).

use std::time::Duration;

/// Result alias used throughout arx.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in arx.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An MPI call failed (`call` names it, e.g. `MPI_Iallgather`).
    #[error("MPI call {call} failed: {detail}")]
    Mpi {
        /// The MPI function.
        call: &'static str,
        /// MPI's error string or code.
        detail: String,
    },

    /// The ranks disagree on something they must share (set up on every rank
    /// the same way). Every rank gets this error, naming the same rank.
    #[error("ranks disagree on {what}: rank {rank} has {theirs}, rank 0 has {ours}")]
    Mismatch {
        /// What differs: a setting's variable (`ARX_DEVICE`, `ARX_FABRIC`,
        /// `ARX_STAGING`, `ARX_ALGO`, `ARX_SLOT_BYTES`, whether set by variable or
        /// builder), or the ABI version, world size, dtype set, node, ...
        what: &'static str,
        /// The first rank whose value differs from rank 0's.
        rank: usize,
        /// Rank 0's value.
        ours: String,
        /// That rank's value.
        theirs: String,
    },

    /// A peer made another call than this rank for the same call number:
    /// another collective, element count, dtype, op or broadcast root, or
    /// a call it refused. Each side is described by what its flag word
    /// announced ([`crate::CallDesc`]).
    #[error("call {seq}: rank {rank} made {ours}, but rank {peer} made {theirs}")]
    CallMismatch {
        /// The protocol's call number (1 for the first of an instance):
        /// each step of a two-shot call and each chunk of a call longer
        /// than the slot counts as one, so it runs ahead of the number of
        /// calls made, and `ours` / `theirs` then describe that step or
        /// chunk (its element count, not the whole call's).
        seq: u64,
        /// This rank.
        rank: usize,
        /// This rank's call.
        ours: crate::dtype::CallDesc,
        /// The peer.
        peer: usize,
        /// The peer's call.
        theirs: crate::dtype::CallDesc,
    },

    /// A bounded wait ran out.
    #[error("timed out after {waited:?} in {during}: {detail}")]
    Timeout {
        /// What was being waited for (`bootstrap all-gather`, `allreduce flags`, ...).
        during: &'static str,
        /// How long it waited.
        waited: Duration,
        /// Which peers and lanes had not arrived, and what they had sent.
        detail: String,
    },

    /// Another rank failed; this rank stops too.
    #[error("rank {peer} failed: {reason}")]
    PeerFailed {
        /// The failed peer.
        peer: usize,
        /// What that rank reported.
        reason: String,
    },

    /// The call's arguments are wrong (length, size, in-place aliasing ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// An `ARX_*` environment variable or builder option has a bad value.
    #[error("bad setting {name}={value}: {reason}")]
    Config {
        /// The variable or option.
        name: &'static str,
        /// Its value.
        value: String,
        /// Why it was rejected.
        reason: String,
    },

    /// Something arx needs is not present (no GPU, no RDMA device, no libcuda).
    #[error("{what} is not available: {reason}")]
    Unavailable {
        /// What is missing.
        what: &'static str,
        /// Why, and what to do about it.
        reason: String,
    },

    /// A system call failed (shared memory, memory mapping, thread start).
    #[error("{call} failed for {object}: {detail}")]
    Os {
        /// The call (`shm_open`, `mmap`, ...).
        call: &'static str,
        /// The object it was called on (segment name, size, ...).
        object: String,
        /// errno's message.
        detail: String,
    },

    /// A verbs call or completion failed.
    #[error("verbs {call} failed on device {device}{}{}: {detail}",
        peer.map(|p| format!(", peer {p}")).unwrap_or_default(),
        lane.map(|l| format!(", lane {l}")).unwrap_or_default())]
    Verbs {
        /// The verbs call (`ibv_reg_mr`, `ibv_modify_qp(RTR)`, completion ...).
        call: &'static str,
        /// The RDMA device name.
        device: String,
        /// The peer rank, if the call concerned one.
        peer: Option<usize>,
        /// The lane, if the call concerned one.
        lane: Option<usize>,
        /// errno or the completion status.
        detail: String,
    },

    /// RDMA device discovery or selection failed.
    #[error("topology: {0}")]
    Topology(String),

    /// A CUDA driver or NVRTC call failed.
    #[error("CUDA {call} failed: {detail}")]
    Cuda {
        /// The driver/NVRTC call.
        call: &'static str,
        /// The CUDA error.
        detail: String,
    },

    /// The arx kernel recorded a failure (timeout, abort, call mismatch).
    #[error("arx kernel failed in call {seq}: {detail}")]
    Kernel {
        /// The call number.
        seq: u64,
        /// What the kernel recorded.
        detail: String,
    },

    /// The proxy thread failed or is gone.
    #[error("proxy thread: {0}")]
    Proxy(String),
}

impl Error {
    /// Builds an [`Error::Os`] from the last OS error.
    pub(crate) fn last_os(call: &'static str, object: impl Into<String>) -> Self {
        Error::Os {
            call,
            object: object.into(),
            detail: std::io::Error::last_os_error().to_string(),
        }
    }
}

impl Error {
    /// A verbs error with `more` appended to its detail (joined by `sep`);
    /// any other error unchanged.
    pub(crate) fn with_verbs_detail(self, sep: &str, more: &str) -> Error {
        match self {
            Error::Verbs {
                call,
                device,
                peer,
                lane,
                detail,
            } => Error::Verbs {
                call,
                device,
                peer,
                lane,
                detail: format!("{detail}{sep}{more}"),
            },
            e => e,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::abi;
    use crate::dtype::CallDesc;
    use crate::protocol::{bcast_flag, count_field, flag_word, flag_word_op};

    fn mismatch(ours: u64, theirs: u64) -> String {
        Error::CallMismatch {
            seq: 3,
            rank: 0,
            ours: CallDesc::of_flag(ours),
            peer: 1,
            theirs: CallDesc::of_flag(theirs),
        }
        .to_string()
    }

    /// Ranks that made different collectives: the text names each rank's
    /// collective with its count, dtype, op (where it reduces) and root
    /// role (a broadcast), not "called allreduce with a broadcast".
    #[test]
    fn a_call_mismatch_names_both_ranks_collectives() {
        let f32c = abi::ARX_DTYPE_F32;
        let whole = flag_word(3, f32c, 32);
        let root = bcast_flag(3, f32c, 32, false, 0, 0);
        assert_eq!(
            mismatch(root, whole),
            "call 3: rank 0 made a broadcast (32 x float) as its root, \
             but rank 1 made an allreduce (sum of 32 x float)"
        );
        let other_root = bcast_flag(3, f32c, 32, false, 1, 0);
        assert_eq!(
            mismatch(other_root, root),
            "call 3: rank 0 made a broadcast (32 x float) with another rank as root, \
             but rank 1 made a broadcast (32 x float) as its root"
        );
        let scatter = flag_word_op(
            3,
            abi::ARX_DTYPE_BF16,
            crate::Op::Max.code(),
            count_field(16, false, abi::ARX_PATTERN_SCATTER),
        );
        let gather = flag_word(
            3,
            abi::ARX_DTYPE_BF16,
            count_field(16, true, abi::ARX_PATTERN_GATHER),
        );
        assert_eq!(
            mismatch(scatter, gather),
            "call 3: rank 0 made a reduce_scatter (max of 16 x bfloat16), but rank 1 \
             made an all_gather (16 x bfloat16) then more (a chunk of a call longer \
             than one slot)"
        );
        // The same steps of a two-shot all-reduce differ from them
        // (ARX_FLAG_ALLREDUCE) and say which they are.
        let two = |f: u64| f | u64::from(abi::ARX_FLAG_ALLREDUCE);
        assert_ne!(two(scatter), scatter);
        assert_eq!(
            mismatch(two(scatter), scatter),
            "call 3: rank 0 made the reduce-scatter step of a two-shot allreduce \
             (max of 16 x bfloat16), but rank 1 made a reduce_scatter (max of 16 x \
             bfloat16)"
        );
        assert_eq!(
            mismatch(gather, two(gather)),
            "call 3: rank 0 made an all_gather (16 x bfloat16) then more (a chunk of \
             a call longer than one slot), but rank 1 made the all-gather step of a \
             two-shot allreduce (16 x bfloat16) then more (a chunk of a call longer \
             than one slot)"
        );
        let refused = flag_word(3, abi::ARX_DTYPE_INVALID, 32);
        assert_eq!(
            mismatch(whole, refused),
            "call 3: rank 0 made an allreduce (sum of 32 x float), but rank 1 made \
             a call it refused (32 elements: bad arguments; see that rank's error)"
        );
    }
}
