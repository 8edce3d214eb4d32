//! Unit tests of the layout, flag words and region access.
use super::*;
use crate::protocol::flag_call;

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
fn probe_and_departure_words_lie_between_the_flags_and_the_send_slots() {
    for page in [4096, 65536] {
        for world in [1, 2, 3, 85, 86, 101, 102, 103, 127, 128, 129, 256] {
            let l = Layout::with_page(world, 0, 4096, page).unwrap();
            let flags = l.flags_offset()..l.flags_offset() + l.flags_bytes();
            let mut seen = std::collections::HashSet::new();
            for src in 0..world {
                for (what, o) in [
                    ("probe", l.probe_offset(src)),
                    ("departure", l.departed_offset(src)),
                ] {
                    assert_eq!(o % 8, 0);
                    assert!(
                        !flags.contains(&o),
                        "world {world}: {what} word {src} in the flags"
                    );
                    assert!(o >= flags.end, "world {world}");
                    assert!(
                        o + 8 <= l.send_offset(0),
                        "world {world}, page {page}: {what} word {src} at {o} reaches the send \
                         slot at {}",
                        l.send_offset(0)
                    );
                    assert!(seen.insert(o), "world {world}: {what} word {src} overlaps");
                }
            }
        }
    }
    // Up to 85 ranks, flags, probe and departure words share one 4 KiB
    // page; from 86 they take two (flags 32 bytes a rank, the other words
    // 16).
    for (world, pages) in [(85, 2), (86, 3), (128, 3), (256, 4)] {
        assert_eq!(
            Layout::with_page(world, 0, 1, 4096).unwrap().send_offset(0),
            pages * 4096,
            "world {world}"
        );
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
    let report = |p: u64| page_and_slot_report(p, 1 << 20);
    // An x86 node (4 KiB) with a 64 KiB aarch64 node: both use 64 KiB.
    let mixed = [report(4096), report(65536), report(16384)];
    assert_eq!(agree_page_and_slot(&mixed).unwrap(), 65536);
    assert_eq!(
        agree_page_and_slot(&[report(4096), report(4096)]).unwrap(),
        4096
    );
    // A rank that could not read its page (0), reported garbage or a
    // short record is named.
    for (bad, rank) in [
        (vec![report(4096), report(0)], 1),
        (vec![report(12288), report(4096)], 0),
        (vec![report(4096), report(4096), vec![0, 16]], 2),
    ] {
        match agree_page_and_slot(&bad) {
            Err(Error::PeerFailed { peer, reason }) => {
                assert_eq!(peer, rank, "{reason}");
                assert!(reason.contains("page"), "{reason}");
            }
            other => panic!("expected PeerFailed naming rank {rank}, got {other:?}"),
        }
    }
}

#[test]
fn slot_sizes_are_compared_after_rounding_to_the_agreed_page() {
    let r = page_and_slot_report;
    // 4000 and 4096 bytes both make one-page slots on 4 KiB pages.
    assert_eq!(
        agree_page_and_slot(&[r(4096, 4096), r(4096, 4000)]).unwrap(),
        4096
    );
    // 4096 and 65536 differ on 4 KiB pages...
    let e = agree_page_and_slot(&[r(4096, 4096), r(4096, 4096), r(4096, 65536)]).unwrap_err();
    match &e {
        Error::Mismatch {
            what,
            rank,
            ours,
            theirs,
        } => {
            assert_eq!((*what, *rank), ("ARX_SLOT_BYTES", 2));
            assert_eq!((ours.as_str(), theirs.as_str()), ("4096", "65536"));
        }
        other => panic!("expected a slot size Mismatch, got {other:?}"),
    }
    // ...but not once one rank's kernel has 64 KiB pages: every rank uses
    // that page and both round to one of it.
    assert_eq!(
        agree_page_and_slot(&[r(4096, 4096), r(65536, 65536)]).unwrap(),
        65536
    );
    // A difference that survives rounding names both sizes as given and
    // as rounded.
    let e = agree_page_and_slot(&[r(4096, 5000), r(4096, 4000)])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("rank 1 has 4000 (slots of 4096 bytes in 4096-byte pages)"),
        "{e}"
    );
    assert!(e.contains("rank 0 has 5000 (slots of 8192 bytes"), "{e}");
    // A size too large to round is a mismatch rather than an overflow.
    let e = agree_page_and_slot(&[r(4096, 4096), r(4096, u64::MAX)])
        .unwrap_err()
        .to_string();
    assert!(e.contains("too large to round"), "{e}");
}

