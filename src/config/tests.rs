//! Unit tests of the settings: defaults, environment, builder, ranges.
use super::*;
use std::collections::HashMap;

fn with(vars: &[(&str, &str)]) -> Result<Config> {
    let m: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    Config::resolve_with(&Overrides::default(), move |k| m.get(k).cloned())
}

#[test]
fn defaults() {
    let c = with(&[]).unwrap();
    assert_eq!(c.device, DeviceKind::Auto);
    assert_eq!(c.fabric, FabricKind::Auto);
    assert_eq!(c.slot_bytes, DEFAULT_SLOT_BYTES);
    assert_eq!(c.timeout, DEFAULT_TIMEOUT);
    assert!(c.stall_warn < c.timeout);
    assert_eq!(c.staging, Staging::Sm);
    assert!(c.devices.is_none() && c.gid_index.is_none() && c.proxy_cpu.is_none());
}

#[test]
fn environment_is_read() {
    let c = with(&[
        ("ARX_DEVICE", "host"),
        ("ARX_FABRIC", "Verbs"),
        ("ARX_SLOT_BYTES", "64K"),
        ("ARX_TIMEOUT_MS", "2500"),
        ("ARX_SPIN", "hot"),
        ("ARX_STAGING", "copy"),
        ("ARX_DEVICES", "rocep1s0f0, roceP2p1s0f0"),
        ("ARX_GID_INDEX", "3"),
        ("ARX_PROXY_CPU", "19"),
    ])
    .unwrap();
    assert_eq!(c.device, DeviceKind::Host);
    assert_eq!(c.fabric, FabricKind::Verbs);
    assert_eq!(c.slot_bytes, 65536);
    assert_eq!(c.timeout, Duration::from_millis(2500));
    assert_eq!(c.spin, SpinMode::Hot);
    assert_eq!(with(&[("ARX_SPIN", "NAP")]).unwrap().spin, SpinMode::Nap);
    assert!(with(&[("ARX_SPIN", "naps")]).is_err());
    assert_eq!(c.staging, Staging::CopyEngine);
    assert_eq!(
        c.devices.as_deref(),
        Some(&["rocep1s0f0".to_string(), "roceP2p1s0f0".to_string()][..])
    );
    assert_eq!(c.gid_index, Some(3));
    assert_eq!(c.proxy_cpu, Some(19));
}

#[test]
fn builder_beats_environment() {
    let o = Overrides {
        slot_bytes: Some(8192),
        fabric: Some(FabricKind::Shm),
        ..Default::default()
    };
    let c = Config::resolve_with(&o, |k| match k {
        "ARX_SLOT_BYTES" => Some("1M".into()),
        "ARX_FABRIC" => Some("verbs".into()),
        _ => None,
    })
    .unwrap();
    assert_eq!(c.slot_bytes, 8192);
    assert_eq!(c.fabric, FabricKind::Shm);
}

#[test]
fn overridden_or_empty_variables_are_not_used() {
    // A builder value wins even over a variable that would be refused (it
    // is only logged as a warning), and an empty variable is unset.
    let o = Overrides {
        spin: Some(SpinMode::Nap),
        slot_bytes: Some(8192),
        ..Default::default()
    };
    let c = Config::resolve_with(&o, |k| match k {
        "ARX_SPIN" => Some("napp".into()),
        "ARX_SLOT_BYTES" => Some("lots".into()),
        _ => None,
    })
    .unwrap();
    assert_eq!(c.spin, SpinMode::Nap);
    assert_eq!(c.slot_bytes, 8192);
    let c = with(&[("ARX_SPIN", " "), ("ARX_SLOT_BYTES", "")]).unwrap();
    assert_eq!(c.spin, SpinMode::Adaptive);
    assert_eq!(c.slot_bytes, DEFAULT_SLOT_BYTES);
}

#[test]
fn bad_values_name_the_variable() {
    for (k, v) in [
        ("ARX_DEVICE", "tpu"),
        ("ARX_FABRIC", "tcp"),
        ("ARX_SLOT_BYTES", "12Q"),
        ("ARX_SLOT_BYTES", "0"),
        ("ARX_TIMEOUT_MS", "-1"),
        ("ARX_TIMEOUT_MS", "0"),
        ("ARX_DEVICES", "a,b,c"),
        ("ARX_GID_INDEX", "x"),
    ] {
        let e = with(&[(k, v)]).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains(v), "{k}={v}: {msg}");
    }
}

