//! Build script: turns `kernels/arx_abi.h` (the ABI shared with the CUDA kernels)
//! into Rust with bindgen, so that both languages read one definition.

use std::env;
use std::path::PathBuf;

fn main() {
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    println!("cargo:rerun-if-changed=kernels");
    println!("cargo:rerun-if-changed=build.rs");

    bindgen::Builder::default()
        .header("kernels/arx_abi.h")
        .allowlist_type("arx_.*")
        .allowlist_var("ARX_.*")
        .derive_default(true)
        .derive_debug(true)
        .layout_tests(true)
        .use_core()
        .generate()
        .expect("bindgen failed on kernels/arx_abi.h (is libclang installed? apt install libclang1-14 libclang-common-14-dev)")
        .write_to_file(out.join("abi.rs"))
        .expect("cannot write abi.rs");

    hwloc_bindings(&out);
}

// ---------------------------------------------------------------------------
// hwloc: the I/O-object and CPU-kind subset of <hwloc.h> for src/topology/hwloc.rs.
//
// The hwloc2 crate (kept for thread binding) cannot see PCI or OS devices, so
// topology binds the few hwloc calls it needs itself. Only exported functions
// are bound (no static inlines, so no `wrap_static_fns` and no C shim to
// compile). libhwloc is linked through pkg-config; CPU kinds need hwloc 2.4.
// apt: libhwloc-dev (plus libclang for bindgen, as for kernels/arx_abi.h).
// ---------------------------------------------------------------------------
fn hwloc_bindings(out: &std::path::Path) {
    let lib = pkg_config::Config::new()
        .atleast_version("2.4")
        .probe("hwloc")
        .expect("libhwloc >= 2.4 not found by pkg-config (apt install libhwloc-dev pkg-config)");
    let functions = [
        "hwloc_get_api_version",
        "hwloc_topology_init",
        "hwloc_topology_destroy",
        "hwloc_topology_load",
        "hwloc_topology_set_xml",
        "hwloc_topology_set_io_types_filter",
        "hwloc_get_nbobjs_by_depth",
        "hwloc_get_obj_by_depth",
        "hwloc_cpukinds_get_nr",
        "hwloc_cpukinds_get_info",
        "hwloc_bitmap_alloc",
        "hwloc_bitmap_free",
        "hwloc_bitmap_first",
        "hwloc_bitmap_next",
    ];
    let mut b = bindgen::Builder::default()
        .header_contents("arx_hwloc.h", "#include <hwloc.h>\n")
        .clang_args(
            lib.include_paths
                .iter()
                .map(|p| format!("-I{}", p.display())),
        )
        .allowlist_type("hwloc_get_type_depth_e")
        .allowlist_type("hwloc_type_filter_e")
        .allowlist_type("hwloc_obj_osdev_type_e")
        .allowlist_type("hwloc_obj_bridge_type_e")
        .allowlist_var("HWLOC_API_VERSION")
        .prepend_enum_name(false)
        .layout_tests(false)
        .derive_default(false)
        .use_core();
    for f in functions {
        b = b.allowlist_function(f);
    }
    b.generate()
        .expect("bindgen failed on <hwloc.h> (apt install libhwloc-dev libclang1-14 libclang-common-14-dev)")
        .write_to_file(out.join("hwloc_sys.rs"))
        .expect("cannot write hwloc_sys.rs");
}
