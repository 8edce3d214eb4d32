//! Unit tests of the boundary: the error mapping, the config struct's
//! checks, the buffer checks, panics, and the header against the crate.

use std::ffi::{c_void, CStr};
use std::time::Duration;

use arx::{CallDesc, CallKind, Dtype, Error};

use crate::call::{Blocks, Buffers, Coll};
use crate::error::{code_of, describe, guard, thread_error, Failure, ALL};
use crate::types::*;

fn config() -> arxConfig_t {
    let u = ARX_CONFIG_UNDEF_INT;
    arxConfig_t {
        size: std::mem::size_of::<arxConfig_t>(),
        magic: ARX_CONFIG_MAGIC,
        version: ARX_VERSION_CODE as u32,
        device: u,
        fabric: u,
        staging: u,
        spin: u,
        slotBytes: u,
        timeoutMs: u,
        initTimeoutMs: u,
        stallWarnMs: u,
        cudaDevice: u,
        gidIndex: u,
        proxyCpu: u,
        rdmaDevices: std::ptr::null(),
    }
}

#[test]
fn every_error_variant_has_its_code() {
    use arxResult_t::*;
    let call = |kind| CallDesc {
        kind,
        count: 3,
        more: false,
        op: arx::Op::Sum,
        pattern: arx::Pattern::Whole,
    };
    let mismatch = |theirs| Error::CallMismatch {
        seq: 1,
        rank: 0,
        ours: call(CallKind::Reduce(Dtype::F32)),
        peer: 1,
        theirs,
    };
    let s = || "x".to_string();
    let cases = [
        (Error::InvalidArgument(s()), arxInvalidArgument),
        (
            Error::Config {
                name: "n",
                value: s(),
                reason: s(),
            },
            arxInvalidArgument,
        ),
        (
            Error::Mismatch {
                what: "w",
                rank: 1,
                ours: s(),
                theirs: s(),
            },
            arxMismatch,
        ),
        (mismatch(call(CallKind::Reduce(Dtype::F16))), arxMismatch),
        (mismatch(call(CallKind::Refused)), arxMismatch),
        (mismatch(call(CallKind::FabricFailed)), arxPeerFailed),
        (mismatch(call(CallKind::Failed)), arxPeerFailed),
        (mismatch(call(CallKind::Departed)), arxPeerFailed),
        (
            Error::Timeout {
                during: "d",
                waited: Duration::from_secs(1),
                detail: s(),
            },
            arxTimeout,
        ),
        (
            Error::PeerFailed {
                peer: 1,
                reason: s(),
            },
            arxPeerFailed,
        ),
        (
            Error::Unavailable {
                what: "w",
                reason: s(),
            },
            arxUnavailable,
        ),
        (Error::Topology(s()), arxUnavailable),
        (
            Error::Mpi {
                call: "c",
                detail: s(),
            },
            arxSystemError,
        ),
        (
            Error::Os {
                call: "c",
                object: s(),
                detail: s(),
            },
            arxSystemError,
        ),
        (
            Error::Verbs {
                call: "c",
                device: s(),
                peer: None,
                lane: None,
                detail: s(),
            },
            arxSystemError,
        ),
        (
            Error::Cuda {
                call: "c",
                detail: s(),
            },
            arxSystemError,
        ),
        (
            Error::Kernel {
                seq: 1,
                detail: s(),
            },
            arxSystemError,
        ),
        (Error::Proxy(s()), arxSystemError),
    ];
    for (e, want) in cases {
        assert_eq!(code_of(&e), want, "{e:?}");
        let f = Failure::from(e.clone());
        assert_eq!(f.message, e.to_string());
    }
}

#[test]
fn every_code_has_its_own_string() {
    let mut seen = std::collections::HashSet::new();
    for c in ALL {
        let s = describe(c as RawResult).to_str().unwrap();
        assert!(!s.is_empty() && !s.starts_with("unknown"), "{c:?}");
        assert!(seen.insert(s), "{c:?} repeats {s}");
    }
    for bad in [-1, arxResult_t::arxNumResults as RawResult, 1000] {
        assert!(describe(bad).to_str().unwrap().starts_with("unknown"));
    }
}

#[test]
fn a_panic_becomes_an_internal_error_with_its_message() {
    let r = guard("arxTest", || panic!("boom {}", 42));
    assert_eq!(r, arxResult_t::arxInternalError as RawResult);
    // SAFETY: the thread's message lives until its next failing call.
    let m = unsafe { CStr::from_ptr(thread_error()) }.to_str().unwrap();
    assert!(
        m.starts_with("arxTest: internal error") && m.contains("boom 42"),
        "{m}"
    );
    assert_eq!(guard("arxTest", || Ok(())), 0);
}