fn builder(o: Overrides) -> Result<Config> {
    Config::resolve_with(&o, |_| None)
}

/// Expects a refusal naming `name` and showing `value`.
fn refused(r: Result<Config>, name: &str, value: &str) {
    match r {
        Err(Error::Config {
            name: n, value: v, ..
        }) => {
            assert_eq!(n, name);
            assert!(
                v.contains(value),
                "{name}: value shown as {v}, expected {value}"
            );
        }
        other => panic!("{name}={value}: expected a refusal, got {other:?}"),
    }
}

#[test]
fn builder_and_environment_share_the_ranges() {
    for d in [
        Duration::MAX,
        Duration::ZERO,
        Duration::from_micros(999),
        MAX_TIMEOUT + Duration::from_nanos(1),
    ] {
        let shown = format!("{d:?}");
        let o = |f: fn(&mut Overrides, Duration)| {
            let mut o = Overrides::default();
            f(&mut o, d);
            o
        };
        refused(
            builder(o(|o, d| o.timeout = Some(d))),
            "Builder::timeout",
            &shown,
        );
        refused(
            builder(o(|o, d| o.init_timeout = Some(d))),
            "Builder::init_timeout",
            &shown,
        );
        refused(
            builder(o(|o, d| o.stall_warn = Some(d))),
            "Builder::stall_warn",
            &shown,
        );
    }
    for (k, v) in [
        ("ARX_TIMEOUT_MS", "0"),
        ("ARX_TIMEOUT_MS", "86400001"),
        ("ARX_TIMEOUT_MS", "18446744073709551615"),
        ("ARX_INIT_TIMEOUT_MS", "0"),
        ("ARX_INIT_TIMEOUT_MS", "90000000"),
        ("ARX_STALL_WARN_MS", "0"),
        ("ARX_GPU_UNROLL", "0"),
        ("ARX_GPU_UNROLL", "65"),
        ("ARX_GPU_UNROLL", "16777216"),
        ("ARX_GPU_BLOCKS", "0"),
        ("ARX_GPU_BLOCKS", "1025"),
        ("ARX_SPIN_HOT", "10000001"),
        ("ARX_SHM_COPY_THREADS", "16"),
        ("ARX_SHM_COPY_THREADS", "-1"),
        ("ARX_SHM_COPY_THREADS", "99999999999"),
        ("ARX_SLOT_BYTES", "0"),
        ("ARX_SLOT_BYTES", "1G"),
    ] {
        refused(with(&[(k, v)]), k, v);
    }
    refused(
        builder(Overrides {
            slot_bytes: Some(0),
            ..Default::default()
        }),
        "Builder::slot_bytes",
        "0",
    );
    refused(
        builder(Overrides {
            devices: Some(vec![]),
            ..Default::default()
        }),
        "Builder::devices",
        "",
    );
    refused(
        builder(Overrides {
            devices: Some(vec!["a".into(), "b".into(), "c".into()]),
            ..Default::default()
        }),
        "Builder::devices",
        "a,b,c",
    );
}

#[test]
fn range_bounds_are_accepted() {
    let c = with(&[
        ("ARX_TIMEOUT_MS", "86400000"),
        ("ARX_INIT_TIMEOUT_MS", "1"),
        ("ARX_STALL_WARN_MS", "1"),
        ("ARX_GPU_UNROLL", "64"),
        ("ARX_GPU_BLOCKS", "1024"),
        ("ARX_SPIN_HOT", "10000000"),
        ("ARX_SHM_COPY_THREADS", "15"),
    ])
    .unwrap();
    assert_eq!(c.shm_copy_threads, Some(MAX_SHM_COPY_THREADS));
    assert_eq!(
        with(&[("ARX_SHM_COPY_THREADS", "0")])
            .unwrap()
            .copy_threads(2),
        0
    );
    assert_eq!(c.timeout, MAX_TIMEOUT);
    assert_eq!(c.init_timeout, MIN_TIMEOUT);
    assert_eq!(c.stall_warn, MIN_TIMEOUT);
    assert_eq!((c.gpu_unroll, c.gpu_blocks), (Some(64), Some(1024)));
    assert_eq!(c.spin_hot, Some(MAX_SPIN_HOT));
    assert_eq!(with(&[("ARX_SPIN_HOT", "0")]).unwrap().spin_hot, Some(0));
    let c = builder(Overrides {
        timeout: Some(MIN_TIMEOUT),
        init_timeout: Some(MAX_TIMEOUT),
        ..Default::default()
    })
    .unwrap();
    assert_eq!((c.timeout, c.init_timeout), (MIN_TIMEOUT, MAX_TIMEOUT));
}

