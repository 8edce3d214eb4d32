//! MPI bootstrap: arx's private communicators and a few bounded collectives
//! on them.
//!
//! Every collective here is non-blocking (`MPI_Comm_idup`, `MPI_Iallgather`)
//! and polled against a deadline, so a rank that never arrives makes the
//! others fail with [`Error::Timeout`] instead of hanging. arx's
//! communicators use `MPI_ERRORS_RETURN`, so an MPI failure becomes an
//! [`Error::Mpi`] here rather than an abort of the job. Before any MPI call,
//! [`usable`] checks that MPI is initialised and not yet finalized (calling
//! MPI outside that window makes Open MPI abort the process).
//!
//! ## One collective on the caller's communicator, ever
//!
//! The first `Arx::new` on a communicator duplicates it once
//! (`MPI_Comm_idup`) into arx's *channel* for it, and caches the channel on
//! the communicator (an MPI attribute, which a duplicate of that
//! communicator does not inherit). Every instance on that communicator is
//! then made from the channel: its start-up duplicates the channel into the
//! instance's own communicator and runs every other collective there. So
//! arx posts exactly one collective on a communicator the caller passes,
//! and nothing a start-up does afterwards (a timeout included) can put the
//! caller's own collectives on it out of step.
//!
//! ## A start-up that timed out is resumed, not repeated
//!
//! MPI cannot cancel a posted collective. A start-up that times out in one
//! of its first three steps — the channel's `MPI_Comm_idup`, the instance's
//! `MPI_Comm_idup`, the exchange of settings — leaves that request posted and
//! records it with the channel; the next `Arx::new` on the same communicator
//! on this rank completes that request (bounded again) instead of posting
//! another, and carries on from there. So the k-th collective of every rank
//! on the channel is the k-th of every other rank (they are all idups), and
//! a rank that arrives late meets the others' start-up when they retry.
//! A step after the settings exchange that times out abandons the
//! instance's communicator (its requests and buffers are leaked on purpose:
//! MPI may still write into them); the next `Arx::new` then starts afresh
//! from the channel.

use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use mpi::ffi;
use mpi::raw::{AsRaw, FromRaw};
use mpi::topology::SimpleCommunicator;

use crate::error::{Error, Result};
use crate::spin::Backoff;

/// Refuses an MPI call outside `MPI_Init` … `MPI_Finalize`. `call` names
/// the MPI call that was about to be made.
pub(crate) fn usable(call: &'static str) -> Result<()> {
    if mpi::environment::is_finalized() {
        return Err(Error::Mpi {
            call,
            detail: "MPI is already finalized (MPI_Finalize ran, e.g. the rsmpi Universe \
                     was dropped): arx cannot communicate any more"
                .into(),
        });
    }
    if !mpi::environment::is_initialized() {
        return Err(Error::Mpi {
            call,
            detail: "MPI is not initialised: call mpi::initialize() first".into(),
        });
    }
    Ok(())
}

/// The bootstrap channel of one instance: its own communicator.
pub struct Bootstrap {
    // Freed in Drop only while MPI is still initialised: an instance dropped
    // after MPI_Finalize must not call MPI.
    comm: ManuallyDrop<SimpleCommunicator>,
    rank: usize,
    world: usize,
    timeout: Duration,
    starting: bool,
    /// Not freed in Drop (a forked child's copy: MPI is the parent's).
    abandoned: bool,
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
/// until it completes; on `Err(Timeout)` the caller must keep them (leak or
/// record them with the request).
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
        // SAFETY: `req` is a live request (the caller's contract).
        check("MPI_Test", unsafe {
            ffi::MPI_Test(req, &mut flag, ffi::RSMPI_STATUS_IGNORE)
        })?;
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

// ------------------------------------------------- channels and resumption

/// A posted `MPI_Comm_idup`: the request and the heap cell MPI writes the
/// new handle into when it completes (possibly long after a timeout).
#[derive(Clone, Copy)]
struct PostedDup {
    req: ffi::MPI_Request,
    out: *mut ffi::MPI_Comm,
}

impl PostedDup {
    /// Posts `MPI_Comm_idup(of)`.
    ///
    /// # Safety
    /// `of` must be a live intra-communicator.
    unsafe fn post(of: ffi::MPI_Comm) -> Result<Self> {
        // SAFETY: reading MPI's predefined handles; `of` is live (the
        // caller's contract) and `out` outlives the request (it is freed
        // only once the request completed, and leaked otherwise).
        unsafe {
            let out: *mut ffi::MPI_Comm = Box::into_raw(Box::new(ffi::RSMPI_COMM_NULL));
            let mut req: ffi::MPI_Request = ffi::RSMPI_REQUEST_NULL;
            let rc = ffi::MPI_Comm_idup(of, out, &mut req);
            if rc != 0 {
                drop(Box::from_raw(out));
                return Err(mpi_error("MPI_Comm_idup", rc));
            }
            Ok(PostedDup { req, out })
        }
    }

