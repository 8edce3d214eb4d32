//! MPI bootstrap: a private duplicate of the caller's communicator and a few
//! bounded collectives on it.
//!
//! Every collective here is non-blocking (`MPI_Comm_idup`, `MPI_Iallgather`)
//! and polled against a deadline, so a rank that never arrives makes the
//! others fail with [`Error::Timeout`] instead of hanging. The duplicate uses
//! `MPI_ERRORS_RETURN`, so an MPI failure becomes an [`Error::Mpi`] here
//! rather than an abort of the job.
//!
//! On a timeout the MPI request is abandoned and its buffers are leaked on
//! purpose: MPI may still write into them, and the process is expected to
//! report the error and end.

use std::ffi::c_int;
use std::time::{Duration, Instant};

use mpi::ffi;
use mpi::raw::{AsRaw, FromRaw};
use mpi::topology::{Communicator, SimpleCommunicator};

use crate::error::{Error, Result};
use crate::spin::Backoff;

/// The bootstrap channel of one instance.
pub struct Bootstrap {
    comm: SimpleCommunicator,
    rank: usize,
    world: usize,
    timeout: Duration,
}

fn mpi_error(call: &'static str, code: c_int) -> Error {
    let mut buf = vec![0u8; ffi::MPI_MAX_ERROR_STRING as usize + 1];
    let mut len: c_int = 0;
    // SAFETY: buf holds MPI_MAX_ERROR_STRING bytes as MPI_Error_string requires.
    let rc = unsafe { ffi::MPI_Error_string(code, buf.as_mut_ptr().cast(), &mut len) };
    let detail = if rc == 0 {
        String::from_utf8_lossy(&buf[..len.max(0) as usize]).into_owned()
    } else {
        format!("error code {code}")
    };
    Error::Mpi { call, detail }
}

fn check(call: &'static str, code: c_int) -> Result<()> {
    if code == 0 {
        Ok(())
    } else {
        Err(mpi_error(call, code))
    }
}

/// Polls `req` until it completes or `timeout` passes.
///
/// # Safety
/// `req` must be a request started by the caller whose buffers stay valid
/// until it completes; on `Err(Timeout)` the caller must leak them.
unsafe fn wait(
    req: &mut ffi::MPI_Request,
    what: &'static str,
    timeout: Duration,
    detail: &dyn Fn() -> String,
) -> Result<()> {
    let start = Instant::now();
    let mut backoff = Backoff::new(crate::config::SpinMode::Adaptive, 200);
    loop {
        let mut flag: c_int = 0;
        check(
            "MPI_Test",
            ffi::MPI_Test(req, &mut flag, ffi::RSMPI_STATUS_IGNORE),
        )?;
        if flag != 0 {
            return Ok(());
        }
        if start.elapsed() > timeout {
            return Err(Error::Timeout {
                during: what,
                waited: start.elapsed(),
                detail: detail(),
            });
        }
        backoff.idle();
    }
}