#[test]
fn init_timeout_is_its_own_setting() {
    let c = with(&[("ARX_TIMEOUT_MS", "1500")]).unwrap();
    assert_eq!(c.timeout, Duration::from_millis(1500));
    assert_eq!(c.init_timeout, DEFAULT_INIT_TIMEOUT);
    let c = with(&[("ARX_INIT_TIMEOUT_MS", "2500")]).unwrap();
    assert_eq!(c.init_timeout, Duration::from_millis(2500));
    assert_eq!(c.timeout, DEFAULT_TIMEOUT);
    let o = Overrides {
        init_timeout: Some(Duration::from_secs(7)),
        ..Default::default()
    };
    let c = Config::resolve_with(&o, |k| (k == "ARX_INIT_TIMEOUT_MS").then(|| "9".into())).unwrap();
    assert_eq!(c.init_timeout, Duration::from_secs(7));
}

#[test]
fn byte_sizes() {
    assert_eq!(parse_bytes("x", "4096").unwrap(), 4096);
    assert_eq!(parse_bytes("x", "8k").unwrap(), 8192);
    assert_eq!(parse_bytes("x", "2M").unwrap(), 2 << 20);
    assert_eq!(parse_bytes("x", "1G").unwrap(), 1 << 30);
    assert!(parse_bytes("x", "M").is_err());
    assert!(parse_bytes("x", "").is_err());
}

#[test]
fn a_bindings_refusal_is_returned_and_keeps_the_start_up_bound() {
    let o = Overrides {
        refused: Some(Error::InvalidArgument("unknown setting 'timout'".into())),
        init_timeout: Some(Duration::from_secs(3)),
        ..Default::default()
    };
    match builder(o.clone()) {
        Err(Error::InvalidArgument(m)) => assert!(m.contains("timout"), "{m}"),
        other => panic!("expected the binding's refusal, got {other:?}"),
    }
    // The refusing rank still bounds the exchange of settings by its own
    // start-up timeout.
    assert_eq!(Config::init_timeout_or_default(&o), Duration::from_secs(3));
}

/// The automatic algorithm follows the measured thresholds, restated here
/// from docs/BENCHMARKS.md ("One-shot vs two-shot"): host side over Shm
/// two-shot from 128 KiB at 2 ranks, 16 KiB at 3, 2 KiB at 4 to 7, 1 KiB
/// from 8; over Verbs from 8 KiB at 2 ranks or more; GPU side from 4 ranks
/// and GPU_TWOSHOT_FROM_BYTES on either fabric; never at 1 rank; a fixed
/// choice is kept.
#[test]
fn the_automatic_algorithm_follows_the_measured_thresholds() {
    use super::{host_twoshot_from_bytes as host, Algo, FabricKind, GPU_TWOSHOT_FROM_BYTES as G};
    use FabricKind::{Shm, Verbs};
    let a = Algo::Auto;
    for fabric in [Shm, Verbs] {
        for gpu in [false, true] {
            assert_eq!(a.choose(1, 1 << 30, gpu, fabric), Algo::OneShot);
            assert_eq!(a.choose(16, 0, gpu, fabric), Algo::OneShot);
            assert_eq!(Algo::TwoShot.choose(2, 0, gpu, fabric), Algo::TwoShot);
            assert_eq!(
                Algo::OneShot.choose(16, 1 << 30, gpu, fabric),
                Algo::OneShot
            );
        }
        assert_eq!(host(1, fabric), None);
        assert_eq!(a.choose(2, 1 << 30, true, fabric), Algo::OneShot);
        assert_eq!(a.choose(3, 1 << 30, true, fabric), Algo::OneShot);
        assert_eq!(a.choose(4, G - 1, true, fabric), Algo::OneShot);
        assert_eq!(a.choose(4, G, true, fabric), Algo::TwoShot);
        assert_eq!(a.choose(8, G, true, fabric), Algo::TwoShot);
        assert_eq!(Algo::twoshot_from_bytes(3, true, fabric), None);
        assert_eq!(Algo::twoshot_from_bytes(4, true, fabric), Some(G));
    }
    let shm = [
        (2, 128 << 10),
        (3, 16 << 10),
        (4, 2048),
        (5, 2048),
        (7, 2048),
        (8, 1024),
        (16, 1024),
        (256, 1024),
    ];
    for (world, from) in shm {
        assert_eq!(
            a.choose(world, from - 1, false, Shm),
            Algo::OneShot,
            "{world} ranks"
        );
        assert_eq!(
            a.choose(world, from, false, Shm),
            Algo::TwoShot,
            "{world} ranks"
        );
        assert_eq!(host(world, Shm), Some(from));
    }
    for world in [2, 3, 4, 8, 64] {
        assert_eq!(
            a.choose(world, 8191, false, Verbs),
            Algo::OneShot,
            "{world} ranks"
        );
        assert_eq!(
            a.choose(world, 8192, false, Verbs),
            Algo::TwoShot,
            "{world} ranks"
        );
    }
    assert_eq!(host(4, FabricKind::Auto), host(4, Verbs));
}

