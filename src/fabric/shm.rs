//! The Shm fabric: every rank of one node maps one POSIX shared-memory
//! segment that holds every rank's region; "sending" is a copy into the
//! peer's receive slot followed by a release store of the flag.
//!
//! Ordering: the data copy happens before the flag's release store in
//! program order, and the receiver reads the flag with an acquire load (the
//! Host device side) or `ld.acquire.sys` (the GPU kernel), so a flag is never
//! visible before its data — the same guarantee RDMA writes on one RC QP give.
//! The send itself is `protocol::post_shm`, which the loom model (`loom/`)
//! checks.
//!
//! # The segment's life
//!
//! Rank 0 creates the segment (mode 0600, a random name that starts with
//! `arx-<rank 0's pid>-`) and reserves its memory at once
//! (`posix_fallocate`): a `/dev/shm` too small for the job (Docker's default
//! is 64 MiB) is an error at start-up naming the size needed, not a SIGBUS
//! at the first call that touches an unbacked page.
//!
//! The name is unlinked as soon as every rank has mapped the segment, so
//! nothing is left in `/dev/shm` however the job ends later. Before that,
//! every way out of [`establish`] on every rank unlinks it too (an error of
//! any rank, a timeout waiting for a rank that died), and the name is
//! agreed before the segment exists, so a rank missing at start-up is found
//! before there is anything to remove. What remains possible: if rank 0 is
//! killed by a signal it cannot handle (SIGKILL, or mpirun's SIGTERM when
//! another rank dies) between creating the segment and every rank's attach
//! — two short collectives among ranks that all just answered — and no
//! other rank reaches its own timeout, the segment stays in `/dev/shm` until
//! removed (`rm /dev/shm/arx-<pid>-*`, pid being rank 0's).
//!
//! Test hook (tests only, not a setting): `ARX_TEST_SHM_FAIL=leave:<r>`
//! makes rank r leave [`establish`] with an error right after the name is
//! agreed, without taking part in what follows, as a rank that dies there
//! would; `ARX_TEST_SHM_FAIL=attach:<r>` makes rank r's attach fail. See
//! `tests/shm.rs`.

use std::ffi::{CStr, CString};
use std::sync::Arc;

use crate::bootstrap::Bootstrap;
use crate::error::{Error, Result};
use crate::fabric::Fabric;
use crate::layout::{Backing, Layout, Placed, Region};
use crate::protocol;

/// One mapping of the node's shared segment.
pub(crate) struct Segment {
    base: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; all cross-process words are
// accessed through `Region`'s atomics.
unsafe impl Send for Segment {}
// SAFETY: as above.
unsafe impl Sync for Segment {}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: we mapped exactly this range.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

/// Removes the segment's name when dropped, whatever the way out.
struct Unlink(CString);

impl Drop for Unlink {
    fn drop(&mut self) {
        // SAFETY: a NUL-terminated name. ENOENT (another rank was first, or
        // rank 0 never created it) is the expected outcome on all but one
        // rank and needs no report.
        unsafe { libc::shm_unlink(self.0.as_ptr()) };
    }
}

fn segment_name() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!(
        "/arx-{}-{:x}-{:08x}",
        std::process::id(),
        nanos,
        rand::random::<u32>()
    )
}

fn cname(name: &str) -> Result<CString> {
    CString::new(name).map_err(|_| Error::InvalidArgument(format!("segment name {name:?}")))
}

/// The test hook's point for this rank (see the module docs).
fn test_hook(rank: usize) -> Option<&'static str> {
    let v = std::env::var("ARX_TEST_SHM_FAIL").ok()?;
    let (point, r) = v.split_once(':')?;
    let point = ["leave", "attach"].into_iter().find(|p| *p == point)?;
    (r.parse::<usize>().ok()? == rank).then_some(point)
}

fn injected(point: &str, rank: usize) -> Error {
    Error::Os {
        call: "ARX_TEST_SHM_FAIL",
        object: format!("rank {rank}"),
        detail: format!("injected failure ({point}; test hook)"),
    }
}

/// `(free, total)` bytes of the file system behind `shm_open`.
fn shm_space() -> Option<(u64, u64)> {
    const DIR: &CStr = c"/dev/shm";
    // SAFETY: `st` is plain old data filled by statvfs.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: a NUL-terminated path and a valid out-parameter.
    if unsafe { libc::statvfs(DIR.as_ptr(), &mut st) } != 0 {
        return None;
    }
    let unit = st.f_frsize as u64;
    Some((st.f_bavail as u64 * unit, st.f_blocks as u64 * unit))
}

