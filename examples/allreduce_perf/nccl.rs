//! NCCL's `ncclAllReduce` (and, for `-C`, `ncclReduceScatter` /
//! `ncclAllGather`) beside arx on a GPU instance, through cudarc's
//! `nccl` module with dynamic loading: libnccl is opened at run time, never
//! linked, and the arx library itself never names NCCL.
//!
//! cudarc 0.19 opens the first of `libnccl.so`, `libnccl64.so`,
//! `libnccl64_13.so`, … , `libnccl.so.13`, `libnccl.so.12`, `libnccl.so.11`,
//! `libnccl.so.10`, `libnccl.so.9`, `libnccl.so.1` that the dynamic loader
//! finds (`cudarc::get_lib_name_candidates("nccl")`), but NCCL's packages
//! install `libnccl.so.2` (the `nvidia-nccl-cu13` wheel has only
//! `nvidia/nccl/lib/libnccl.so.2`; the `libnccl-dev` package adds the
//! `libnccl.so` link). So point `LD_LIBRARY_PATH` at a directory that holds
//! a `libnccl.so` link to it (`scripts/gpu-perf` makes one).
//!
//! NCCL is skipped, with the reason printed, and the other columns run,
//! when: `--no-nccl`; libnccl cannot be opened on some rank; the ranks'
//! NCCL versions differ; two ranks share a GPU (NCCL refuses a communicator
//! with duplicate GPUs, so several ranks on one GPU under MPS never get an
//! NCCL column); `ncclGetUniqueId` or `ncclCommInitRank` fails on any rank,
//! or the init does not finish within `INIT_TIMEOUT` (it runs on a helper
//! thread; every rank learns every rank's outcome through MPI before any
//! NCCL call is timed). The unique id goes from rank 0 to the others with
//! `MPI_Bcast`.

use std::ffi::{c_void, CStr};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use arx::cudarc::driver::{CudaContext, CudaStream};
use arx::Dtype;
use cudarc::nccl::sys;
use mpi::collective::SystemOperation;
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;

use super::colls::Coll;
use super::gather_text;

/// How long every rank waits for `ncclCommInitRank`.
const INIT_TIMEOUT: Duration = Duration::from_secs(120);

/// NCCL settings printed in the header: always these, then any other
/// `NCCL_*` variable that is set.
const SETTINGS: [&str; 5] = [
    "NCCL_P2P_DISABLE",
    "NCCL_SHM_DISABLE",
    "NCCL_NVLS_ENABLE",
    "NCCL_PROTO",
    "NCCL_ALGO",
];

/// An NCCL communicator; aborted when dropped (local, bounded: no peer
/// needs to take part, whatever state the others are in).
pub(super) struct Comm(sys::ncclComm_t);

// SAFETY: an NCCL communicator may be used from any thread as long as calls
// on it are not concurrent; it is created on the init thread and then used
// only by the main thread.
unsafe impl Send for Comm {}

impl Drop for Comm {
    fn drop(&mut self) {
        // SAFETY: `self.0` came from a successful ncclCommInitRank and is
        // released exactly once, here.
        unsafe {
            sys::ncclCommAbort(self.0);
        }
    }
}

/// A working NCCL communicator over every rank.
pub(super) struct Nccl {
    comm: Comm,
    /// "2.28.3".
    pub version: String,
}

/// What `setup` found.
pub(super) enum Setup {
    On(Nccl),
    /// NCCL was skipped: why (the same text on every rank).
    Off(String),
}

/// The NCCL settings from the environment, as (name, value or "unset").
pub(super) fn settings() -> Vec<(String, String)> {
    let mut v: Vec<(String, String)> = SETTINGS
        .iter()
        .map(|k| {
            (
                k.to_string(),
                std::env::var(k).unwrap_or_else(|_| "unset".into()),
            )
        })
        .collect();
    let mut other: Vec<(String, String)> = std::env::vars()
        .filter(|(k, _)| k.starts_with("NCCL_") && !SETTINGS.contains(&k.as_str()))
        .collect();
    other.sort();
    v.extend(other);
    v
}

fn version_string(code: i32) -> String {
    // NCCL_VERSION_CODE is major*10000 + minor*100 + patch since 2.9.
    format!("{}.{}.{}", code / 10000, code / 100 % 100, code % 100)
}

fn error_text(r: sys::ncclResult_t, comm: Option<sys::ncclComm_t>) -> String {
    // SAFETY: NCCL returns pointers to static (or per-communicator) NUL-
    // terminated strings, read at once.
    unsafe {
        let s = CStr::from_ptr(sys::ncclGetErrorString(r))
            .to_string_lossy()
            .into_owned();
        let last = sys::ncclGetLastError(comm.unwrap_or(std::ptr::null_mut()));
        if last.is_null() {
            return format!("{r:?}: {s}");
        }
        let last = CStr::from_ptr(last).to_string_lossy();
        if last.is_empty() {
            format!("{r:?}: {s}")
        } else {
            format!("{r:?}: {s} ({last})")
        }
    }
}

