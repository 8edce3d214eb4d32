//! The mapped region: where each section lives (computed here and nowhere
//! else) and the small amount of `unsafe` needed to touch it.
//!
//! ```text
//! ctrl  | flags[2][world][2] | send[2][slot] | recv[2][world][slot]
//! ```
//!
//! Each section starts on a page, every slot and the region's size are
//! whole pages: the page the kernel reports (`sysconf(_SC_PAGESIZE)`: 4 KiB
//! on x86, 4, 16 or 64 KiB on aarch64), never less than
//! `ARX_SECTION_ALIGN` (4 KiB), and the largest any rank reports when ranks
//! run on different kernels ([`Layout::agreed`]). So `cuMemHostRegister`,
//! `ibv_reg_mr` and the Shm fabric's per-rank parts cover whole pages on
//! every kernel. The receive area keeps a slot for this rank too (unused) so
//! that `recv[p][src]` needs no special case.

use std::ops::Range;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use crate::abi;
use crate::bootstrap::Bootstrap;
use crate::error::{Error, Result};

/// Bytes of the control block.
pub(crate) const CTRL_BYTES: usize = std::mem::size_of::<abi::arx_ctrl_t>();
/// The smallest alignment of sections and slots, whatever the page size.
const MIN_ALIGN: usize = abi::ARX_SECTION_ALIGN as usize;
const LANES: usize = abi::ARX_LANES as usize;
const PARITIES: usize = abi::ARX_PARITIES as usize;

// The Rust side agrees with the header's own static asserts.
const _: () = assert!(std::mem::size_of::<abi::arx_ctrl_t>() == 256);
const _: () = assert!(std::mem::size_of::<abi::arx_layout_t>() == 56);
const _: () = assert!(std::mem::size_of::<abi::arx_gpu_state_t>() == 64);
const _: () = assert!(std::mem::size_of::<abi::arx_params_t>() == 104);

pub(crate) const fn align_up(x: usize, a: usize) -> usize {
    x.div_ceil(a) * a
}

/// The page size the kernel reports for this process.
pub(crate) fn page_size() -> Result<usize> {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(p)
        .ok()
        .filter(|p| p.is_power_of_two())
        .ok_or_else(|| Error::Os {
            call: "sysconf(_SC_PAGESIZE)",
            object: "this process".into(),
            detail: format!("returned {p}, not a page size"),
        })
}

/// The page every rank aligns to: the largest any rank reported (a multiple
/// of all the others, pages being powers of two). `pages[r]` is rank r's
/// all-gathered report: its page size as 8 little-endian bytes, 0 if it
/// could not read it.
fn largest_page(pages: &[Vec<u8>]) -> Result<usize> {
    let mut largest = 0;
    for (peer, b) in pages.iter().enumerate() {
        let p = <[u8; 8]>::try_from(b.as_slice())
            .map(u64::from_le_bytes)
            .ok()
            .and_then(|p| usize::try_from(p).ok())
            .filter(|p| p.is_power_of_two())
            .ok_or_else(|| Error::PeerFailed {
                peer,
                reason: format!("reported no usable page size ({b:02x?})"),
            })?;
        largest = largest.max(p);
    }
    Ok(largest)
}

/// Offsets of one instance's region.
#[derive(Debug, Clone, Copy)]
pub struct Layout {
    raw: abi::arx_layout_t,
    /// What sections and slots are aligned to: the page, at least 4 KiB.
    align: usize,
}

impl Layout {
    /// Computes the layout for `world` ranks and slots of at least
    /// `slot_bytes` bytes, aligned to this process's page (rounded up to
    /// one). Ranks on other kernels agree through `Layout::agreed`.
    pub fn new(world: usize, rank: usize, slot_bytes: usize) -> Result<Self> {
        Self::with_page(world, rank, slot_bytes, page_size()?)
    }

