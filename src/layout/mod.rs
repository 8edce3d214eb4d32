//! The mapped region: where each section lives (computed here and nowhere
//! else) and the small amount of `unsafe` needed to touch it.
//!
//! ```text
//! ctrl  | flags[2][world][2] probe[world] departed[world] | send[2][slot] | recv[2][world][slot]
//! ```
//!
//! `probe[src]` (8 bytes per rank, after the flag array in the same
//! section) is the word `src` writes when [`Arx::probe_rails`] measures a
//! rail, and `departed[src]` the word `src` writes when it closes its
//! instance ([`Layout::departed_offset`]); only the host reads them, never
//! a kernel, so they are not part of the kernel ABI
//! ([`Layout::probe_offset`]).
//!
//! [`Arx::probe_rails`]: crate::Arx::probe_rails
//!
//! Each section starts on a page, every slot and the region's size are
//! whole pages: the page the kernel reports (`sysconf(_SC_PAGESIZE)`: 4 KiB
//! on x86, 4, 16 or 64 KiB on aarch64), never less than
//! `ARX_SECTION_ALIGN` (4 KiB), and the largest any rank reports when ranks
//! run on different kernels ([`Layout::agreed`]). So `cuMemHostRegister`,
//! `ibv_reg_mr` and the Shm fabric's per-rank parts cover whole pages on
//! every kernel ([`check_pages`] verifies it where memory is registered).
//! The receive area keeps a slot for this rank too (unused) so that
//! `recv[p][src]` needs no special case.

use std::ops::Range;
use std::sync::atomic::Ordering;

use crate::abi;
use crate::bootstrap::Bootstrap;
use crate::error::{Error, Result};
pub use crate::protocol::{flag_seq, flag_word};

mod region;
pub use region::Region;
pub(crate) use region::{Backing, Placed};

/// Bytes of the control block.
pub(crate) const CTRL_BYTES: usize = std::mem::size_of::<abi::arx_ctrl_t>();
/// The largest page a rank may report (1 GiB, the largest huge page of
/// any kernel arx runs on); a larger report is a peer's error.
const MAX_PAGE: usize = 1 << 30;
/// The smallest alignment of sections and slots, whatever the page size.
const MIN_ALIGN: usize = abi::ARX_SECTION_ALIGN as usize;
const LANES: usize = abi::ARX_LANES as usize;
const PARITIES: usize = abi::ARX_PARITIES as usize;

// The Rust side agrees with the header's own static asserts.
const _: () = assert!(std::mem::size_of::<abi::arx_ctrl_t>() == 256);
const _: () = assert!(std::mem::size_of::<abi::arx_layout_t>() == 56);
const _: () = assert!(std::mem::size_of::<abi::arx_gpu_state_t>() == 72);
const _: () = assert!(std::mem::size_of::<abi::arx_params_t>() == 136);

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

/// Checks that `len` bytes at `addr`, about to be handed to `call`
/// (`cuMemHostRegister`, `ibv_reg_mr`, a rank's part of the Shm segment),
/// are whole pages of `page` bytes (the kernel's, [`page_size`]). Both
/// calls work on whole pages: `ibv_reg_mr` pins them and marks them
/// `MADV_DONTFORK`, `cuMemHostRegister` page-locks and maps them, so a range
/// sharing a page with other memory would pin it, or hide it from a forked
/// child, too. The layout makes every region whole pages of the page all
/// ranks agreed on (at least this kernel's), and mappings start on a page:
/// this check turns a violation of that into an error naming `call`
/// instead of a silent partial page.
pub(crate) fn check_pages(
    call: &'static str,
    what: &str,
    addr: usize,
    len: usize,
    page: usize,
) -> Result<()> {
    if len == 0 || addr % page != 0 || len % page != 0 {
        return Err(Error::Os {
            call,
            object: what.to_string(),
            detail: format!(
                "{len} bytes at {addr:#x} are not whole pages of {page} bytes (the page \
                 size the kernel reports); arx registers whole pages only"
            ),
        });
    }
    Ok(())
}