/// True on every rank if `ok` on every rank; else the first failing rank's
/// `why`. Collective.
fn agree(world: &SimpleCommunicator, ok: bool, why: &str) -> Result<(), String> {
    let mut all = 0u8;
    world.all_reduce_into(&u8::from(ok), &mut all, SystemOperation::min());
    if all == 1 {
        return Ok(());
    }
    let whys = gather_text(world, if ok { "" } else { why });
    let (r, w) = whys
        .iter()
        .enumerate()
        .find(|(_, w)| !w.is_empty())
        .map_or((0, "?"), |(r, w)| (r, w.as_str()));
    Err(format!("rank {r}: {w}"))
}

/// Opens NCCL and creates a communicator over `world` on `ctx`'s device,
/// or says why not. Collective; never fails the run.
pub(super) fn setup(
    world: &SimpleCommunicator,
    ctx: &Arc<CudaContext>,
    host: &str,
    disabled: bool,
) -> Setup {
    if disabled {
        return Setup::Off("--no-nccl".into());
    }
    match try_setup(world, ctx, host) {
        Ok(n) => Setup::On(n),
        Err(why) => Setup::Off(why),
    }
}

fn try_setup(
    world: &SimpleCommunicator,
    ctx: &Arc<CudaContext>,
    host: &str,
) -> Result<Nccl, String> {
    // SAFETY: dlopen of libnccl (its initialisers run; NCCL's do not touch
    // the CUDA state).
    let present = unsafe { sys::is_culib_present() };
    agree(
        world,
        present,
        "libnccl not found: cudarc opens libnccl.so (or libnccl.so.13/.12/.11/.10/.9/.1), not libnccl.so.2; \
         put a directory with a libnccl.so link to NCCL's libnccl.so.2 on LD_LIBRARY_PATH (docs/BENCHMARKS.md)",
    )
    .map_err(|e| format!("libnccl missing: {e}"))?;

    let mut code = 0i32;
    // SAFETY: writes one int.
    let r = unsafe { sys::ncclGetVersion(&mut code) };
    let ok = r == sys::ncclResult_t::ncclSuccess;
    agree(
        world,
        ok,
        &format!("ncclGetVersion: {}", error_text(r, None)),
    )?;
    let mut codes = vec![0i32; world.size() as usize];
    world.all_gather_into(&code, &mut codes[..]);
    if codes.iter().any(|&c| c != codes[0]) {
        return Err(format!(
            "the ranks load different NCCL versions: {:?}",
            codes.iter().map(|&c| version_string(c)).collect::<Vec<_>>()
        ));
    }

    // NCCL refuses duplicate GPUs: say which ranks share one, before NCCL
    // fails on it (or, on some versions, worse).
    // Every rank reaches the gather, whatever its own outcome (an early
    // return on one rank would leave the others in a collective).
    let key = match ctx.uuid() {
        Ok(u) => {
            let b: Vec<u8> = u.bytes.iter().map(|&b| b as u8).collect();
            format!("{host}/{}", hex(&b))
        }
        Err(e) => format!("?cuDeviceGetUuid: {e}"),
    };
    let keys = gather_text(world, &key);
    if let Some((r, k)) = keys.iter().enumerate().find(|(_, k)| k.starts_with('?')) {
        return Err(format!("rank {r}: {}", &k[1..]));
    }
    for (i, a) in keys.iter().enumerate() {
        if let Some(j) = keys[i + 1..].iter().position(|b| b == a) {
            return Err(format!(
                "ranks {i} and {} share GPU {} on {host}: NCCL runs one rank per GPU (it refuses a communicator whose ranks share a GPU)",
                i + 1 + j,
                a.rsplit('/').next().unwrap_or("?")
            ));
        }
    }

    // The unique id: rank 0 makes it, MPI_Bcast carries it (1 status byte,
    // 128 id bytes, then rank 0's error text if it failed).
    let mut buf = [0u8; 1 + 128 + 255];
    if world.rank() == 0 {
        let mut id = sys::ncclUniqueId { internal: [0; 128] };
        // SAFETY: writes one ncclUniqueId.
        let r = unsafe { sys::ncclGetUniqueId(&mut id) };
        if r == sys::ncclResult_t::ncclSuccess {
            buf[0] = 1;
            for (d, &s) in buf[1..129].iter_mut().zip(id.internal.iter()) {
                *d = s as u8;
            }
        } else {
            let e = error_text(r, None);
            let k = e.len().min(255);
            buf[129..129 + k].copy_from_slice(&e.as_bytes()[..k]);
        }
    }
    world.process_at_rank(0).broadcast_into(&mut buf[..]);
    if buf[0] != 1 {
        let end = buf[129..].iter().position(|&x| x == 0).unwrap_or(255);
        return Err(format!(
            "ncclGetUniqueId on rank 0: {}",
            String::from_utf8_lossy(&buf[129..129 + end])
        ));
    }
    let mut id = sys::ncclUniqueId { internal: [0; 128] };
    for (d, &s) in id.internal.iter_mut().zip(buf[1..129].iter()) {
        *d = s as std::ffi::c_char;
    }

    // ncclCommInitRank blocks until every rank joins; on a helper thread
    // with a deadline, so that a rank whose init cannot finish does not
    // hang the benchmark.
    let (n, rank) = (world.size(), world.rank());
    let (tx, rx) = mpsc::channel();
    let c = ctx.clone();
    let spawned = std::thread::Builder::new()
        .name("nccl-init".into())
        .spawn(move || {
            let r = c
                .bind_to_thread()
                .map_err(|e| format!("bind CUDA context: {e}"));
            let r = r.and_then(|()| {
                let mut comm: sys::ncclComm_t = std::ptr::null_mut();
                // SAFETY: writes one communicator handle; the id is the
                // same on every rank.
                let r = unsafe { sys::ncclCommInitRank(&mut comm, n, id, rank) };
                if r == sys::ncclResult_t::ncclSuccess {
                    Ok(Comm(comm))
                } else {
                    Err(format!("ncclCommInitRank: {}", error_text(r, None)))
                }
            });
            // The receiver is gone if this rank gave up waiting: the
            // communicator is then aborted by its drop here.
            let _ = tx.send(r);
        });
    let mine = match spawned {
        Err(e) => Err(format!("spawn the NCCL init thread: {e}")),
        Ok(_) => match rx.recv_timeout(INIT_TIMEOUT) {
            Ok(r) => r,
            Err(mpsc::RecvTimeoutError::Timeout) => Err(format!(
                "ncclCommInitRank did not finish within {} s",
                INIT_TIMEOUT.as_secs()
            )),
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                Err("the NCCL init thread panicked (see stderr)".into())
            }
        },
    };
    let why = mine.as_ref().err().cloned().unwrap_or_default();
    agree(world, mine.is_ok(), &why)?;
    let comm = mine?;
    Ok(Nccl {
        comm,
        version: version_string(code),
    })
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn nccl_type(d: Dtype) -> sys::ncclDataType_t {
    match d {
        Dtype::Bf16 => sys::ncclDataType_t::ncclBfloat16,
        Dtype::F16 => sys::ncclDataType_t::ncclFloat16,
        Dtype::F32 => sys::ncclDataType_t::ncclFloat32,
    }
}

