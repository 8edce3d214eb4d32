//! The region's memory and the small amount of `unsafe` needed to touch it:
//! bounds-checked atomics for the words that cross threads or devices, and
//! raw copies for the data sections.

use std::ops::Range;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64};

use super::Layout;
use crate::abi;
use crate::error::{Error, Result};
use crate::protocol::{Control, Memory, Word, Word32};

/// Who releases a region's memory.
pub(crate) enum Backing {
    /// Anonymous `mmap` (Host device side over Verbs).
    Mmap,
    /// Part of a shared segment that something else unmaps.
    Borrowed(#[allow(dead_code)] Box<dyn Send + Sync>),
    /// Memory released by a closure (CUDA host allocations).
    #[allow(dead_code)] // used by the GPU device side
    Custom(Option<Box<dyn FnOnce() + Send + Sync>>),
}

/// One instance's mapped region: raw memory shared with peers (through the
/// fabric), the proxy thread and the device side. Every access goes through
/// the methods below, which check bounds and use atomics for the words that
/// cross threads or devices.
pub struct Region {
    ptr: NonNull<u8>,
    len: usize,
    backing: Backing,
}

// SAFETY: the region is plain memory whose cross-thread words are accessed
// only through atomics, and whose data sections are handed over by the
// release/acquire protocol on those words (see kernels/arx_abi.h).
unsafe impl Send for Region {}
// SAFETY: as above.
unsafe impl Sync for Region {}

#[allow(dead_code)] // accessors for the verbs and GPU paths
impl Region {
    /// Maps `len` zeroed bytes of anonymous, page-aligned memory.
    pub(crate) fn anonymous(len: usize) -> Result<Self> {
        // SAFETY: a fresh private anonymous mapping; no existing memory is touched.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(Error::last_os("mmap", format!("{len} bytes")));
        }
        Ok(Region {
            ptr: NonNull::new(p.cast()).expect("mmap never returns NULL on success"),
            len,
            backing: Backing::Mmap,
        })
    }

    /// Wraps memory owned elsewhere.
    ///
    /// # Safety
    /// `ptr` must be valid for reads and writes of `len` bytes, aligned to a
    /// page, for as long as `backing` lives.
    pub(crate) unsafe fn from_raw(ptr: *mut u8, len: usize, backing: Backing) -> Result<Self> {
        let ptr = NonNull::new(ptr)
            .ok_or_else(|| Error::InvalidArgument("region pointer is NULL".into()))?;
        Ok(Region { ptr, len, backing })
    }

