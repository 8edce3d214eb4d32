//! The end of every case in the MPI test harnesses (`tests/mpi`,
//! `tests/gpu`): each rank's pass/fail word, summed over all ranks, that
//! every rank enters after every case, failing ranks included.
//!
//! A rank whose case fails leaves the case early; the others may then be
//! waiting in a collective of that case the failing rank never enters (an
//! MPI call such as a digest comparison, an instance's start-up). Before,
//! they waited there until the run's bound (600 s, 240 s on the GPU). Now
//! the verdict goes over a communicator of its own (so it cannot match a
//! collective of the case), as a non-blocking all-reduce on the failing
//! rank: if the others have not joined it within a grace period
//! (`ARX_TEST_FAIL_GRACE_SECS`, default 10 s), they are stuck, and the
//! failing rank aborts the job (`MPI_Abort`): every rank ends at once and
//! the run fails, its error already printed. Ranks that pass wait without a
//! bound of their own (the run's bound applies), as they did before.

use std::time::{Duration, Instant};

use mpi::collective::SystemOperation;
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;

pub struct Verdict {
    comm: SimpleCommunicator,
    grace: Duration,
}

impl Verdict {
    /// Collective over `world` (duplicates it).
    pub fn new(world: &SimpleCommunicator) -> Self {
        let secs = std::env::var("ARX_TEST_FAIL_GRACE_SECS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(10.0f64);
        Verdict {
            comm: world.duplicate(),
            grace: Duration::from_secs_f64(secs.max(0.0)),
        }
    }

    /// The number of ranks whose case `name` failed (`failed`: this
    /// rank's). Does not return on a failing rank whose peers are stuck
    /// (see the module docs).
    pub fn agree(&self, failed: bool, name: &str) -> u32 {
        let mine = u32::from(failed);
        let mut sum = 0u32;
        let start = Instant::now();
        // Non-blocking on every rank: MPI never matches a blocking
        // collective with a non-blocking one (MPI 4.1, 6.12), so a passing
        // rank's blocking all-reduce would leave a failing rank's waiting
        // out the grace period, and aborting, every time.
        mpi::request::scope(|scope| {
            let mut req =
                self.comm
                    .immediate_all_reduce_into(scope, &mine, &mut sum, SystemOperation::sum());
            if !failed {
                req.wait();
                return;
            }
            loop {
                match req.test() {
                    Ok(_) => break,
                    Err(r) => req = r,
                }
                if start.elapsed() > self.grace {
                    eprintln!(
                        "rank {}: case '{name}' failed here and the other ranks did not reach \
                         its end within {:?} (stuck in a collective this rank left): aborting \
                         the run",
                        self.comm.rank(),
                        self.grace
                    );
                    self.comm.abort(1);
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        });
        sum
    }
}