    /// The layout every rank of `boot` computes alike, aligned to the
    /// largest page any rank's kernel reports: the Verbs fabric writes at
    /// offsets into peers' regions that it computes from its own layout, so
    /// a 4 KiB x86 node and a 64 KiB aarch64 node must not each align to
    /// their own page. Collective over `boot`.
    pub(crate) fn agreed(
        boot: &Bootstrap,
        world: usize,
        rank: usize,
        slot_bytes: usize,
    ) -> Result<Self> {
        let local = page_size();
        let report = local.as_ref().map_or(0, |&p| p as u64);
        let pages = boot.all_gather_bytes("page size", &report.to_le_bytes())?;
        local?;
        Self::with_page(world, rank, slot_bytes, largest_page(&pages)?)
    }

    /// Computes the layout with sections and slots aligned to `page` bytes
    /// (a power of two; 4 KiB when smaller).
    pub fn with_page(world: usize, rank: usize, slot_bytes: usize, page: usize) -> Result<Self> {
        if !page.is_power_of_two() {
            return Err(Error::InvalidArgument(format!(
                "page size {page} is not a power of two"
            )));
        }
        let align = page.max(MIN_ALIGN);
        if world == 0 || world > abi::ARX_MAX_WORLD as usize {
            return Err(Error::InvalidArgument(format!(
                "world size {world} is outside 1..={}",
                abi::ARX_MAX_WORLD
            )));
        }
        if rank >= world {
            return Err(Error::InvalidArgument(format!(
                "rank {rank} outside a world of {world}"
            )));
        }
        if slot_bytes == 0 {
            return Err(Error::InvalidArgument("slot size 0".into()));
        }
        let slot = align_up(slot_bytes, align);
        let flags_off = align_up(CTRL_BYTES, align);
        let flags_bytes = PARITIES * world * LANES * 8;
        let send_off = align_up(flags_off + flags_bytes, align);
        let recv_off = send_off + PARITIES * slot;
        let region = recv_off
            .checked_add(
                PARITIES
                    .checked_mul(world)
                    .and_then(|n| n.checked_mul(slot))
                    .ok_or_else(|| Error::InvalidArgument("region size overflows".into()))?,
            )
            .ok_or_else(|| Error::InvalidArgument("region size overflows".into()))?;
        Ok(Layout {
            raw: abi::arx_layout_t {
                ctrl_off: 0,
                flags_off: flags_off as u64,
                send_off: send_off as u64,
                recv_off: recv_off as u64,
                slot_bytes: slot as u64,
                region_bytes: region as u64,
                world: world as u32,
                rank: rank as u32,
            },
            align,
        })
    }

    /// The ABI struct handed to the kernel.
    pub fn raw(&self) -> abi::arx_layout_t {
        self.raw
    }
    /// Ranks in the communicator.
    pub fn world(&self) -> usize {
        self.raw.world as usize
    }
    /// This rank.
    pub fn rank(&self) -> usize {
        self.raw.rank as usize
    }
    /// Bytes of one slot (one partial's capacity).
    pub fn slot_bytes(&self) -> usize {
        self.raw.slot_bytes as usize
    }
    /// Bytes of the whole region.
    pub fn region_bytes(&self) -> usize {
        self.raw.region_bytes as usize
    }
    /// The page sections, slots and the region's size are multiples of.
    pub fn page(&self) -> usize {
        self.align
    }
    /// Offset of the flag `src` writes for `lane` on calls of `parity`.
    pub fn flag_offset(&self, parity: usize, src: usize, lane: usize) -> usize {
        debug_assert!(parity < PARITIES && src < self.world() && lane < LANES);
        self.raw.flags_off as usize + ((parity * self.world() + src) * LANES + lane) * 8
    }
    /// Offset of this rank's send slot of `parity`.
    pub fn send_offset(&self, parity: usize) -> usize {
        self.raw.send_off as usize + parity * self.slot_bytes()
    }
    /// Offset of the slot that receives `src`'s partial on calls of `parity`.
    pub fn recv_offset(&self, parity: usize, src: usize) -> usize {
        self.raw.recv_off as usize + (parity * self.world() + src) * self.slot_bytes()
    }
    /// Bytes of the flags section.
    pub fn flags_bytes(&self) -> usize {
        PARITIES * self.world() * LANES * 8
    }
    /// Offset of the flags section.
    pub fn flags_offset(&self) -> usize {
        self.raw.flags_off as usize
    }