    /// Base address (host == device address for mapped CUDA memory).
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// True for an empty region (never, in practice).
    #[allow(dead_code)]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn check(&self, off: usize, len: usize, align: usize) {
        // A layout bug, not a runtime condition: offsets come from `Layout`.
        assert!(
            off.checked_add(len).is_some_and(|e| e <= self.len) && off % align == 0,
            "region access {off}+{len} outside {} bytes",
            self.len
        );
    }

    /// The 64-bit word at `off` as an atomic.
    pub(crate) fn u64_at(&self, off: usize) -> &AtomicU64 {
        self.check(off, 8, 8);
        // SAFETY: in bounds and 8-aligned (checked); the memory lives as long
        // as `self`; every access to this word goes through atomics.
        unsafe { &*(self.ptr.as_ptr().add(off) as *const AtomicU64) }
    }

    /// The 32-bit word at `off` as an atomic.
    pub(crate) fn u32_at(&self, off: usize) -> &AtomicU32 {
        self.check(off, 4, 4);
        // SAFETY: as for `u64_at`.
        unsafe { &*(self.ptr.as_ptr().add(off) as *const AtomicU32) }
    }

    /// Copies `src` into the region at `off`.
    ///
    /// # Safety
    /// Nothing else in this process may access bytes `off..off + src.len()`
    /// during the copy, and `src` must not point into them: the caller owns
    /// that range for now by the protocol (this rank's send slot of parity
    /// `p` between the end of call `seq - 2` and the publication of `seq`;
    /// a peer's receive slot `recv[p][me]` while this rank's proxy posts
    /// `seq`, which the peer reads only after the flag that follows).
    /// Peers, the NIC and the GPU keep out of the range by the same rule.
    pub(crate) unsafe fn write(&self, off: usize, src: &[u8]) {
        self.check(off, src.len(), 1);
        // SAFETY: in bounds (checked); exclusive access to the destination
        // and no overlap with `src` are the caller's contract.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.as_ptr().add(off), src.len())
        }
    }

    /// Copies `dst.len()` bytes at `off` out of the region.
    ///
    /// A copy through raw pointers rather than a `&[u8]` view: the region is
    /// written by peers, a NIC or a GPU, which the compiler cannot see, and
    /// a shared reference would promise it that the bytes do not change
    /// while the reference lives. A faulty peer writing during the copy can
    /// only tear the copied bytes.
    ///
    /// # Safety
    /// No thread of this process may write these bytes during the copy
    /// (atomics included): by the protocol a received slot is not written
    /// again before call `seq + 2`, which cannot start before this call
    /// returns, and the send slot is this rank's until then.
    pub(crate) unsafe fn read_into(&self, off: usize, dst: &mut [u8]) {
        self.check(off, dst.len(), 1);
        // SAFETY: in bounds (checked); `dst` is a distinct, exclusively
        // borrowed buffer, so it cannot overlap the region's bytes that no
        // thread of ours writes now (the caller's contract).
        unsafe {
            std::ptr::copy_nonoverlapping(self.ptr.as_ptr().add(off), dst.as_mut_ptr(), dst.len())
        }
    }

    /// Copies `len` bytes at `src_off` of this region into `dst` at
    /// `dst_off` (the Shm fabric: this rank's send slot into a peer's
    /// receive slot), without forming a reference to either.
    ///
    /// # Safety
    /// The source bytes must not be written, and the destination bytes not
    /// accessed, by anything else during the copy: the contracts of
    /// [`Region::read_into`] for the source and [`Region::write`] for the
    /// destination.
    pub(crate) unsafe fn copy_to(&self, src_off: usize, dst: &Region, dst_off: usize, len: usize) {
        self.check(src_off, len, 1);
        dst.check(dst_off, len, 1);
        // SAFETY: both ranges in bounds (checked); nothing else touches them
        // during the copy (the caller's contract). `ptr::copy` tolerates
        // overlap, which a layout bug would be, rather than making it UB.
        unsafe {
            std::ptr::copy(
                self.ptr.as_ptr().add(src_off),
                dst.ptr.as_ptr().add(dst_off),
                len,
            )
        }
    }

    /// Checks that the region is whole pages of the kernel's page before it
    /// is handed to `call` (see [`super::check_pages`]).
    pub(crate) fn check_pages(&self, call: &'static str) -> Result<()> {
        let what = format!("region of {} bytes", self.len);
        super::check_pages(
            call,
            &what,
            self.ptr.as_ptr() as usize,
            self.len,
            super::page_size()?,
        )
    }

    /// Control block words.
    pub(crate) fn ctrl(&self) -> Ctrl<'_> {
        Ctrl(self)
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        match &mut self.backing {
            Backing::Mmap => {
                // SAFETY: we mapped exactly this range in `anonymous`.
                unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
            }
            Backing::Borrowed(_) => {}
            Backing::Custom(f) => {
                if let Some(f) = f.take() {
                    f()
                }
            }
        }
    }
}

/// Typed access to the control block's words.
pub(crate) struct Ctrl<'a>(&'a Region);

macro_rules! ctrl_off {
    ($field:ident) => {
        std::mem::offset_of!(abi::arx_ctrl_t, $field)
    };
}