    /// Waits for the new handle (on timeout the request stays posted and
    /// `self` keeps it for the next try).
    fn wait(
        &mut self,
        what: &'static str,
        timeout: Duration,
        detail: &dyn Fn() -> String,
    ) -> Result<ffi::MPI_Comm> {
        // SAFETY: `out` lives until the request completes: it is freed only
        // below, after completion.
        unsafe {
            wait(&mut self.req, what, timeout, detail)?;
            Ok(*Box::from_raw(self.out))
        }
    }
}

/// The settings exchange on an instance's communicator, posted.
struct PostedExchange {
    comm: ffi::MPI_Comm,
    req: ffi::MPI_Request,
    send: *mut [u8],
    recv: *mut [u8],
    /// What this rank sent (a retry must send the same).
    record: Vec<u8>,
}

/// A start-up step left posted by a timeout, to be resumed.
enum Step {
    /// The instance's `MPI_Comm_idup` of the channel.
    Dup(PostedDup),
    /// The settings exchange on the instance's communicator.
    Exchange(PostedExchange),
}

/// arx's state for one caller communicator.
enum Channel {
    /// The channel's `MPI_Comm_idup`, posted, not yet complete here.
    Posted(PostedDup),
    /// The channel, with any start-up step left posted on it.
    Ready(ffi::MPI_Comm, Option<Step>),
}

/// The channels, by the id cached on each caller communicator.
struct Channels(HashMap<usize, Channel>);
// SAFETY: the map holds MPI handles and heap cells owned by pending
// requests; they are only touched under the mutex, by the thread that calls
// `Arx::new` (MPI's own rules on threads and collectives apply to it).
unsafe impl Send for Channels {}

static CHANNELS: Mutex<Option<Channels>> = Mutex::new(None);
static NEXT_ID: AtomicUsize = AtomicUsize::new(1);
static KEYVAL: Mutex<Option<c_int>> = Mutex::new(None);

/// Duplicating a caller's communicator must not copy arx's channel to it:
/// the duplicate needs its own (its collectives are separate).
unsafe extern "C" fn copy_attr(
    _old: ffi::MPI_Comm,
    _key: c_int,
    _extra: *mut c_void,
    _in: *mut c_void,
    _out: *mut c_void,
    flag: *mut c_int,
) -> c_int {
    // SAFETY: MPI passes a valid flag pointer.
    unsafe { *flag = 0 };
    ffi::MPI_SUCCESS as c_int
}

/// The caller freed its communicator (or MPI is finalizing): forget its
/// channel's record. No MPI call here, nothing freed that a pending request
/// may still write (those cells are raw pointers, leaked).
unsafe extern "C" fn delete_attr(
    _comm: ffi::MPI_Comm,
    _key: c_int,
    val: *mut c_void,
    _extra: *mut c_void,
) -> c_int {
    if let Ok(mut g) = CHANNELS.try_lock() {
        if let Some(c) = g.as_mut() {
            c.0.remove(&(val as usize));
        }
    }
    ffi::MPI_SUCCESS as c_int
}

fn keyval() -> Result<c_int> {
    let mut g = KEYVAL.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(k) = *g {
        return Ok(k);
    }
    let mut k: c_int = 0;
    // SAFETY: both callbacks have the signatures MPI expects and never unwind.
    check("MPI_Comm_create_keyval", unsafe {
        ffi::MPI_Comm_create_keyval(
            Some(copy_attr),
            Some(delete_attr),
            &mut k,
            std::ptr::null_mut(),
        )
    })?;
    *g = Some(k);
    Ok(k)
}

/// The id of `comm`'s channel record, attaching a fresh one if it has none.
fn channel_id(comm: ffi::MPI_Comm) -> Result<usize> {
    let key = keyval()?;
    let mut val: *mut c_void = std::ptr::null_mut();
    let mut flag: c_int = 0;
    // SAFETY: `val` receives the attribute's pointer value.
    check("MPI_Comm_get_attr", unsafe {
        ffi::MPI_Comm_get_attr(comm, key, (&mut val as *mut *mut c_void).cast(), &mut flag)
    })?;
    if flag != 0 {
        return Ok(val as usize);
    }
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    // SAFETY: the value is an integer id, never dereferenced.
    check("MPI_Comm_set_attr", unsafe {
        ffi::MPI_Comm_set_attr(comm, key, id as *mut c_void)
    })?;
    Ok(id)
}

/// Size and rank of a caller's raw handle, refusing `MPI_COMM_NULL` and
/// inter-communicators with an error instead of MPI's fatal handler.
///
/// # Safety
/// `comm` must be `MPI_COMM_NULL` or a live communicator handle.
pub unsafe fn raw_size_rank(comm: ffi::MPI_Comm) -> Result<(usize, usize)> {
    // SAFETY: reading rsmpi's copy of the MPI_COMM_NULL constant.
    if comm == unsafe { ffi::RSMPI_COMM_NULL } {
        return Err(Error::InvalidArgument(
            "the communicator is MPI_COMM_NULL".into(),
        ));
    }
    let mut inter: c_int = 0;
    // SAFETY: `comm` is live (caller's contract); `inter` receives a flag.
    check("MPI_Comm_test_inter", unsafe {
        ffi::MPI_Comm_test_inter(comm, &mut inter)
    })?;
    if inter != 0 {
        return Err(Error::InvalidArgument(
            "the communicator is an inter-communicator; arx needs an intra-communicator".into(),
        ));
    }
    let (mut size, mut rank): (c_int, c_int) = (0, 0);
    // SAFETY: as above; each call writes one integer.
    check("MPI_Comm_size", unsafe {
        ffi::MPI_Comm_size(comm, &mut size)
    })?;
    // SAFETY: as above.
    check("MPI_Comm_rank", unsafe {
        ffi::MPI_Comm_rank(comm, &mut rank)
    })?;
    Ok((size as usize, rank as usize))
}

fn set_errors_return(comm: ffi::MPI_Comm) -> Result<()> {
    // SAFETY: `comm` is a live communicator of ours.
    check("MPI_Comm_set_errhandler", unsafe {
        ffi::MPI_Comm_set_errhandler(comm, ffi::RSMPI_ERRORS_RETURN)
    })
}

impl Bootstrap {
    /// In a forked child: the communicator is not freed at drop.
    pub(crate) fn abandon(&mut self) {
        self.abandoned = true;
    }