    /// The peers in the order this rank visits them: `rank+1, rank+2, …`
    /// (mod world). Sending in this staggered order keeps every receiver
    /// from getting all senders at once (incast); waiting in it spreads the
    /// polling the same way.
    pub fn peers(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.world() - 1).map(|k| self.peer(k))
    }

    /// The `k`-th peer (from 0) in [`Layout::peers`] order.
    pub fn peer(&self, k: usize) -> usize {
        (self.rank() + 1 + k) % self.world()
    }

    /// The bytes of a `bytes`-long partial that travel on `lane`: the first
    /// half (rounded up to 16 bytes) on lane 0, the rest on lane 1. A lane
    /// may carry nothing for tiny partials; its flag is sent all the same.
    pub fn lane_range(bytes: usize, lane: usize) -> Range<usize> {
        let half = align_up(bytes.div_ceil(2), abi::ARX_LANE_ALIGN as usize).min(bytes);
        match lane {
            0 => 0..half,
            _ => half..bytes,
        }
    }
}

/// Packs the flag word for call `seq` of `count` elements of `dtype`.
pub fn flag_word(seq: u64, dtype: u32, count: usize) -> u64 {
    ((seq & 0xffff_ffff) << abi::ARX_FLAG_SEQ_SHIFT)
        | (u64::from(dtype & abi::ARX_FLAG_DTYPE_MASK) << abi::ARX_FLAG_DTYPE_SHIFT)
        | (count as u64 & u64::from(abi::ARX_FLAG_COUNT_MASK))
}

/// The seq bits of a flag word.
pub fn flag_seq(flag: u64) -> u32 {
    (flag >> abi::ARX_FLAG_SEQ_SHIFT) as u32
}

/// The (dtype, count) bits of a flag word.
pub fn flag_call(flag: u64) -> (u32, usize) {
    (
        ((flag >> abi::ARX_FLAG_DTYPE_SHIFT) as u32) & abi::ARX_FLAG_DTYPE_MASK,
        (flag & u64::from(abi::ARX_FLAG_COUNT_MASK)) as usize,
    )
}

/// "peer q lane l: arrived|missing (last call s of this parity, n x dtype)"
/// for every peer (in [`Layout::peers`] order) and lane of call `seq`: what
/// a timeout or the watchdog reports.
pub(crate) fn peer_flags(region: &Region, layout: &Layout, seq: u64) -> String {
    let p = (seq & 1) as usize;
    let mut out = Vec::new();
    for q in layout.peers() {
        for lane in 0..LANES {
            let f = region
                .u64_at(layout.flag_offset(p, q, lane))
                .load(Ordering::Acquire);
            let (d, n) = flag_call(f);
            let state = if flag_seq(f) == seq as u32 {
                "arrived"
            } else {
                "missing"
            };
            let last = if f == 0 {
                "nothing received on this parity yet".to_string()
            } else {
                format!(
                    "last call {} of this parity, {}",
                    flag_seq(f),
                    crate::dtype::CallDesc::new(d, n)
                )
            };
            out.push(format!("peer {q} lane {lane}: {state} ({last})"));
        }
    }
    out.join("; ")
}

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