#[test]
fn a_number_past_its_type_is_too_large_not_malformed() {
    let e = with(&[("ARX_SHM_COPY_THREADS", "99999999999")])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("too large") && e.contains("ARX_SHM_COPY_THREADS"),
        "{e}"
    );
    let e = with(&[("ARX_SHM_COPY_THREADS", "abc")])
        .unwrap_err()
        .to_string();
    assert!(e.contains("non-negative integer"), "{e}");
}

#[test]
fn kernel_cache_directory() {
    use std::path::PathBuf;
    let dir = |vars: &[(&str, &str)]| with(vars).unwrap().kernel_cache;
    // XDG first, then HOME; relative values are ignored (XDG rules).
    assert_eq!(dir(&[]), None);
    assert_eq!(
        dir(&[("HOME", "/home/u")]),
        Some(PathBuf::from("/home/u/.cache/arx/kernels"))
    );
    assert_eq!(
        dir(&[("HOME", "/home/u"), ("XDG_CACHE_HOME", "/c")]),
        Some(PathBuf::from("/c/arx/kernels"))
    );
    assert_eq!(
        dir(&[("HOME", "/home/u"), ("XDG_CACHE_HOME", "rel")]),
        Some(PathBuf::from("/home/u/.cache/arx/kernels"))
    );
    assert_eq!(dir(&[("HOME", "home")]), None);
    // The variable wins; `off` (any case) turns the cache off; empty is unset.
    assert_eq!(
        dir(&[("HOME", "/home/u"), ("ARX_KERNEL_CACHE", " /scratch/k ")]),
        Some(PathBuf::from("/scratch/k"))
    );
    for off in ["off", "OFF", "0", "no", "None", "false"] {
        assert_eq!(
            dir(&[("HOME", "/home/u"), ("ARX_KERNEL_CACHE", off)]),
            None,
            "{off}"
        );
    }
    // Relative (or unexpanded) paths are refused, naming the variable.
    for bad in ["rel/dir", "~/k", "$HOME/k", "."] {
        refused(
            with(&[("HOME", "/home/u"), ("ARX_KERNEL_CACHE", bad)]),
            "ARX_KERNEL_CACHE",
            bad,
        );
    }
    assert_eq!(
        dir(&[("HOME", "/home/u"), ("ARX_KERNEL_CACHE", "  ")]),
        Some(PathBuf::from("/home/u/.cache/arx/kernels"))
    );
}

/// A binding's names (`Builder::names`) replace the builder's in a refused
/// option's error; a refused variable keeps its own name.
#[test]
fn a_bindings_names_replace_the_builders() {
    fn names(option: &'static str) -> &'static str {
        match option {
            "Builder::timeout" => "binding.timeout",
            other => other,
        }
    }
    let o = Overrides {
        timeout: Some(Duration::ZERO),
        names: Some(names),
        ..Default::default()
    };
    refused(builder(o), "binding.timeout", "0ns");
    let o = Overrides {
        slot_bytes: Some(0),
        names: Some(names),
        ..Default::default()
    };
    refused(builder(o), "Builder::slot_bytes", "0");
    let o = Overrides {
        names: Some(names),
        ..Default::default()
    };
    let env = |k: &str| (k == "ARX_TIMEOUT_MS").then(|| "0".to_string());
    refused(Config::resolve_with(&o, env), "ARX_TIMEOUT_MS", "0");
}