    /// Starts an instance over `comm`: its own communicator and every rank's
    /// settings record (`record` is this rank's, of a fixed size), each step
    /// bounded by `timeout`. Resumes a start-up on `comm` that timed out
    /// earlier on this rank (see the module docs).
    ///
    /// # Safety
    /// `comm` must be a live communicator handle (not freed); it may be
    /// `MPI_COMM_NULL` or an inter-communicator, which are refused.
    pub unsafe fn start_raw(
        comm: ffi::MPI_Comm,
        timeout: Duration,
        record: &[u8],
    ) -> Result<(Self, Vec<Vec<u8>>)> {
        usable("MPI_Comm_idup")?;
        // SAFETY: the caller's contract.
        let (world, rank) = unsafe { raw_size_rank(comm)? };
        let id = channel_id(comm)?;
        let taken = CHANNELS
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_mut()
            .and_then(|c| c.0.remove(&id));
        let mut ch = match taken {
            Some(ch) => ch,
            // SAFETY: the caller's communicator is live (it was just used).
            None => Channel::Posted(unsafe { PostedDup::post(comm)? }),
        };
        let r = Self::advance(&mut ch, rank, world, timeout, record);
        CHANNELS
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_or_insert_with(|| Channels(HashMap::new()))
            .0
            .insert(id, ch);
        r
    }