/// The page every rank aligns to: the largest any rank reported (a multiple
/// of all the others, pages being powers of two). `pages[r]` is the page
/// half of rank r's report ([`agree_page_and_slot`]): 8 little-endian
/// bytes, 0 if it could not read it.
fn largest_page(pages: &[&[u8]]) -> Result<usize> {
    let mut largest = 0;
    for (peer, b) in pages.iter().enumerate() {
        let p = <[u8; 8]>::try_from(*b)
            .map(u64::from_le_bytes)
            .ok()
            .and_then(|p| usize::try_from(p).ok())
            .filter(|p| p.is_power_of_two() && *p <= MAX_PAGE)
            .ok_or_else(|| Error::PeerFailed {
                peer,
                reason: format!("reported no usable page size ({b:02x?})"),
            })?;
        largest = largest.max(p);
    }
    Ok(largest)
}

/// What each rank reports to [`Layout::agreed`]: its kernel's page size (0
/// if it could not read it) and the slot size it was given, 8
/// little-endian bytes each.
fn page_and_slot_report(page: u64, slot_bytes: u64) -> Vec<u8> {
    [page.to_le_bytes(), slot_bytes.to_le_bytes()].concat()
}

/// The page every rank aligns to and the check that the ranks' slot sizes
/// agree once rounded up to it, decided identically on every rank from the
/// all-gathered reports ([`page_and_slot_report`]). Slot sizes are compared
/// after rounding: 4000 and 4096 bytes both make slots of one page, so
/// ranks given either agree; sizes that round apart are an
/// [`Error::Mismatch`] on `ARX_SLOT_BYTES` naming the first rank that
/// differs from rank 0, with both sizes as given and as rounded.
fn agree_page_and_slot(reports: &[Vec<u8>]) -> Result<usize> {
    let mut pages = Vec::with_capacity(reports.len());
    let mut slots = Vec::with_capacity(reports.len());
    for (peer, b) in reports.iter().enumerate() {
        if b.len() != 16 {
            return Err(Error::PeerFailed {
                peer,
                reason: format!("sent a page and slot report of {} bytes, not 16", b.len()),
            });
        }
        let (page, slot) = b.split_at(8);
        pages.push(page);
        slots.push(u64::from_le_bytes(slot.try_into().expect("8 bytes")));
    }
    let page = largest_page(&pages)?;
    let align = page.max(MIN_ALIGN) as u64;
    // `None` for a size too large to round (every rank refuses it later).
    let rounded = |s: u64| s.checked_next_multiple_of(align);
    let shown = |s: u64| match rounded(s) {
        Some(r) if r == s => s.to_string(),
        Some(r) => format!("{s} (slots of {r} bytes in {align}-byte pages)"),
        None => format!("{s} (too large to round to {align}-byte pages)"),
    };
    if rounded(slots[0]).is_none() {
        return Err(Error::InvalidArgument(format!(
            "slot size {}",
            shown(slots[0])
        )));
    }
    if let Some(rank) = slots.iter().position(|&s| rounded(s) != rounded(slots[0])) {
        return Err(Error::Mismatch {
            what: "ARX_SLOT_BYTES",
            rank,
            ours: shown(slots[0]),
            theirs: shown(slots[rank]),
        });
    }
    Ok(page)
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
    /// their own page. The ranks' slot sizes must agree once rounded up to
    /// that page ([`Error::Mismatch`] on `ARX_SLOT_BYTES` otherwise, the
    /// same on every rank). Collective over `boot`.
    pub(crate) fn agreed(
        boot: &Bootstrap,
        world: usize,
        rank: usize,
        slot_bytes: usize,
    ) -> Result<Self> {
        let local = page_size();
        let report =
            page_and_slot_report(local.as_ref().map_or(0, |&p| p as u64), slot_bytes as u64);
        let reports = boot.all_gather_bytes("page and slot sizes", &report)?;
        local?;
        Self::with_page(world, rank, slot_bytes, agree_page_and_slot(&reports)?)
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
        // Checked: the page comes from peers and the slot from a public
        // constructor, so neither is bounded here.
        let overflow = || {
            Error::InvalidArgument(format!(
                "a region of {world} ranks with slots of {slot_bytes} bytes in {align}-byte \
                 pages overflows the address space"
            ))
        };
        let up = |x: usize| x.checked_next_multiple_of(align).ok_or_else(overflow);
        let slot = up(slot_bytes)?;
        let flags_off = up(CTRL_BYTES)?;
        let flags_bytes = PARITIES * world * LANES * 8;
        // The probe and departure words follow the flags in their section.
        let send_off = up(flags_off
            .checked_add(flags_bytes + world * 16)
            .ok_or_else(overflow)?)?;
        let recv_off = PARITIES
            .checked_mul(slot)
            .and_then(|b| send_off.checked_add(b))
            .ok_or_else(overflow)?;
        let region = PARITIES
            .checked_mul(world)
            .and_then(|n| n.checked_mul(slot))
            .and_then(|b| recv_off.checked_add(b))
            .ok_or_else(overflow)?;
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
    /// Offset of the 8-byte word `src` writes into this region when
    /// [`Arx::probe_rails`](crate::Arx::probe_rails) measures a rail:
    /// after the flag array, before the send slots, so that neither the
    /// protocol's flag checks nor a relay (which read the flags) ever see
    /// it. Not part of the kernel ABI (no kernel reads it).
    pub fn probe_offset(&self, src: usize) -> usize {
        debug_assert!(src < self.world());
        let off = self.flags_offset() + self.flags_bytes() + src * 8;
        // `with_page` leaves room for `world` words before the send slots.
        debug_assert!(off + 8 <= self.raw.send_off as usize);
        off
    }
    /// Offset of the 8-byte word `src` writes into this region when it
    /// closes its instance (`Fabric::tell_departed`): after the probe
    /// words, before the send slots. Not part of the kernel ABI (only this
    /// rank's proxy reads it).
    pub(crate) fn departed_offset(&self, src: usize) -> usize {
        debug_assert!(src < self.world());
        let off = self.flags_offset() + self.flags_bytes() + (self.world() + src) * 8;
        // `with_page` leaves room for `2 * world` words before the send slots.
        debug_assert!(off + 8 <= self.raw.send_off as usize);
        off
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
        crate::protocol::lane_range(bytes, lane)
    }
}

/// "peer q lane l: arrived|missing (last call s of this parity, n x dtype)"
/// for every peer (in [`Layout::peers`] order) and lane of call `seq`: what
/// a timeout or the watchdog reports.
pub(crate) fn peer_flags(region: &Region, layout: &Layout, seq: u64) -> String {
    let p = (seq & 1) as usize;
    let mut out = Vec::new();
    for q in layout.peers() {
        for lane in 0..LANES {
            // Relaxed: a diagnostic; only the word itself is used.
            let f = region
                .u64_at(layout.flag_offset(p, q, lane))
                .load(Ordering::Relaxed);
            let state = if flag_seq(f) != seq as u32 {
                "missing"
            } else if crate::protocol::flag_call(f).0 == crate::abi::ARX_DTYPE_INVALID {
                // A refusal or a poison: a word for this call, but no data.
                "failed"
            } else {
                "arrived"
            };
            let last = if f == 0 {
                "nothing received on this parity yet".to_string()
            } else {
                format!(
                    "last call {} of this parity, {}",
                    flag_seq(f),
                    crate::dtype::CallDesc::of_flag(f)
                )
            };
            out.push(format!("peer {q} lane {lane}: {state} ({last})"));
        }
    }
    out.join("; ")
}

#[cfg(test)]
mod tests;