impl Bootstrap {
    /// Duplicates `comm` (bounded by `timeout`) and switches the duplicate to
    /// `MPI_ERRORS_RETURN`.
    pub fn new<C: Communicator>(comm: &C, timeout: Duration) -> Result<Self> {
        let world = comm.size() as usize;
        let rank = comm.rank() as usize;
        // MPI writes the new handle when the request completes, possibly
        // after a timeout made us give up: keep it on the heap, leaked then.
        // SAFETY: reading MPI's constant null handles.
        let dup: *mut ffi::MPI_Comm = Box::into_raw(Box::new(unsafe { ffi::RSMPI_COMM_NULL }));
        // SAFETY: as above.
        let mut req: ffi::MPI_Request = unsafe { ffi::RSMPI_REQUEST_NULL };
        // SAFETY: `dup` outlives the request (freed only after completion).
        let handle = unsafe {
            check(
                "MPI_Comm_idup",
                ffi::MPI_Comm_idup(comm.as_raw(), dup, &mut req),
            )?;
            wait(&mut req, "bootstrap (MPI_Comm_idup)", timeout, &|| {
                format!("rank {rank}: not every one of {world} ranks entered Arx::new")
            })?;
            let handle = *Box::from_raw(dup);
            check(
                "MPI_Comm_set_errhandler",
                ffi::MPI_Comm_set_errhandler(handle, ffi::RSMPI_ERRORS_RETURN),
            )?;
            handle
        };
        // SAFETY: `handle` is a live intra-communicator we own from here on;
        // SimpleCommunicator frees it on drop.
        let comm = unsafe { SimpleCommunicator::from_raw(handle) };
        Ok(Bootstrap {
            comm,
            rank,
            world,
            timeout,
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }
    /// Number of ranks.
    pub fn world(&self) -> usize {
        self.world
    }
    /// The bound on each collective.
    #[allow(dead_code)] // for the Verbs fabric's handshakes
    pub fn timeout(&self) -> Duration {
        self.timeout
    }
    /// The private duplicate communicator.
    #[allow(dead_code)] // for the Verbs fabric's handshakes
    pub fn comm(&self) -> &SimpleCommunicator {
        &self.comm
    }

    /// All-gathers `len` bytes from each rank (every rank passes `len`).
    fn all_gather_fixed(&self, what: &'static str, local: &[u8], len: usize) -> Result<Vec<u8>> {
        let mut send = vec![0u8; len].into_boxed_slice();
        send[..local.len()].copy_from_slice(local);
        let recv = vec![0u8; len * self.world].into_boxed_slice();
        let send = Box::into_raw(send);
        let recv = Box::into_raw(recv);
        // SAFETY: reading MPI's constant null request handle.
        let mut req: ffi::MPI_Request = unsafe { ffi::RSMPI_REQUEST_NULL };
        let rank = self.rank;
        // SAFETY: both buffers are heap allocations that we free only after
        // the request completed, and leak otherwise.
        unsafe {
            let rc = ffi::MPI_Iallgather(
                (*send).as_ptr().cast(),
                len as c_int,
                ffi::RSMPI_UINT8_T,
                (*recv).as_mut_ptr().cast(),
                len as c_int,
                ffi::RSMPI_UINT8_T,
                self.comm.as_raw(),
                &mut req,
            );
            if rc != 0 {
                drop(Box::from_raw(send));
                drop(Box::from_raw(recv));
                return Err(mpi_error("MPI_Iallgather", rc));
            }
            match wait(&mut req, what, self.timeout, &|| {
                format!("rank {rank} arrived; at least one other rank did not (it is stuck, failed, or not calling)")
            }) {
                Ok(()) => {
                    drop(Box::from_raw(send));
                    Ok(Box::from_raw(recv).into_vec())
                }
                // The request may still complete later: leave the buffers to it.
                Err(e) => Err(e),
            }
        }
    }

    /// All-gathers one byte string per rank (lengths may differ).
    pub fn all_gather_bytes(&self, what: &'static str, local: &[u8]) -> Result<Vec<Vec<u8>>> {
        let lens = self.all_gather_fixed(what, &(local.len() as u64).to_le_bytes(), 8)?;
        let lens: Vec<usize> = lens
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8-byte chunk")) as usize)
            .collect();
        let max = lens.iter().copied().max().unwrap_or(0).max(1);
        let all = self.all_gather_fixed(what, local, max)?;
        Ok(all
            .chunks_exact(max)
            .zip(&lens)
            .map(|(c, &l)| c[..l].to_vec())
            .collect())
    }

    /// A bounded barrier.
    pub fn barrier(&self, what: &'static str) -> Result<()> {
        self.all_gather_fixed(what, &[1], 1).map(|_| ())
    }

    /// Makes a local outcome collective: if any rank failed, every rank
    /// returns an error (its own, or [`Error::PeerFailed`] naming the first
    /// failed rank and its message).
    pub fn agree<T>(&self, what: &'static str, local: Result<T>) -> Result<T> {
        let msg = match &local {
            Ok(_) => Vec::new(),
            Err(e) => {
                let mut m = e.to_string().into_bytes();
                m.insert(0, 1);
                m
            }
        };
        let all = self.all_gather_bytes(what, &msg)?;
        if let Err(e) = local {
            return Err(e);
        }
        for (peer, m) in all.iter().enumerate() {
            if let Some((&1, text)) = m.split_first() {
                return Err(Error::PeerFailed {
                    peer,
                    reason: String::from_utf8_lossy(text).into_owned(),
                });
            }
        }
        local
    }
}