    /// Takes `ch` through the channel's duplicate, the instance's duplicate
    /// and the settings exchange, leaving in `ch` whatever step timed out.
    fn advance(
        ch: &mut Channel,
        rank: usize,
        world: usize,
        timeout: Duration,
        record: &[u8],
    ) -> Result<(Self, Vec<Vec<u8>>)> {
        if let Channel::Posted(p) = ch {
            let chan = p.wait(
                "start-up (MPI_Comm_idup of the caller's communicator)",
                timeout,
                &|| {
                    format!(
                        "rank {rank}: not every one of {world} ranks has entered its first \
                         Arx::new on this communicator; the request stays posted, and the next \
                         Arx::new on this communicator on this rank resumes it"
                    )
                },
            )?;
            *ch = Channel::Ready(chan, None);
            set_errors_return(chan)?;
        }
        let Channel::Ready(chan, step) = ch else {
            return Err(Error::Mpi {
                call: "MPI_Comm_idup",
                detail: "arx's channel is in no known state".into(),
            });
        };
        if step.is_none() {
            // SAFETY: the channel is a live communicator of ours.
            *step = Some(Step::Dup(unsafe { PostedDup::post(*chan)? }));
        }
        if let Some(Step::Dup(p)) = step {
            let own = p.wait(
                "start-up (MPI_Comm_idup of arx's channel)",
                timeout,
                &|| {
                    format!(
                        "rank {rank}: not every one of {world} ranks has entered this Arx::new; \
                         the request stays posted, and the next Arx::new on this communicator \
                         on this rank resumes it"
                    )
                },
            )?;
            *step = None;
            // From here `boot` owns the new communicator: an error frees it.
            let boot = Bootstrap {
                // SAFETY: a live intra-communicator that we own from here on.
                comm: ManuallyDrop::new(unsafe { SimpleCommunicator::from_raw(own) }),
                rank,
                world,
                timeout,
                starting: true,
                abandoned: false,
            };
            set_errors_return(own)?;
            let (req, send, recv) = boot.post_all_gather(record, record.len())?;
            *step = Some(Step::Exchange(PostedExchange {
                comm: boot.into_raw(),
                req,
                send,
                recv,
                record: record.to_vec(),
            }));
        }
        let Some(Step::Exchange(x)) = step else {
            return Err(Error::Mpi {
                call: "MPI_Iallgather",
                detail: "arx's start-up is in no known state".into(),
            });
        };
        if x.record != record {
            // The peers received the settings it sent then; sending others
            // now is impossible, and acting on others would desynchronise.
            *step = None;
            return Err(Error::Config {
                name: "settings of a resumed start-up",
                value: "changed".into(),
                reason: "this Arx::new resumes a start-up on this communicator that timed out \
                         earlier on this rank, and ARX_DEVICE, ARX_FABRIC, ARX_SLOT_BYTES or \
                         ARX_STAGING differ from what that one sent; it is now abandoned (its \
                         peers fail too) and the next Arx::new starts afresh"
                    .into(),
            });
        }
        // SAFETY: the buffers were posted with this request and are freed
        // only after it completed.
        unsafe {
            wait(
                &mut x.req,
                "start-up (exchange of settings)",
                timeout,
                &|| {
                    format!(
                        "rank {rank}: not every one of {world} ranks has sent its settings; the \
                     exchange stays posted, and the next Arx::new on this communicator on this \
                     rank resumes it"
                    )
                },
            )?;
        }
        let x = match step.take() {
            Some(Step::Exchange(x)) => x,
            _ => unreachable_state()?,
        };
        let boot = Bootstrap {
            // SAFETY: the instance's communicator, owned by the exchange
            // until now.
            comm: ManuallyDrop::new(unsafe { SimpleCommunicator::from_raw(x.comm) }),
            rank,
            world,
            timeout,
            starting: true,
            abandoned: false,
        };
        // SAFETY: the request completed; MPI no longer uses the buffers.
        let all = unsafe {
            drop(Box::from_raw(x.send));
            Box::from_raw(x.recv).into_vec()
        };
        let len = x.record.len();
        Ok((boot, all.chunks_exact(len).map(<[u8]>::to_vec).collect()))
    }