fn mib(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)
}

/// The error for a segment `/dev/shm` cannot hold: what is needed, what is
/// free, and the two ways out.
fn no_space(name: &str, layout: &Layout, len: usize, detail: &str) -> Error {
    let world = layout.world();
    let slot = layout.slot_bytes();
    let slots = 2 * (world + 1);
    let fixed = layout.region_bytes() - slots * slot;
    let space = match shm_space() {
        Some((free, total)) => {
            // What would fit now: per rank, the fixed part plus the slots.
            let page = layout.page();
            let fit = (free as usize / world).saturating_sub(fixed) / slots / page * page;
            let want = (total.saturating_sub(free) + len as u64).div_ceil(1 << 20);
            format!(
                "/dev/shm has {free} bytes free ({}) of {total} ({}). Raise it to at least \
                 {want} MiB (docker run --shm-size={want}m ..., or mount -o remount,size={want}m \
                 /dev/shm) or lower ARX_SLOT_BYTES ({})",
                mib(free),
                mib(total),
                if fit > 0 {
                    format!("{fit} fits now")
                } else {
                    "not even one page per slot fits now".into()
                }
            )
        }
        None => "/dev/shm's size is unknown (statvfs failed). Raise it (docker run \
                 --shm-size=..., or mount -o remount,size=... /dev/shm) or lower ARX_SLOT_BYTES"
            .into(),
    };
    Error::Os {
        call: "posix_fallocate",
        object: format!("shared segment {name}"),
        detail: format!(
            "{detail}: the shm fabric needs {len} bytes ({}) of /dev/shm: {world} ranks x \
             {} bytes, each {slots} slots of {slot} bytes (2 x (ranks + 1)) and {fixed} bytes \
             of control and flags. {space}",
            mib(len as u64),
            layout.region_bytes()
        ),
    }
}

/// Reserves `len` bytes for the segment behind `fd` (which also sets its
/// size), so that no page of it can be missing later.
fn reserve(fd: libc::c_int, name: &str, layout: &Layout, len: usize) -> Result<()> {
    // tmpfs gives up a large reservation when a signal arrives (EINTR) and
    // releases what it had: try again, a bounded number of times.
    let mut rc = libc::EINTR;
    for _ in 0..100 {
        // SAFETY: fd is open for writing; posix_fallocate returns the error
        // number instead of setting errno.
        rc = unsafe { libc::posix_fallocate(fd, 0, len as libc::off_t) };
        if rc != libc::EINTR {
            break;
        }
    }
    match rc {
        0 => Ok(()),
        libc::ENOSPC | libc::ENOMEM => Err(no_space(
            name,
            layout,
            len,
            &std::io::Error::from_raw_os_error(rc).to_string(),
        )),
        e => Err(Error::Os {
            call: "posix_fallocate",
            object: format!("shared segment {name} ({len} bytes)"),
            detail: std::io::Error::from_raw_os_error(e).to_string(),
        }),
    }
}

/// Creates (rank 0) or opens the segment `name` and maps it.
fn map(name: &str, layout: &Layout, len: usize, create: bool) -> Result<Segment> {
    let c = cname(name)?;
    let flags = if create {
        libc::O_CREAT | libc::O_EXCL | libc::O_RDWR
    } else {
        libc::O_RDWR
    };
    // SAFETY: plain syscalls on a NUL-terminated name; the fd is closed below.
    let fd = unsafe { libc::shm_open(c.as_ptr(), flags, 0o600) };
    if fd < 0 {
        return Err(Error::last_os("shm_open", name));
    }
    let result = (|| {
        if create {
            reserve(fd, name, layout, len)?;
        } else {
            // SAFETY: `st` is plain old data filled by fstat.
            let mut st: libc::stat = unsafe { std::mem::zeroed() };
            // SAFETY: fd is open; st is a valid out-parameter.
            if unsafe { libc::fstat(fd, &mut st) } != 0 {
                return Err(Error::last_os("fstat", name));
            }
            if st.st_size as usize != len {
                return Err(Error::InvalidArgument(format!(
                    "shared segment {name} has {} bytes, expected {len}",
                    st.st_size
                )));
            }
        }
        // SAFETY: a fresh shared mapping of the whole object.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(Error::last_os("mmap", format!("{name} ({len} bytes)")));
        }
        Ok(Segment {
            base: p.cast(),
            len,
        })
    })();
    // SAFETY: fd is ours; the mapping keeps the object alive.
    unsafe { libc::close(fd) };
    result
}

