//! Build script: turns `kernels/arx.h` (the ABI shared with the CUDA kernels)
//! into Rust with bindgen, so that both languages read one definition.

use std::env;
use std::path::PathBuf;

fn main() {
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    println!("cargo:rerun-if-changed=kernels/arx.h");
    println!("cargo:rerun-if-changed=kernels/arx.cu");
    println!("cargo:rerun-if-changed=build.rs");

    bindgen::Builder::default()
        .header("kernels/arx.h")
        .allowlist_type("arx_.*")
        .allowlist_var("ARX_.*")
        .derive_default(true)
        .derive_debug(true)
        .layout_tests(true)
        .use_core()
        .generate()
        .expect("bindgen failed on kernels/arx.h (is libclang installed? apt install libclang1-14 libclang-common-14-dev)")
        .write_to_file(out.join("abi.rs"))
        .expect("cannot write abi.rs");
}