#[test]
fn config_null_and_initializer_are_accepted() {
    // SAFETY: NULL, and a whole initialised struct.
    unsafe {
        assert!(crate::config::builder(std::ptr::null()).is_ok());
        assert!(crate::config::builder(&config()).is_ok());
    }
    let mut c = config();
    c.device = arxDeviceSide_t::arxDeviceHost as i32;
    c.fabric = arxFabric_t::arxFabricShm as i32;
    c.staging = arxStaging_t::arxStagingCopy as i32;
    c.spin = arxSpin_t::arxSpinHot as i32;
    c.slotBytes = 65536;
    c.timeoutMs = 5000;
    c.initTimeoutMs = 0; // out of range, but judged by arx at build
    c.cudaDevice = 0;
    c.gidIndex = 3;
    c.proxyCpu = 1;
    c.rdmaDevices = c"rocep1s0f0, roceP2p1s0f0".as_ptr();
    // SAFETY: a whole initialised struct; the string is static.
    assert!(unsafe { crate::config::builder(&c) }.is_ok());
    for spin in [arxSpin_t::arxSpinAdaptive, arxSpin_t::arxSpinNap] {
        c.spin = spin as i32;
        // SAFETY: as above.
        assert!(unsafe { crate::config::builder(&c) }.is_ok(), "{spin:?}");
    }
}

#[test]
fn config_framing_and_values_are_checked() {
    type Edit = fn(&mut arxConfig_t);
    let cases: [(Edit, &str); 12] = [
        (|c| c.size -= 8, "arxConfig_t.size"),
        (|c| c.magic = 0, "arxConfig_t.magic"),
        (|c| c.version = 99, "arxConfig_t.version"),
        (|c| c.version += 1, "arxConfig_t.version"),
        (|c| c.device = 3, "arxConfig_t.device"),
        (|c| c.fabric = -1, "arxConfig_t.fabric"),
        (|c| c.staging = 2, "arxConfig_t.staging"),
        (|c| c.spin = 7, "arxConfig_t.spin"),
        (|c| c.slotBytes = -4096, "arxConfig_t.slotBytes"),
        (|c| c.timeoutMs = -1, "arxConfig_t.timeoutMs"),
        (|c| c.cudaDevice = -2, "arxConfig_t.cudaDevice"),
        (
            |c| c.rdmaDevices = c"\xff".as_ptr(),
            "arxConfig_t.rdmaDevices",
        ),
    ];
    for (edit, field) in cases {
        let mut c = config();
        edit(&mut c);
        // SAFETY: a whole initialised struct (the size edit only shrinks
        // what is claimed); the strings are static.
        match unsafe { crate::config::builder(&c) } {
            Err(Error::Config { name, .. }) => assert_eq!(name, field),
            other => panic!("{field}: {:?}", other.map(|_| ())),
        }
    }
}

fn buffers(s: usize, r: usize, count: usize, d: Dtype) -> Result<Buffers, Failure> {
    Buffers::check(s as *const c_void, r as *mut c_void, count, d, arx::Op::Sum)
}

#[test]
fn buffers_null_overlap_and_overflow_are_refused() {
    let invalid = |r: Result<Buffers, Failure>| {
        r.err().map(|f| f.code) == Some(arxResult_t::arxInvalidArgument)
    };
    assert!(invalid(buffers(0, 4096, 1, Dtype::F32)));
    assert!(invalid(buffers(4096, 0, 1, Dtype::F32)));
    assert!(
        invalid(buffers(4096, 4100, 2, Dtype::F32)),
        "partial overlap"
    );
    assert!(
        invalid(buffers(4100, 4096, 2, Dtype::F32)),
        "partial overlap"
    );
    assert!(invalid(buffers(4096, 8192, usize::MAX / 2, Dtype::F32)));
    assert!(invalid(buffers(
        4096,
        8192,
        (isize::MAX as usize) / 2 + 1,
        Dtype::F16
    )));
    assert!(
        invalid(buffers(usize::MAX - 8, 4096, 4, Dtype::F32)),
        "past the end"
    );
    assert!(buffers(4096, 4096, 100, Dtype::F32).is_ok(), "in place");
    assert!(buffers(4096, 4104, 2, Dtype::F32).is_ok(), "adjacent");
    assert!(buffers(4104, 4096, 2, Dtype::F32).is_ok(), "adjacent");
    assert!(buffers(4096, 8192, 0, Dtype::Bf16).is_ok(), "empty");
}