#[allow(dead_code)] // error words are written by the GPU kernel
impl Ctrl<'_> {
    pub fn seq(&self) -> &AtomicU64 {
        self.0.u64_at(ctrl_off!(seq))
    }
    pub fn meta(&self, parity: usize) -> &AtomicU64 {
        self.0.u64_at(ctrl_off!(meta) + 8 * parity)
    }
    pub fn done(&self) -> &AtomicU64 {
        self.0.u64_at(ctrl_off!(done))
    }
    pub fn abort(&self) -> &AtomicU32 {
        self.0.u32_at(ctrl_off!(abort))
    }
    pub fn status(&self) -> &AtomicU32 {
        self.0.u32_at(ctrl_off!(status))
    }
    pub fn err_peer(&self) -> &AtomicU32 {
        self.0.u32_at(ctrl_off!(err_peer))
    }
    pub fn err_lane(&self) -> &AtomicU32 {
        self.0.u32_at(ctrl_off!(err_lane))
    }
    pub fn err_seq(&self) -> &AtomicU64 {
        self.0.u64_at(ctrl_off!(err_seq))
    }
    pub fn err_flag(&self) -> &AtomicU64 {
        self.0.u64_at(ctrl_off!(err_flag))
    }
    pub fn timeout_ns(&self) -> &AtomicU64 {
        self.0.u64_at(ctrl_off!(timeout_ns))
    }
    pub fn bytes(&self, parity: usize) -> &AtomicU64 {
        self.0.u64_at(ctrl_off!(bytes) + 8 * parity)
    }
    pub fn sent(&self) -> &AtomicU64 {
        self.0.u64_at(ctrl_off!(sent))
    }
    /// Publishes call `seq` (host device side; the kernel does the same in
    /// `kernels/oneshot.cuh`): its flag word and byte count, then `seq` with
    /// release, so the proxy that acquires `seq` sees both and the staged
    /// partial.
    pub fn publish(&self, seq: u64, flag: u64, bytes: usize) {
        let p = (seq & 1) as usize;
        self.meta(p).store(flag, Ordering::Relaxed);
        self.bytes(p).store(bytes as u64, Ordering::Relaxed);
        self.seq().store(seq, Ordering::Release);
    }
    /// True once the abort word is set.
    pub fn aborted(&self) -> bool {
        self.abort().load(Ordering::Acquire) != 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sections_are_disjoint_and_aligned() {
        // 4 KiB (x86, stock arm64 kernels), 16 KiB and 64 KiB (arm64
        // kernels built for them, e.g. Ubuntu's -64k flavour).
        for page in [4096, 16384, 65536] {
            for world in [1, 2, 3, 8, 256] {
                for slot in [1, 4096, 4097, 65537, 1 << 20] {
                    let l = Layout::with_page(world, world - 1, slot, page).unwrap();
                    assert_eq!(l.page(), page);
                    assert!(l.slot_bytes() >= slot && l.slot_bytes() % page == 0);
                    assert!(
                        l.slot_bytes() < slot + page,
                        "no more than one page of slack"
                    );
                    assert!(l.flags_offset() >= CTRL_BYTES);
                    assert!(l.flags_offset() + l.flags_bytes() <= l.send_offset(0));
                    assert_eq!(l.send_offset(1), l.send_offset(0) + l.slot_bytes());
                    assert!(l.send_offset(1) + l.slot_bytes() <= l.recv_offset(0, 0));
                    let last = l.recv_offset(1, world - 1) + l.slot_bytes();
                    assert_eq!(last, l.region_bytes());
                    // Sections start on a page; the region is whole pages, so
                    // the Shm fabric's per-rank parts (rank r at r x region)
                    // and registrations of the region cover whole pages.
                    for off in [
                        l.flags_offset(),
                        l.send_offset(0),
                        l.send_offset(1),
                        l.recv_offset(0, 0),
                        l.recv_offset(1, world - 1),
                        l.region_bytes(),
                    ] {
                        assert_eq!(off % page, 0, "offset {off}, page {page}");
                    }
                    // Every flag word is distinct and inside the flags section.
                    let mut seen = std::collections::HashSet::new();
                    for p in 0..2 {
                        for s in 0..world {
                            for lane in 0..2 {
                                let o = l.flag_offset(p, s, lane);
                                assert!(
                                    o >= l.flags_offset()
                                        && o + 8 <= l.flags_offset() + l.flags_bytes()
                                );
                                assert!(seen.insert(o));
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn a_64k_page_layout_in_numbers() {
        // 3 ranks, a 1-byte slot: control block, flags and every slot each
        // take one 64 KiB page.
        let l = Layout::with_page(3, 1, 1, 65536).unwrap();
        assert_eq!(l.flags_offset(), 65536);
        assert_eq!(l.slot_bytes(), 65536);
        assert_eq!(l.send_offset(0), 2 * 65536);
        assert_eq!(l.recv_offset(0, 0), 4 * 65536);
        assert_eq!(l.region_bytes(), (4 + 2 * 3) * 65536);
        // The same shape on 4 KiB pages packs tighter.
        let small = Layout::with_page(3, 1, 1, 4096).unwrap();
        assert_eq!(small.region_bytes(), (4 + 2 * 3) * 4096);
    }

    #[test]
    fn pages_below_4k_still_align_to_4k_and_odd_pages_are_refused() {
        let l = Layout::with_page(2, 0, 100, 1024).unwrap();
        assert_eq!(l.page(), 4096);
        assert_eq!(l.slot_bytes(), 4096);
        assert_eq!(l.send_offset(0) % 4096, 0);
        for bad in [0, 3, 12288, 65535] {
            let e = Layout::with_page(2, 0, 100, bad).unwrap_err().to_string();
            assert!(e.contains(&format!("page size {bad}")), "{e}");
        }
    }

    #[test]
    fn ranks_agree_on_the_largest_page() {
        let report = |p: u64| p.to_le_bytes().to_vec();
        // An x86 node (4 KiB) with a 64 KiB aarch64 node: both use 64 KiB.
        let mixed = [report(4096), report(65536), report(16384)];
        assert_eq!(largest_page(&mixed).unwrap(), 65536);
        assert_eq!(largest_page(&[report(4096), report(4096)]).unwrap(), 4096);
        // A rank that could not read its page (0), reported garbage or a
        // short record is named.
        for (bad, rank) in [
            (vec![report(4096), report(0)], 1),
            (vec![report(12288), report(4096)], 0),
            (vec![report(4096), report(4096), vec![0, 16]], 2),
        ] {
            match largest_page(&bad) {
                Err(Error::PeerFailed { peer, reason }) => {
                    assert_eq!(peer, rank, "{reason}");
                    assert!(reason.contains("page size"), "{reason}");
                }
                other => panic!("expected PeerFailed naming rank {rank}, got {other:?}"),
            }
        }
    }

    #[test]
    fn page_size_is_the_kernels() {
        assert_eq!(page_size().unwrap(), kernel_page());
    }

    /// The page this process sees, read independently of the code under
    /// test (the auxiliary vector, not sysconf).
    fn kernel_page() -> usize {
        // SAFETY: getauxval has no preconditions.
        let p = unsafe { libc::getauxval(libc::AT_PAGESZ) } as usize;
        assert!(p.is_power_of_two(), "AT_PAGESZ {p}");
        p
    }

    #[test]
    fn layout_follows_the_page_the_kernel_reports() {
        // Under `qemu-aarch64 -p 65536` (scripts/test-aarch64) this is a
        // 64 KiB page; on x86 and stock arm64 kernels 4 KiB.
        let page = kernel_page();
        for world in [1, 2, 3, 8] {
            for slot in [1, 4096, 65537] {
                let l = Layout::new(world, 0, slot).unwrap();
                for (what, v) in [
                    ("slot", l.slot_bytes()),
                    ("flags", l.flags_offset()),
                    ("send", l.send_offset(0)),
                    ("recv", l.recv_offset(0, 0)),
                    ("region", l.region_bytes()),
                ] {
                    assert_eq!(v % page, 0, "{what} {v} with a {page}-byte page");
                }
            }
        }
    }

    #[test]
    fn rejects_bad_shapes() {
        assert!(Layout::new(0, 0, 4096).is_err());
        assert!(Layout::new(2, 2, 4096).is_err());
        assert!(Layout::new(257, 0, 4096).is_err());
        assert!(Layout::new(2, 0, 0).is_err());
    }

    #[test]
    fn lanes_split_every_byte_once() {
        for bytes in [0usize, 1, 2, 15, 16, 17, 31, 32, 33, 1000, 4096, 1 << 20] {
            let a = Layout::lane_range(bytes, 0);
            let b = Layout::lane_range(bytes, 1);
            assert_eq!(a.start, 0);
            assert_eq!(a.end, b.start);
            assert_eq!(b.end, bytes);
            assert!(a.end % 16 == 0 || a.end == bytes);
            assert!(a.len() >= b.len());
        }
    }

    #[test]
    fn flag_word_round_trips() {
        for (seq, dtype, count) in [
            (1u64, 1u32, 1usize),
            (0x1_2345_6789, 3, 0x0fff_ffff),
            (7, 2, 12345),
        ] {
            let f = flag_word(seq, dtype, count);
            assert_eq!(flag_seq(f), seq as u32);
            assert_eq!(flag_call(f), (dtype, count));
        }
        assert_ne!(flag_word(1, 1, 5), flag_word(1, 1, 6));
        assert_ne!(flag_word(1, 1, 5), flag_word(1, 3, 5));
    }

    #[test]
    fn region_words_are_independent() {
        let l = Layout::new(3, 1, 4096).unwrap();
        let r = Region::anonymous(l.region_bytes()).unwrap();
        r.ctrl().seq().store(41, Ordering::Release);
        r.ctrl().meta(1).store(7, Ordering::Release);
        r.u64_at(l.flag_offset(1, 2, 1)).store(9, Ordering::Release);
        assert_eq!(r.ctrl().seq().load(Ordering::Acquire), 41);
        assert_eq!(r.ctrl().meta(0).load(Ordering::Acquire), 0);
        assert_eq!(r.ctrl().meta(1).load(Ordering::Acquire), 7);
        assert_eq!(r.u64_at(l.flag_offset(1, 2, 0)).load(Ordering::Acquire), 0);
        let mut back = [0u8; 3];
        // SAFETY: nothing else touches this test region.
        unsafe {
            r.write(l.send_offset(1), &[1, 2, 3]);
            r.read_into(l.send_offset(1), &mut back);
        }
        assert_eq!(back, [1, 2, 3]);
    }

    #[test]
    fn copy_to_moves_a_slot_between_regions() {
        let l = Layout::new(2, 0, 4096).unwrap();
        let a = Region::anonymous(l.region_bytes()).unwrap();
        let b = Region::anonymous(l.region_bytes()).unwrap();
        let data: Vec<u8> = (0..5000u32).map(|i| (i * 7 + 3) as u8).collect();
        let mut back = vec![0u8; 5000];
        // SAFETY: nothing else touches these test regions.
        unsafe {
            a.write(l.send_offset(0), &data);
            a.copy_to(l.send_offset(0) + 10, &b, l.recv_offset(1, 0), 4000);
            b.read_into(l.recv_offset(1, 0), &mut back[..4000]);
        }
        assert_eq!(back[..4000], data[10..4010]);
        // Nothing beyond the copied range moved.
        let mut after = [0xffu8; 8];
        // SAFETY: as above.
        unsafe { b.read_into(l.recv_offset(1, 0) + 4000, &mut after) };
        assert_eq!(after, [0; 8]);
    }
}