#[test]
fn sizes_past_the_address_space_are_errors_not_overflows() {
    let r = page_and_slot_report;
    // A slot too large to round on every rank: an error on every rank.
    let e = agree_page_and_slot(&[r(4096, u64::MAX), r(4096, u64::MAX)]).unwrap_err();
    assert!(e.to_string().contains("too large to round"), "{e}");
    // A page no kernel has is a peer's error.
    match agree_page_and_slot(&[r(4096, 4096), r(1 << 40, 4096)]) {
        Err(Error::PeerFailed { peer: 1, reason }) => assert!(reason.contains("page"), "{reason}"),
        other => panic!("expected PeerFailed naming rank 1, got {other:?}"),
    }
    // The public constructors refuse what does not fit.
    for (slot, page) in [(usize::MAX, 4096), (usize::MAX / 2, 4096), (4096, 1 << 62)] {
        let e = Layout::with_page(2, 0, slot, page).unwrap_err().to_string();
        assert!(e.contains("overflows"), "slot {slot}, page {page}: {e}");
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
    let more = crate::abi::ARX_FLAG_MORE as usize;
    for (seq, dtype, count, m) in [
        (1u64, 1u32, 1usize, false),
        (0x1_2345_6789, 3, 0x007f_ffff, false),
        (0x1_2345_6789, 3, 0x007f_f000, true),
        (7, 2, 12345, false),
        (7, 2, 12345, true),
    ] {
        let f = flag_word(seq, dtype, if m { count | more } else { count });
        assert_eq!(flag_seq(f), seq as u32);
        assert_eq!(flag_call(f), (dtype, count));
        assert_eq!(crate::protocol::flag_more(f), m);
        assert!(!crate::protocol::flag_high(f));
        let h = flag_word(seq, dtype, count | crate::abi::ARX_FLAG_HIGH as usize);
        assert!(crate::protocol::flag_high(h));
        assert_eq!(flag_call(h), (dtype, count));
        assert_ne!(h, flag_word(seq, dtype, count));
        // A two-shot all-reduce's step (ARX_FLAG_ALLREDUCE): the count
        // decodes alone, and the word differs from the same step of a
        // reduce_scatter or an all_gather.
        let a = flag_word(seq, dtype, count | crate::abi::ARX_FLAG_ALLREDUCE as usize);
        assert_eq!(flag_call(a), (dtype, count));
        assert!(!crate::protocol::flag_high(a));
        assert_ne!(a, flag_word(seq, dtype, count));
    }
    assert_ne!(flag_word(1, 1, 5), flag_word(1, 1, 6));
    assert_ne!(flag_word(1, 1, 5), flag_word(1, 3, 5));
    assert_ne!(flag_word(1, 1, 5), flag_word(1, 1, 5 | more));
    // The op bits sit above the dtype: every decoder of the dtype (the
    // Verbs relay sizes its forward by it) sees the dtype alone, and two
    // ops never share a word.
    use crate::protocol::flag_word_op;
    for op in 0..4 {
        for dtype in 0..4 {
            let f = flag_word_op(0x1_2345_6789, dtype, op, 0x007f_f000 | more);
            assert_eq!(flag_call(f), (dtype, 0x007f_f000));
            assert_eq!(flag_seq(f), 0x2345_6789);
            assert_eq!(crate::dtype::CallDesc::of_flag(f).op.code(), op);
            if op > 0 {
                assert_ne!(f, flag_word_op(0x1_2345_6789, dtype, 0, 0x007f_f000 | more));
            }
        }
    }
    // The pattern bits sit between MORE and the count: flag_call strips
    // them, flag_pattern reads them, and two patterns never share a word.
    use crate::protocol::{count_field, flag_pattern};
    for pattern in 0..4 {
        for m in [false, true] {
            let f = flag_word(
                9,
                2,
                count_field(crate::abi::ARX_MAX_CHUNK as usize, m, pattern),
            );
            assert_eq!(flag_call(f), (2, crate::abi::ARX_MAX_CHUNK as usize));
            assert_eq!(flag_pattern(f), pattern);
            assert_eq!(crate::protocol::flag_more(f), m);
            for other in 0..4 {
                if other != pattern {
                    assert_ne!(
                        f,
                        flag_word(
                            9,
                            2,
                            count_field(crate::abi::ARX_MAX_CHUNK as usize, m, other)
                        )
                    );
                }
            }
        }
    }
    // No call's word is the poison word: its element count is above every
    // chunk's (its pattern bits are a broadcast's).
    let poison = crate::abi::ARX_FLAG_POISON_COUNT;
    assert_eq!(
        flag_pattern(u64::from(poison)),
        crate::abi::ARX_PATTERN_BCAST
    );
    assert!((poison & crate::abi::ARX_FLAG_ELEMS_MASK) > crate::abi::ARX_MAX_CHUNK);
    assert_eq!(
        crate::protocol::dest_range(flag_word(9, 0, poison as usize), 4, 1, 2),
        0..0
    );
}

/// A broadcast's words: every rank announces the same count and pattern,
/// only the root's carries the root bit and data (the whole partial, to
/// every peer); root and non-root words of one call always differ, and
/// words of different counts differ.
#[test]
fn broadcast_words_carry_the_root_alone() {
    use crate::protocol::{bcast_flag, dest_range, flag_call, flag_pattern};
    let f32c = crate::abi::ARX_DTYPE_F32;
    for count in [0usize, 1, 77, crate::abi::ARX_MAX_CHUNK as usize] {
        for more in [false, true] {
            for root in 0..4 {
                for src in 0..4 {
                    let w = bcast_flag(5, f32c, count, more, src, root);
                    assert_eq!(flag_call(w), (f32c, count));
                    assert_eq!(flag_pattern(w), crate::abi::ARX_PATTERN_BCAST);
                    assert_eq!(crate::protocol::flag_more(w), more);
                    for dst in (0..4).filter(|&d| d != src) {
                        let want = if src == root { 0..count * 4 } else { 0..0 };
                        assert_eq!(dest_range(w, 4, src, dst), want, "{src} {root} {dst}");
                    }
                    // The root's word is no non-root's, whatever the root.
                    let other = (root + 1) % 4;
                    assert_eq!(
                        w == bcast_flag(5, f32c, count, more, src, other),
                        src != root && src != other
                    );
                    let other_count = if count > 0 { count - 1 } else { 1 };
                    assert_ne!(w, bcast_flag(5, f32c, other_count, more, src, root));
                    let d = crate::dtype::CallDesc::of_flag(w);
                    assert_eq!(d.pattern, crate::Pattern::Broadcast { root: src == root });
                    assert_eq!(d.op, crate::Op::Sum);
                }
            }
        }
    }
}

/// The shard rule of `kernels/arx_abi.h`, against a direct reading of it:
/// exact blocks when the world divides the count, otherwise equal blocks
/// rounded up to 16 bytes; together they cover the call once, in order.
#[test]
fn shards_cover_the_call_once() {
    use crate::protocol::shard;
    for esize in [2usize, 4] {
        let a = 16 / esize;
        for world in 1..=17usize {
            for count in (0..300).chain([4096, 4097, 65536, 1 << 20]) {
                let len = if count % world == 0 {
                    count / world
                } else {
                    count.div_ceil(world)
                };
                let len = if count % world == 0 {
                    len
                } else {
                    len.div_ceil(a) * a
                };
                let mut at = 0;
                for q in 0..world {
                    let s = shard(count, world, esize, q);
                    assert_eq!(s.start, at, "count {count} world {world} shard {q}");
                    assert_eq!(s.end, count.min((q + 1) * len));
                    if count % world != 0 && s.start < count {
                        assert_eq!((s.start * esize) % 16, 0);
                    }
                    at = s.end;
                }
                assert_eq!(at, count, "count {count} world {world}");
            }
        }
    }
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

/// The ranges arx registers (`ibv_reg_mr`: a region; `cuMemHostRegister`:
/// a rank's part of the Shm segment, at r x region) are whole pages under a
/// 16 KiB and a 64 KiB kernel when the layout follows that page, and a
/// layout aligned to 4 KiB only is refused there, naming the call.
#[test]
fn registration_ranges_are_whole_pages_at_16k_and_64k() {
    for page in [16384, 65536] {
        // A mapping starts on a page (mmap, shm_open + mmap, cuMemHostAlloc).
        let base = 5 * page;
        for world in [1, 2, 3, 8] {
            for slot in [1, 4096, 4097, 1 << 20] {
                let l = Layout::with_page(world, 0, slot, page).unwrap();
                let len = l.region_bytes();
                check_pages("ibv_reg_mr", "region", base, len, page).unwrap();
                for r in 0..world {
                    check_pages("cuMemHostRegister", "part", base + r * len, len, page).unwrap();
                }
                // The segment as a whole (posix_fallocate, mmap).
                check_pages("mmap", "segment", base, world * len, page).unwrap();
            }
        }
        // A rank whose layout followed a 4 KiB page (no agreement): its
        // second part starts inside a page of this kernel.
        let small = Layout::with_page(3, 0, 4097, 4096).unwrap();
        assert_ne!(small.region_bytes() % page, 0);
        let e = check_pages(
            "cuMemHostRegister",
            "part",
            base + small.region_bytes(),
            small.region_bytes(),
            page,
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("cuMemHostRegister") && e.contains(&page.to_string()),
            "{e}"
        );
        // A base inside a page, and an empty range, are refused too.
        assert!(check_pages("ibv_reg_mr", "region", base + 4096, page, page).is_err());
        assert!(check_pages("ibv_reg_mr", "region", base, 0, page).is_err());
    }
}

/// The region arx maps itself passes the check against the kernel's page.
#[test]
fn an_anonymous_region_is_whole_pages_of_the_kernels_page() {
    let l = Layout::new(3, 1, 5000).unwrap();
    let r = Region::anonymous(l.region_bytes()).unwrap();
    r.check_pages("ibv_reg_mr").unwrap();
}

/// The memory each rank maps and registers (its region), as README.md
/// ("Requirements") states it: with the default 1 MiB slot, two pages
/// (control block; flags, probe and departure words) and 2 x (world + 1)
/// slots, while the flags and the other words (48 bytes a rank) fit one
/// page: up to 85 ranks on 4 KiB pages, every world on 64 KiB pages.
#[test]
fn memory_per_rank_at_the_default_slot() {
    const MIB: usize = 1 << 20;
    let slot = crate::config::DEFAULT_SLOT_BYTES;
    assert_eq!(slot, MIB);
    // (world, bytes per rank on 4 KiB pages), as README.md lists them.
    for (world, per_rank) in [
        (2, 6 * MIB + 8192),
        (4, 10 * MIB + 8192),
        (8, 18 * MIB + 8192),
        (16, 34 * MIB + 8192),
    ] {
        let l = Layout::with_page(world, world - 1, slot, 4096).unwrap();
        assert_eq!(l.region_bytes(), per_rank, "{world} ranks");
        let l = Layout::with_page(world, 0, slot, 65536).unwrap();
        assert_eq!(
            l.region_bytes(),
            2 * 65536 + 2 * (world + 1) * MIB,
            "{world} ranks, 64 KiB pages"
        );
    }
    // The formula for every world: one page of control block, the flags
    // with the probe and departure words rounded up to pages, then the
    // slots.
    for page in [4096, 65536] {
        for world in 1..=abi::ARX_MAX_WORLD as usize {
            let l = Layout::with_page(world, 0, slot, page).unwrap();
            let flag_pages = (48 * world).div_ceil(page);
            assert_eq!(
                l.region_bytes(),
                (1 + flag_pages) * page + 2 * (world + 1) * slot,
                "{world} ranks, {page} B pages"
            );
            assert_eq!(flag_pages == 1, page == 65536 || world <= 85);
        }
    }
}

/// The watchdog's and the timeout's view of the flags tells a refusal or a
/// poison ("failed") from a flag with data ("arrived") and from none.
#[test]
fn peer_flags_tell_arrived_failed_and_missing() {
    let l = Layout::new(3, 0, 4096).unwrap();
    let r = Region::anonymous(l.region_bytes()).unwrap();
    let p = 1; // call 5's parity
    let set = |q, lane, w| {
        r.u64_at(l.flag_offset(p, q, lane))
            .store(w, Ordering::Relaxed)
    };
    set(1, 0, flag_word(5, crate::abi::ARX_DTYPE_F32, 64));
    let failed = crate::dtype::FAILED_COUNT;
    set(1, 1, flag_word(5, crate::abi::ARX_DTYPE_INVALID, failed));
    set(2, 0, flag_word(3, crate::abi::ARX_DTYPE_F32, 64));
    let s = peer_flags(&r, &l, 5);
    assert!(s.contains("peer 1 lane 0: arrived (last call 5"), "{s}");
    assert!(
        s.contains("peer 1 lane 1: failed (last call 5 of this parity, nothing: it had timed out"),
        "{s}"
    );
    assert!(s.contains("peer 2 lane 0: missing (last call 3"), "{s}");
    assert!(
        s.contains("peer 2 lane 1: missing (nothing received"),
        "{s}"
    );
}