/// NULL buffers with count 0 are an empty call (as NCCL takes them): they
/// become a non-NULL address aligned to the element, both NULL in place.
#[test]
fn null_buffers_of_an_empty_call_are_accepted() {
    for d in [Dtype::F32, Dtype::F16, Dtype::Bf16] {
        let b = buffers(0, 0, 0, d).map_err(|f| f.message).unwrap();
        assert!(b.send != 0 && b.send == b.recv && b.send % d.size() == 0);
        let b = buffers(0, 4096, 0, d).map_err(|f| f.message).unwrap();
        assert!(b.send != 0 && b.send % d.size() == 0 && b.recv == 4096);
        let b = buffers(4096, 0, 0, d).map_err(|f| f.message).unwrap();
        assert!(b.recv != 0 && b.recv % d.size() == 0 && b.send == 4096);
        // One element: NULL is refused, naming the buffer.
        let f = buffers(0, 0, 1, d).err().expect("NULL with count 1");
        assert!(f.message.contains("sendbuff is NULL"), "{}", f.message);
    }
    for coll in [Coll::ReduceScatter, Coll::AllGather] {
        for (s, r) in [(0, 0), (0, 4096), (4096, 0)] {
            let b = Blocks::check(
                coll,
                s as *const c_void,
                r as *mut c_void,
                0,
                Dtype::F32,
                arx::Op::Sum,
                4,
                3,
            );
            let mut b = b.map_err(|f| f.message).unwrap();
            assert!(b.send != 0 && b.recv != 0);
            assert!(b.aligned().is_ok() && b.layout().is_ok());
        }
    }
}

/// The layout of a reduce-scatter or all-gather on `rank` of `world`:
/// `Some(true)` in place, `Some(false)` disjoint, `None` refused (the face
/// checks of `Blocks::check` panic the test if they refuse).
fn blocks_layout(
    coll: Coll,
    s: usize,
    r: usize,
    n: usize,
    world: usize,
    rank: usize,
) -> Option<bool> {
    let d = Dtype::F32;
    let mut b = Blocks::check(
        coll,
        s as *const c_void,
        r as *mut c_void,
        n,
        d,
        arx::Op::Sum,
        world,
        rank,
    )
    .unwrap_or_else(|f| panic!("face check refused: {}", f.message));
    b.layout().ok().map(|()| b.in_place())
}

#[test]
fn blocks_in_place_only_at_this_ranks_block() {
    use Coll::*;
    // 3 ranks, 10 floats per rank: the big buffer at 4096 spans 120 bytes.
    for rank in 0..3 {
        let mine = 4096 + 40 * rank;
        assert_eq!(
            blocks_layout(ReduceScatter, 4096, mine, 10, 3, rank),
            Some(true)
        );
        assert_eq!(
            blocks_layout(AllGather, mine, 4096, 10, 3, rank),
            Some(true)
        );
        // Another rank's block, or recvbuff == sendbuff off rank 0.
        let other = 4096 + 40 * ((rank + 1) % 3);
        assert_eq!(blocks_layout(ReduceScatter, 4096, other, 10, 3, rank), None);
        assert_eq!(blocks_layout(AllGather, other, 4096, 10, 3, rank), None);
        assert_eq!(
            blocks_layout(ReduceScatter, 4096, 4096, 10, 3, rank),
            (rank == 0).then_some(true)
        );
        assert_eq!(
            blocks_layout(AllGather, 4096, 4096, 10, 3, rank),
            (rank == 0).then_some(true)
        );
        // Off by one element, and the small buffer straddling either end.
        assert_eq!(
            blocks_layout(ReduceScatter, 4096, mine + 4, 10, 3, rank),
            None
        );
        assert_eq!(
            blocks_layout(ReduceScatter, 4096, 4096 - 36, 10, 3, rank),
            None
        );
        assert_eq!(
            blocks_layout(AllGather, 4096 + 116, 4096, 10, 3, rank),
            None
        );
        // Adjacent on either side: disjoint.
        assert_eq!(
            blocks_layout(ReduceScatter, 4096, 4096 + 120, 10, 3, rank),
            Some(false)
        );
        assert_eq!(
            blocks_layout(ReduceScatter, 4096, 4096 - 40, 10, 3, rank),
            Some(false)
        );
        assert_eq!(
            blocks_layout(AllGather, 4096 - 40, 4096, 10, 3, rank),
            Some(false)
        );
        assert_eq!(
            blocks_layout(AllGather, 4096 + 120, 4096, 10, 3, rank),
            Some(false)
        );
    }
    // Empty: equal pointers are in place, any others disjoint.
    assert_eq!(
        blocks_layout(ReduceScatter, 4096, 4096, 0, 3, 2),
        Some(true)
    );
    assert_eq!(blocks_layout(AllGather, 4100, 4096, 0, 3, 2), Some(false));
}