/// The node's segment and a region view of every rank's part.
pub(crate) struct ShmSetup {
    /// Every rank's region, in rank order (ours at `layout.rank()`).
    pub regions: Vec<Arc<Region>>,
    /// The segment's name (already unlinked).
    pub name: String,
}

/// Creates the segment on rank 0, attaches every rank, then unlinks it.
/// Collective over `boot`; any rank's failure fails every rank, and no way
/// out leaves the name behind (see the module docs for the one exception).
pub(crate) fn establish(boot: &Bootstrap, layout: &Layout) -> Result<ShmSetup> {
    let per_rank = layout.region_bytes();
    let world = layout.world();
    let rank = boot.rank();
    let len = per_rank
        .checked_mul(world)
        .ok_or_else(|| Error::InvalidArgument("shared segment size overflows".into()))?;
    let hook = test_hook(rank);

    // The name first: a rank that is missing or failed at start-up shows
    // here, while there is nothing to remove yet.
    let mine = if rank == 0 {
        segment_name()
    } else {
        String::new()
    };
    let names = boot.all_gather_bytes("shm segment name", mine.as_bytes())?;
    let name = String::from_utf8_lossy(&names[0]).into_owned();
    // From here every rank removes the name on its way out: rank 0 if a
    // peer fails or never answers, the others if rank 0 dies after creating.
    let unlink = Unlink(cname(&name)?);
    if hook == Some("leave") {
        return Err(injected("leave", rank));
    }

    let created = if rank == 0 {
        map(&name, layout, len, true).map(Some)
    } else {
        Ok(None)
    };
    let created = boot.agree("shm segment create", created)?;
    let attached = match created {
        Some(s) => Ok(s),
        None if hook == Some("attach") => Err(injected("attach", rank)),
        None => map(&name, layout, len, false),
    };
    let seg = Arc::new(boot.agree("shm segment attach", attached)?);
    // Every rank has mapped it: the name is no longer needed.
    drop(unlink);

    let regions = (0..world)
        .map(|r| {
            let owner: Box<dyn Send + Sync> = Box::new(Arc::clone(&seg));
            // SAFETY: rank r's part lies inside the mapping and the Arc
            // keeps it mapped.
            let part = unsafe {
                Region::from_raw(
                    seg.base.add(r * per_rank),
                    per_rank,
                    Backing::Borrowed(owner),
                )
            }?;
            // Whole pages (region sizes are multiples of the agreed page):
            // the GPU side registers each part on its own.
            part.check_pages("shm segment part")?;
            Ok(Arc::new(part))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(ShmSetup { regions, name })
}

/// Copies partials and flags into peers' parts of the shared segment.
pub(crate) struct ShmFabric {
    layout: Layout,
    regions: Vec<Arc<Region>>,
    name: String,
}

impl ShmFabric {
    pub(crate) fn new(layout: Layout, setup: &ShmSetup) -> Self {
        ShmFabric {
            layout,
            regions: setup.regions.clone(),
            name: setup.name.clone(),
        }
    }
}

impl Fabric for ShmFabric {
    fn name(&self) -> &'static str {
        "shm"
    }

    fn post(&mut self, seq: u64, bytes: usize, flag: u64) -> Result<()> {
        let layout = &self.layout;
        let me = layout.rank();
        let at = |q: usize| Placed {
            region: &self.regions[q],
            layout,
        };
        // SAFETY: the proxy posts every published call in order, once; our
        // send slot of parity p is stable until every peer has our flag for
        // this seq, and the peer reads recv[p][me] only after that flag
        // (kernels/arx_abi.h, rule 5 of DESIGN.md): nothing else touches
        // either range now.
        unsafe {
            protocol::post_shm(
                &at(me),
                me,
                layout.world(),
                layout.peers().map(|q| (q, at(q))),
                seq,
                bytes,
                flag,
            )
        };
        Ok(())
    }

    fn progress(&mut self) -> Result<bool> {
        Ok(false)
    }

    fn quiescent(&self) -> bool {
        true
    }

    fn probe_rails(
        &mut self,
        _opts: &crate::probe::ProbeOptions,
    ) -> Result<Vec<crate::probe::RailProbe>> {
        Err(crate::error::Error::Unavailable {
            what: "rail probe",
            reason: "no rails: shared memory (every rank on one node)".into(),
        })
    }

    fn describe(&self) -> String {
        format!(
            "shm segment {} (unlinked), {} ranks x {} bytes",
            self.name,
            self.layout.world(),
            self.layout.region_bytes()
        )
    }
}
