//! The shared library's SONAME, the name programs record and the loader
//! looks for (scripts/install links it to the file): `libarx.so.0.<minor>`
//! before 1.0 (Cargo's rule: a 0.x minor release may break the ABI), then
//! `libarx.so.<major>`.

fn main() {
    let v = |k: &str| std::env::var(k).expect("cargo sets the version");
    let (major, minor) = (v("CARGO_PKG_VERSION_MAJOR"), v("CARGO_PKG_VERSION_MINOR"));
    let soname = if major == "0" {
        format!("libarx.so.0.{minor}")
    } else {
        format!("libarx.so.{major}")
    };
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,{soname}");
    println!("cargo:rustc-env=ARX_SONAME={soname}");
    println!("cargo:rerun-if-changed=build.rs");
}
