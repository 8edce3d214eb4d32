//! The Shm fabric: every rank of one node maps one POSIX shared-memory
//! segment that holds every rank's region; "sending" is a copy into the
//! peer's receive slot followed by a release store of the flag.
//!
//! Ordering: the data copy happens before the flag's release store in
//! program order, and the receiver reads the flag with an acquire load (the
//! Host device side) or `ld.acquire.sys` (the GPU kernel), so a flag is never
//! visible before its data — the same guarantee RDMA writes on one RC QP give.
//!
//! The segment is created by rank 0 with mode 0600 under a random name, and
//! unlinked as soon as every rank has mapped it, so nothing is left in
//! /dev/shm even if the job is killed later.

use std::ffi::CString;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::bootstrap::Bootstrap;
use crate::error::{Error, Result};
use crate::fabric::Fabric;
use crate::layout::{Backing, Layout, Region};

/// One mapping of the node's shared segment.
pub(crate) struct Segment {
    base: *mut u8,
    len: usize,
    name: String,
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

/// Creates (`create`) or opens the segment and maps it.
fn map(name: &str, len: usize, create: bool) -> Result<Segment> {
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
            // SAFETY: fd is ours.
            if unsafe { libc::ftruncate(fd, len as libc::off_t) } != 0 {
                return Err(Error::last_os(
                    "ftruncate",
                    format!("{name} to {len} bytes (is /dev/shm large enough?)"),
                ));
            }
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
            name: name.to_string(),
        })
    })();
    // SAFETY: fd is ours; the mapping keeps the object alive.
    unsafe { libc::close(fd) };
    if result.is_err() && create {
        // SAFETY: removing the name we just created.
        unsafe { libc::shm_unlink(c.as_ptr()) };
    }
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
/// Collective over `boot`; any rank's failure fails every rank.
pub(crate) fn establish(boot: &Bootstrap, layout: &Layout) -> Result<ShmSetup> {
    let per_rank = layout.region_bytes();
    let world = layout.world();
    let len = per_rank
        .checked_mul(world)
        .ok_or_else(|| Error::InvalidArgument("shared segment size overflows".into()))?;
    let name = segment_name();

    // Rank 0 creates; everyone learns the name (or rank 0's error).
    let created = if boot.rank() == 0 {
        Some(map(&name, len, true))
    } else {
        None
    };
    let announce = match &created {
        Some(Ok(s)) => s.name.clone(),
        _ => String::new(),
    };
    let names = boot.all_gather_bytes("shm segment name", announce.as_bytes())?;
    let created = match created {
        Some(r) => Some(boot.agree("shm segment create", r.map(Some))?),
        None => {
            boot.agree::<Option<Segment>>("shm segment create", Ok(None))?;
            None
        }
    };
    let root_name = String::from_utf8_lossy(&names[0]).into_owned();

    let attached = match created.flatten() {
        Some(s) => Ok(s),
        None => map(&root_name, len, false),
    };
    let agreed = boot.agree("shm segment attach", attached);
    if boot.rank() == 0 {
        // Every rank has mapped it (or failed): the name is no longer needed.
        if let Ok(c) = cname(&root_name) {
            // SAFETY: removing our own segment's name.
            unsafe { libc::shm_unlink(c.as_ptr()) };
        }
    }
    let seg = Arc::new(agreed?);
    let regions = (0..world)
        .map(|r| {
            let owner: Box<dyn Send + Sync> = Box::new(Arc::clone(&seg));
            // SAFETY: rank r's part lies inside the mapping, starts on a page
            // (region sizes are page multiples), and the Arc keeps it mapped.
            unsafe {
                Region::from_raw(
                    seg.base.add(r * per_rank),
                    per_rank,
                    Backing::Borrowed(owner),
                )
            }
            .map(Arc::new)
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(ShmSetup {
        regions,
        name: root_name,
    })
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
        let p = (seq & 1) as usize;
        let me = self.layout.rank();
        let world = self.layout.world();
        let mine = &self.regions[me];
        let src = self.layout.send_offset(p);
        for step in 1..world {
            let q = (me + step) % world;
            let peer = &self.regions[q];
            let dst = self.layout.recv_offset(p, me);
            for lane in 0..2 {
                let r = Layout::lane_range(bytes, lane);
                // SAFETY: our send slot of parity p is stable until every
                // peer has our flag for this seq, and the peer reads
                // recv[p][me] only after that flag (kernels/arx.h, rule 5 of
                // DESIGN.md): nothing else touches either range now.
                unsafe { mine.copy_to(src + r.start, peer, dst + r.start, r.len()) };
                // Release: the copy above is visible before the flag.
                peer.u64_at(self.layout.flag_offset(p, me, lane))
                    .store(flag, Ordering::Release);
            }
        }
        Ok(())
    }

    fn progress(&mut self) -> Result<()> {
        Ok(())
    }

    fn quiescent(&self) -> bool {
        true
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