impl Nccl {
    /// NCCL's `coll` (a sum where it reduces) on `s`, with NCCL's `count`
    /// and in-place rules, in elements of `dtype`:
    /// - all-reduce: `send` and `recv` hold `count` (the same address: in
    ///   place);
    /// - reduce-scatter: `send` holds N·`count`, `recv` `count` (in place:
    ///   `recv` is rank·`count` elements into `send`);
    /// - all-gather: `send` holds `count`, `recv` N·`count` (in place:
    ///   `send` is rank·`count` elements into `recv`).
    ///
    /// # Safety
    /// `send` and `recv` are device allocations of at least those lengths
    /// on the communicator's device, alive until `s` has run the call (or,
    /// captured, until the graph's last replay has).
    pub(super) unsafe fn call(
        &self,
        coll: Coll,
        send: u64,
        recv: u64,
        count: usize,
        dtype: Dtype,
        s: &CudaStream,
    ) -> Result<(), String> {
        let (send, recv) = (send as *const c_void, recv as *mut c_void);
        let (ty, sum, comm) = (nccl_type(dtype), sys::ncclRedOp_t::ncclSum, self.comm.0);
        let st = s.cu_stream() as sys::cudaStream_t;
        // SAFETY: the caller's contract; the stream belongs to the
        // communicator's device.
        let (call, r) = unsafe {
            match coll {
                Coll::AllReduce => (
                    "ncclAllReduce",
                    sys::ncclAllReduce(send, recv, count, ty, sum, comm, st),
                ),
                Coll::ReduceScatter => (
                    "ncclReduceScatter",
                    sys::ncclReduceScatter(send, recv, count, ty, sum, comm, st),
                ),
                Coll::AllGather => (
                    "ncclAllGather",
                    sys::ncclAllGather(send, recv, count, ty, comm, st),
                ),
            }
        };
        self.result(call, r)
    }

    fn result(&self, call: &str, r: sys::ncclResult_t) -> Result<(), String> {
        if r == sys::ncclResult_t::ncclSuccess {
            Ok(())
        } else {
            Err(format!("{call}: {}", error_text(r, Some(self.comm.0))))
        }
    }

    /// An asynchronous error NCCL recorded (a failed kernel or proxy).
    pub(super) fn check(&self) -> Result<(), String> {
        let mut e = sys::ncclResult_t::ncclSuccess;
        // SAFETY: writes one result code for a live communicator.
        let r = unsafe { sys::ncclCommGetAsyncError(self.comm.0, &mut e) };
        if r != sys::ncclResult_t::ncclSuccess {
            return Err(format!(
                "ncclCommGetAsyncError: {}",
                error_text(r, Some(self.comm.0))
            ));
        }
        if e != sys::ncclResult_t::ncclSuccess {
            return Err(format!("NCCL: {}", error_text(e, Some(self.comm.0))));
        }
        Ok(())
    }
}