#[test]
fn blocks_null_and_overflow_are_refused() {
    let check = |coll, s: usize, r: usize, n, world| {
        Blocks::check(
            coll,
            s as *const c_void,
            r as *mut c_void,
            n,
            Dtype::F16,
            arx::Op::Sum,
            world,
            0,
        )
        .err()
        .map(|f| f.code)
    };
    let invalid = Some(arxResult_t::arxInvalidArgument);
    for coll in [Coll::ReduceScatter, Coll::AllGather] {
        assert_eq!(check(coll, 0, 4096, 1, 2), invalid);
        assert_eq!(check(coll, 4096, 0, 1, 2), invalid);
        // n fits on its own, not times the ranks.
        assert_eq!(
            check(coll, 4096, 1 << 40, (isize::MAX as usize) / 4, 3),
            invalid
        );
        assert_eq!(check(coll, 4096, 1 << 40, usize::MAX / 2, 2), invalid);
        assert_eq!(check(coll, 4096, 1 << 40, 1000, 8), None);
    }
    // The world-sized buffer past the end of the address space.
    assert_eq!(
        check(Coll::ReduceScatter, usize::MAX - 64, 4096, 20, 2),
        invalid
    );
    assert_eq!(
        check(Coll::AllGather, 4096, usize::MAX - 64, 20, 2),
        invalid
    );
    assert_eq!(
        check(Coll::ReduceScatter, usize::MAX - 80, 4096, 20, 2),
        None
    );
}

#[test]
fn datatypes_and_ops() {
    use arxDataType_t::*;
    for (c, d) in [
        (arxFloat32, Dtype::F32),
        (arxFloat16, Dtype::F16),
        (arxBfloat16, Dtype::Bf16),
    ] {
        assert_eq!(crate::call::dtype(c as RawDataType).ok(), Some(d));
    }
    for bad in [-1, arxNumTypes as RawDataType, 99] {
        assert!(crate::call::dtype(bad).is_err());
    }
    for (c, o) in [
        (arxRedOp_t::arxSum, arx::Op::Sum),
        (arxRedOp_t::arxMax, arx::Op::Max),
        (arxRedOp_t::arxMin, arx::Op::Min),
        (arxRedOp_t::arxAvg, arx::Op::Avg),
    ] {
        assert_eq!(crate::call::op(c as RawRedOp).ok(), Some(o));
    }
    // 1 is NCCL's product: refused, never mistaken for another op.
    assert!(crate::call::op(1).is_err());
    assert!(crate::call::op(arxRedOp_t::arxNumOps as RawRedOp).is_err());
    assert!(crate::call::op(-1).is_err());
}

#[test]
fn version_follows_the_crate() {
    let v = |k: &str| k.parse::<i32>().unwrap();
    assert_eq!(ARX_MAJOR, v(env!("CARGO_PKG_VERSION_MAJOR")));
    assert_eq!(ARX_MINOR, v(env!("CARGO_PKG_VERSION_MINOR")));
    assert_eq!(ARX_PATCH, v(env!("CARGO_PKG_VERSION_PATCH")));
    assert_eq!(
        ARX_VERSION_CODE,
        ARX_MAJOR * 10000 + ARX_MINOR * 100 + ARX_PATCH
    );
    // The C library's version is arx's.
    let root =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../Cargo.toml")).unwrap();
    let arx_version = root
        .lines()
        .find_map(|l| l.strip_prefix("version = "))
        .unwrap()
        .trim_matches('"');
    assert_eq!(arx_version, env!("CARGO_PKG_VERSION"));
}

#[test]
fn header_initializer_sets_every_field() {
    // ARX_CONFIG_INITIALIZER is written by hand in capi/cbindgen.toml: it
    // must name one value per field of the struct cbindgen prints, or C
    // would zero the fields it leaves out (0 is a valid setting).
    let h =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../include/arx.h")).unwrap();
    let init = h.split("#define ARX_CONFIG_INITIALIZER {").nth(1).unwrap();
    let init = &init[..init.find('}').unwrap()];
    let values = init
        .lines()
        .map(|l| l.split("/*").next().unwrap().trim_end_matches('\\').trim())
        .collect::<Vec<_>>()
        .join(" ");
    let values = values.split(',').filter(|v| !v.trim().is_empty()).count();
    let body = h.split("typedef struct arxConfig_t {").nth(1).unwrap();
    let body = &body[..body.find("} arxConfig_t;").unwrap()];
    let fields = body
        .lines()
        .filter(|l| l.trim_end().ends_with(';') && !l.trim_start().starts_with('*'))
        .count();
    assert_eq!(fields, 15, "arxConfig_t's fields in include/arx.h");
    assert_eq!(values, fields, "ARX_CONFIG_INITIALIZER's values");
}
