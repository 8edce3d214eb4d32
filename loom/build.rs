//! Reads the `#define ARX_<NAME> <number>` constants of kernels/arx_abi.h
//! (the one definition of the ABI) into `abi.rs`, as bindgen does for the
//! library (`pub const ARX_<NAME>: u32`), without bindgen and libclang: the
//! model needs only these numbers.

use std::env;
use std::fmt::Write as _;
use std::path::PathBuf;

fn main() {
    let header = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets it"))
        .join("../kernels/arx_abi.h");
    println!("cargo:rerun-if-changed={}", header.display());
    let text = std::fs::read_to_string(&header).expect("cannot read kernels/arx_abi.h");
    let mut out = String::new();
    for line in text.lines() {
        let mut words = line.split_whitespace();
        let (Some("#define"), Some(name), Some(value), None) =
            (words.next(), words.next(), words.next(), words.next())
        else {
            continue;
        };
        if !name.starts_with("ARX_") {
            continue;
        }
        let digits = value.trim_end_matches(['u', 'U']);
        let parsed = match digits.strip_prefix("0x") {
            Some(hex) => u32::from_str_radix(hex, 16),
            None => digits.parse::<u32>(),
        };
        if let Ok(v) = parsed {
            writeln!(out, "pub const {name}: u32 = {v};").unwrap();
        }
    }
    let dst = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("abi.rs");
    std::fs::write(dst, out).expect("cannot write abi.rs");
}