    /// Releases the communicator without freeing it.
    fn into_raw(self) -> ffi::MPI_Comm {
        let h = self.comm.as_raw();
        std::mem::forget(self);
        h
    }

    /// Start-up is over: from now on every collective is bounded by the
    /// call timeout `t` ([`crate::Arx::barrier`], the collective close).
    pub fn set_call_timeout(&mut self, t: Duration) {
        self.timeout = t;
        self.starting = false;
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }
    /// Number of ranks.
    pub fn world(&self) -> usize {
        self.world
    }

    /// Posts an all-gather of `len` bytes from each rank (`local` padded).
    /// The buffers belong to the request until it completes.
    fn post_all_gather(
        &self,
        local: &[u8],
        len: usize,
    ) -> Result<(ffi::MPI_Request, *mut [u8], *mut [u8])> {
        usable("MPI_Iallgather")?;
        let mut send = vec![0u8; len].into_boxed_slice();
        send[..local.len()].copy_from_slice(local);
        let recv = vec![0u8; len * self.world].into_boxed_slice();
        let send = Box::into_raw(send);
        let recv = Box::into_raw(recv);
        // SAFETY: reading MPI's predefined null request.
        let mut req: ffi::MPI_Request = unsafe { ffi::RSMPI_REQUEST_NULL };
        // SAFETY: both buffers are heap allocations of the given sizes that
        // the caller frees only after the request completed.
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
        }
        Ok((req, send, recv))
    }

    /// All-gathers `len` bytes from each rank (every rank passes `len`).
    fn all_gather_fixed(&self, what: &'static str, local: &[u8], len: usize) -> Result<Vec<u8>> {
        let (mut req, send, recv) = self.post_all_gather(local, len)?;
        let rank = self.rank;
        let starting = self.starting;
        // SAFETY: the buffers are freed only after the request completed,
        // and leaked otherwise (MPI may still write into them).
        unsafe {
            wait(&mut req, what, self.timeout, &|| {
                format!(
                    "rank {rank} arrived; at least one other rank did not (it is stuck, failed, \
                     or not calling){}",
                    if starting {
                        "; this start-up is abandoned, and the next Arx::new on this \
                         communicator starts a fresh one"
                    } else {
                        ""
                    }
                )
            })?;
            drop(Box::from_raw(send));
            Ok(Box::from_raw(recv).into_vec())
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

fn unreachable_state<T>() -> Result<T> {
    Err(Error::Mpi {
        call: "MPI_Iallgather",
        detail: "arx's start-up is in no known state".into(),
    })
}

impl Drop for Bootstrap {
    fn drop(&mut self) {
        if self.abandoned {
            return;
        }
        if mpi::environment::is_finalized() {
            log::debug!("arx: MPI already finalized; not freeing the duplicate communicator");
            return;
        }
        // SAFETY: dropped exactly once, here.
        unsafe { ManuallyDrop::drop(&mut self.comm) };
    }
}