// Orderings: each access is in `crate::protocol`, with its reason, except
// `done` (the watchdog's progress report, see `Ctrl::done`) and
// `timeout_ns` (written once at start-up, see `establish`).
impl Ctrl<'_> {
    pub fn seq(&self) -> &AtomicU64 {
        self.0.u64_at(ctrl_off!(seq))
    }
    pub fn meta(&self, parity: usize) -> &AtomicU64 {
        self.0.u64_at(ctrl_off!(meta) + 8 * parity)
    }
    /// The last call the device side finished. Read only by the watchdog to
    /// tell progress from a stall, so `Relaxed` suffices on both sides (the
    /// host side stores it with `Release` as the kernel does, harmlessly).
    pub fn done(&self) -> &AtomicU64 {
        self.0.u64_at(ctrl_off!(done))
    }
    pub fn timeout_ns(&self) -> &AtomicU64 {
        self.0.u64_at(ctrl_off!(timeout_ns))
    }
}

impl Control for Region {
    fn word(&self, w: Word) -> &AtomicU64 {
        let off = match w {
            Word::Seq => ctrl_off!(seq),
            Word::Meta(p) => ctrl_off!(meta) + 8 * p,
            Word::Bytes(p) => ctrl_off!(bytes) + 8 * p,
            Word::Sent => ctrl_off!(sent),
            Word::ErrSeq => ctrl_off!(err_seq),
            Word::ErrFlag => ctrl_off!(err_flag),
        };
        self.u64_at(off)
    }
    fn word32(&self, w: Word32) -> &AtomicU32 {
        let off = match w {
            Word32::Abort => ctrl_off!(abort),
            Word32::Status => ctrl_off!(status),
            Word32::ErrPeer => ctrl_off!(err_peer),
            Word32::ErrLane => ctrl_off!(err_lane),
        };
        self.u32_at(off)
    }
}

/// A region with the layout of its offsets: what the protocol's steps
/// (`crate::protocol`) read and write. For a peer's region in the Shm
/// segment, `layout` is this rank's: the offsets of the flags and receive
/// slots that a sender writes are the same in every rank's layout.
#[derive(Clone, Copy)]
pub(crate) struct Placed<'a> {
    pub region: &'a Region,
    pub layout: &'a Layout,
}

impl Control for Placed<'_> {
    fn word(&self, w: Word) -> &AtomicU64 {
        self.region.word(w)
    }
    fn word32(&self, w: Word32) -> &AtomicU32 {
        self.region.word32(w)
    }
}

impl Memory for Placed<'_> {
    fn flag(&self, parity: usize, src: usize, lane: usize) -> &AtomicU64 {
        self.region
            .u64_at(self.layout.flag_offset(parity, src, lane))
    }
    unsafe fn write_send(&self, parity: usize, at: usize, src: &[u8]) {
        assert!(
            at + src.len() <= self.layout.slot_bytes(),
            "partial exceeds the slot"
        );
        // SAFETY: the slot is the caller's (the trait's contract), which is
        // `Region::write`'s.
        unsafe { self.region.write(self.layout.send_offset(parity) + at, src) }
    }
    unsafe fn read_partial(&self, parity: usize, src: usize, at: usize, dst: &mut [u8]) {
        let off = if src == self.layout.rank() {
            self.layout.send_offset(parity)
        } else {
            self.layout.recv_offset(parity, src)
        };
        assert!(
            at + dst.len() <= self.layout.slot_bytes(),
            "read past the slot"
        );
        // SAFETY: nothing writes these bytes now (the trait's contract,
        // which is `Region::read_into`'s).
        unsafe { self.region.read_into(off + at, dst) }
    }
    unsafe fn copy_send(&self, parity: usize, range: Range<usize>, peer: &Self, from: usize) {
        assert!(range.end <= self.layout.slot_bytes(), "copy past the slot");
        let src = self.layout.send_offset(parity) + range.start;
        let dst = peer.layout.recv_offset(parity, from) + range.start;
        // SAFETY: the trait's contract, which is `Region::copy_to`'s.
        unsafe { self.region.copy_to(src, peer.region, dst, range.len()) }
    }
    fn slot_bytes(&self) -> usize {
        self.layout.slot_bytes()
    }
}
