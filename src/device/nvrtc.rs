//! Run-time compilation of the arx kernels with NVRTC, once per
//! architecture and process, and a CUBIN cache on disk (`ARX_KERNEL_CACHE`)
//! so that a process does not compile what an earlier one did: a compile
//! takes 8-10 s of one CPU core (sm_80, sm_90, sm_121; measured on the build
//! machine's EPYC core with NVRTC 13.0), a cached CUBIN milliseconds.
//! The sources are `kernels/`, embedded in the library; no CUDA headers are
//! needed.

use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};

/// The kernel source and the ABI header it includes.
const SOURCE: &str = include_str!("../../kernels/arx.cu");
/// The headers arx.cu includes (name, text), handed to NVRTC by name.
const HEADERS: [(&std::ffi::CStr, &str); 5] = [
    (c"arx_abi.h", include_str!("../../kernels/arx_abi.h")),
    (c"device.cuh", include_str!("../../kernels/device.cuh")),
    (c"oneshot.cuh", include_str!("../../kernels/oneshot.cuh")),
    (c"twoshot.cuh", include_str!("../../kernels/twoshot.cuh")),
    (c"bcast.cuh", include_str!("../../kernels/bcast.cuh")),
];
/// The kernels the GPU side loads from the module, by name (gpu.rs's
/// `Module::load` keeps this order).
pub(crate) const KERNELS: [&str; 10] = [
    "arx_allreduce_bf16",
    "arx_allreduce_f16",
    "arx_allreduce_f32",
    "arx_convert_check",
    "arx_collective_bf16",
    "arx_collective_f16",
    "arx_collective_f32",
    "arx_broadcast_bf16",
    "arx_broadcast_f16",
    "arx_broadcast_f32",
];
/// Compiled CUBINs, one per architecture, for the whole process (NVRTC takes
/// a few hundred milliseconds per compile).
static CUBINS: Mutex<Vec<(String, Arc<Vec<u8>>)>> = Mutex::new(Vec::new());

fn nvrtc_err(call: &'static str, e: cudarc::nvrtc::result::NvrtcError) -> Error {
    Error::Cuda {
        call,
        detail: format!("{e:?}"),
    }
}

/// NVRTC's options, the same for every architecture but the first.
fn options(arch: &str) -> [String; 4] {
    [
        format!("--gpu-architecture={arch}"),
        "--std=c++17".into(),
        // The summation rule needs IEEE adds: no flush to zero.
        "--ftz=false".into(),
        "--fmad=false".into(),
    ]
}

/// The CUBIN of arx.cu for `arch` (e.g. `sm_90`): compiled once per
/// process; with `disk` (a directory, `ARX_KERNEL_CACHE`) read from there
/// when an earlier process compiled the same sources with the same NVRTC
/// version and options, and written there after a compile. The disk cache
/// never fails a call: anything wrong with it is logged and the kernels are
/// compiled.
pub(crate) fn cubin(arch: &str, disk: Option<&Path>) -> Result<Arc<Vec<u8>>> {
    let mut cache = CUBINS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, c)) = cache.iter().find(|(a, _)| a == arch) {
        return Ok(Arc::clone(c));
    }
    let file = disk.and_then(|d| disk_cache::path(d, arch));
    if let Some(bin) = file.as_deref().and_then(disk_cache::read) {
        log::info!(
            "arx: kernels for {arch} from the cache {} ({} bytes)",
            file.as_deref()
                .map(Path::display)
                .unwrap_or_else(|| Path::new("").display()),
            bin.len()
        );
        let bin = Arc::new(bin);
        cache.push((arch.to_string(), Arc::clone(&bin)));
        return Ok(bin);
    }
    let t0 = std::time::Instant::now();
    let bin = Arc::new(compile(arch)?);
    log::info!(
        "arx: compiled kernels/arx.cu for {arch} in {:.1} s ({} bytes)",
        t0.elapsed().as_secs_f64(),
        bin.len()
    );
    if let Some(f) = &file {
        disk_cache::write(f, &bin);
    }
    cache.push((arch.to_string(), Arc::clone(&bin)));
    Ok(bin)
}

/// Empties the per-process cache (tests: the next call reads the disk
/// cache or compiles, as a new process would).
#[cfg(test)]
fn forget() {
    CUBINS.lock().unwrap_or_else(|e| e.into_inner()).clear();
}

/// Compiles arx.cu for `arch` with NVRTC.
fn compile(arch: &str) -> Result<Vec<u8>> {
    use cudarc::nvrtc::sys as nv;
    let src = CString::new(SOURCE).map_err(|_| Error::InvalidArgument("NUL in arx.cu".into()))?;
    let texts = HEADERS
        .iter()
        .map(|(n, t)| CString::new(*t).map_err(|_| Error::InvalidArgument(format!("NUL in {n:?}"))))
        .collect::<Result<Vec<_>>>()?;
    let name = c"arx.cu";
    let headers: Vec<*const std::ffi::c_char> = texts.iter().map(|t| t.as_ptr()).collect();
    let include_names: Vec<*const std::ffi::c_char> =
        HEADERS.iter().map(|(n, _)| n.as_ptr()).collect();
    let opts: Vec<CString> = options(arch)
        .into_iter()
        .filter_map(|o| CString::new(o).ok())
        .collect();
    let opt_ptrs: Vec<*const std::ffi::c_char> = opts.iter().map(|o| o.as_ptr()).collect();
    let mut prog: nv::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: every pointer is a live NUL-terminated string for the duration
    // of the calls; `prog` is destroyed below on every path.
    unsafe {
        nv::nvrtcCreateProgram(
            &mut prog,
            src.as_ptr(),
            name.as_ptr(),
            headers.len() as i32,
            headers.as_ptr(),
            include_names.as_ptr(),
        )
        .result()
        .map_err(|e| nvrtc_err("nvrtcCreateProgram", e))?;
    }
    // SAFETY: `prog` is a valid program; the option array outlives the call.
    let compiled = unsafe {
        let rc = nv::nvrtcCompileProgram(prog, opt_ptrs.len() as i32, opt_ptrs.as_ptr());
        let log = {
            let mut n = 0usize;
            let _ = nv::nvrtcGetProgramLogSize(prog, &mut n);
            let mut buf = vec![0u8; n.max(1)];
            let _ = nv::nvrtcGetProgramLog(prog, buf.as_mut_ptr().cast());
            String::from_utf8_lossy(&buf)
                .trim_end_matches('\0')
                .trim()
                .to_string()
        };
        match rc.result() {
            Err(e) => Err(Error::Cuda {
                call: "nvrtcCompileProgram",
                detail: format!("{e:?} for {arch}: {log}"),
            }),
            Ok(()) => {
                if !log.is_empty() {
                    log::debug!("arx: NVRTC log for {arch}: {log}");
                }
                let mut n = 0usize;
                nv::nvrtcGetCUBINSize(prog, &mut n)
                    .result()
                    .map_err(|e| nvrtc_err("nvrtcGetCUBINSize", e))
                    .and_then(|()| {
                        let mut bin = vec![0u8; n];
                        nv::nvrtcGetCUBIN(prog, bin.as_mut_ptr().cast())
                            .result()
                            .map_err(|e| nvrtc_err("nvrtcGetCUBIN", e))
                            .map(|()| bin)
                    })
            }
        }
    };
    // SAFETY: destroys the program created above, exactly once.
    unsafe {
        let _ = nv::nvrtcDestroyProgram(&mut prog);
    }
    compiled
}

/// The CUBIN cache on disk: one file per architecture and key, named
/// `arx-<arch>-<key>.cubin`, where the key is a SHA-256 of everything the
/// compile depends on (arx's version, the sources, the options, NVRTC's
/// version). A file holds a magic line, the SHA-256 of the CUBIN and the
/// CUBIN; it is used only if it is this user's, whole and unchanged (so a
/// truncated or altered file is compiled over, never loaded). Files are
/// written under a temporary name and renamed, so ranks compiling at once
/// never see each other's half-written file.
mod disk_cache {
    use super::{options, HEADERS, SOURCE};
    use sha2::{Digest, Sha256};
    use std::io::Write;
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
    use std::path::{Path, PathBuf};

    const MAGIC: &[u8] = b"arx kernel cache 1\n";

    /// The version of the NVRTC library that would compile (`None` when it
    /// cannot be asked: then nothing is cached).
    fn nvrtc_version() -> Option<(i32, i32)> {
        let (mut major, mut minor) = (0, 0);
        // SAFETY: two out-parameters, live for the call.
        unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) }
            .result()
            .ok()
            .map(|()| (major, minor))
    }

    /// The file for `arch` in `dir`; `None` when NVRTC cannot say its version.
    pub(super) fn path(dir: &Path, arch: &str) -> Option<PathBuf> {
        let (major, minor) = nvrtc_version()?;
        let mut h = Sha256::new();
        let mut part = |b: &[u8]| {
            h.update((b.len() as u64).to_le_bytes());
            h.update(b);
        };
        part(env!("CARGO_PKG_VERSION").as_bytes());
        part(format!("nvrtc {major}.{minor}").as_bytes());
        for o in options(arch) {
            part(o.as_bytes());
        }
        part(SOURCE.as_bytes());
        for (name, text) in HEADERS {
            part(name.to_bytes());
            part(text.as_bytes());
        }
        let key: String = h.finalize()[..16]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        Some(dir.join(format!("arx-{arch}-{key}.cubin")))
    }

    /// The cached CUBIN in `file`, if it is there, this user's, and whole.
    pub(super) fn read(file: &Path) -> Option<Vec<u8>> {
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        // Owner and contents from one open file, so that the file checked
        // is the file read.
        let opened = std::fs::File::open(file).and_then(|mut f| {
            let uid = f.metadata()?.uid();
            let mut data = Vec::new();
            std::io::Read::read_to_end(&mut f, &mut data)?;
            Ok((uid, data))
        });
        let data = match opened {
            Ok((uid, data)) if uid == me => data,
            Ok(_) => {
                log::warn!(
                    "arx: kernel cache {} is not this user's; compiling (not loading it)",
                    file.display()
                );
                return None;
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
            Err(e) => {
                log::warn!(
                    "arx: kernel cache {} unreadable ({e}); compiling",
                    file.display()
                );
                return None;
            }
        };
        let body = data.strip_prefix(MAGIC);
        let whole = body.filter(|b| b.len() > 32).and_then(|b| {
            let (sum, bin) = b.split_at(32);
            (Sha256::digest(bin).as_slice() == sum && bin.starts_with(b"\x7fELF")).then_some(bin)
        });
        match whole {
            Some(bin) => Some(bin.to_vec()),
            None => {
                log::warn!(
                    "arx: kernel cache {} is damaged ({} bytes); compiling over it",
                    file.display(),
                    data.len()
                );
                None
            }
        }
    }

    /// Writes `bin` to `file` (creating its directory, this user's only);
    /// a failure is logged, never returned.
    pub(super) fn write(file: &Path, bin: &[u8]) {
        let dir = file.parent().unwrap_or(Path::new("."));
        // A fresh name, created exclusively (never through a link someone
        // left in a shared directory), then renamed over the file.
        let tmp = dir.join(format!(
            ".{}.{}.{:08x}.tmp",
            file.file_name()
                .and_then(|n| n.to_str())
                .unwrap_or("arx.cubin"),
            std::process::id(),
            rand::random::<u32>()
        ));
        let result = std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .and_then(|()| {
                let mut f = std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .open(&tmp)?;
                f.write_all(MAGIC)?;
                f.write_all(&Sha256::digest(bin))?;
                f.write_all(bin)?;
                f.sync_all()
            })
            .and_then(|()| std::fs::rename(&tmp, file));
        match result {
            Ok(()) => log::info!("arx: kernels cached in {}", file.display()),
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                log::warn!(
                    "arx: could not cache the kernels in {} ({e}); the next process compiles them again (ARX_KERNEL_CACHE)",
                    dir.display()
                );
            }
        }
    }
}

/// `ARX_KERNEL_CACHE`'s default from the environment `get` reads:
/// `$XDG_CACHE_HOME/arx/kernels`, else `$HOME/.cache/arx/kernels` (absolute paths only, as
/// the XDG base directory rules say); `None` when neither is set.
pub(crate) fn default_cache_dir(get: impl Fn(&str) -> Option<String>) -> Option<PathBuf> {
    let abs = |v: String| Some(PathBuf::from(v)).filter(|p| p.is_absolute());
    get("XDG_CACHE_HOME")
        .and_then(abs)
        .map(|p| p.join("arx/kernels"))
        .or_else(|| {
            get("HOME")
                .and_then(abs)
                .map(|p| p.join(".cache/arx/kernels"))
        })
}

#[cfg(test)]
mod tests {
    /// Compiles the embedded kernels with NVRTC — the library's own call,
    /// options and sources — for every architecture in `ARX_NVRTC_ARCHS`
    /// (comma-separated; default: sm_80, the oldest arx supports and the
    /// one that takes the written-out conversions; sm_90, the H200; sm_121,
    /// the GB10 of a DGX Spark). Needs libnvrtc and no GPU; ignored by a
    /// plain `cargo test` (CI has no CUDA toolkit): scripts/check-kernels
    /// installs NVRTC from PyPI and runs it with `--ignored`. Writes each
    /// CUBIN to `$ARX_NVRTC_OUT/arx-<arch>.cubin` when that is set, for
    /// cuobjdump to check registers and spills.
    #[test]
    #[ignore = "needs libnvrtc (no GPU); run by scripts/check-kernels"]
    fn kernels_compile_with_nvrtc() {
        assert!(
            // SAFETY: only probes whether the library can be loaded.
            unsafe { cudarc::nvrtc::sys::is_culib_present() },
            "libnvrtc cannot be loaded (LD_LIBRARY_PATH={:?})",
            std::env::var("LD_LIBRARY_PATH").unwrap_or_default()
        );
        let archs =
            std::env::var("ARX_NVRTC_ARCHS").unwrap_or_else(|_| "sm_80,sm_90,sm_121".into());
        let out = std::env::var_os("ARX_NVRTC_OUT").map(std::path::PathBuf::from);
        for arch in archs.split(',').map(str::trim).filter(|a| !a.is_empty()) {
            let t0 = std::time::Instant::now();
            let bin = super::cubin(arch, None).unwrap_or_else(|e| panic!("{arch}: {e}"));
            // An ELF image (a CUBIN), not an empty or PTX result.
            assert!(
                bin.len() > 4096 && bin.starts_with(b"\x7fELF"),
                "{arch}: not a CUBIN ({} bytes)",
                bin.len()
            );
            // Every kernel the GPU side loads is defined in it (a symbol
            // name, NUL-terminated, in the ELF string table).
            for k in super::KERNELS {
                let sym = format!("{k}\0");
                assert!(
                    bin.windows(sym.len()).any(|w| w == sym.as_bytes()),
                    "{arch}: no kernel {k} in the CUBIN"
                );
            }
            // Cached: the second call returns the same image.
            assert!(std::sync::Arc::ptr_eq(
                &bin,
                &super::cubin(arch, None).unwrap()
            ));
            println!(
                "{arch}: {} bytes in {:.0} ms",
                bin.len(),
                t0.elapsed().as_secs_f64() * 1e3
            );
            if let Some(dir) = &out {
                std::fs::write(dir.join(format!("arx-{arch}.cubin")), &bin[..]).unwrap();
            }
        }
        disk_cache(
            archs
                .split(',')
                .map(str::trim)
                .find(|a| !a.is_empty())
                .unwrap(),
        );
    }

    /// The CUBIN cache on disk (`ARX_KERNEL_CACHE`), with `arch` compiled
    /// in this process already: a cached file is what the next process
    /// loads; a damaged file is compiled over; another user's file is not
    /// loaded; a directory that cannot be made fails nothing.
    fn disk_cache(arch: &str) {
        use super::{cubin, disk_cache as dc, forget};
        let real = cubin(arch, None).unwrap();
        let tmp = std::env::temp_dir().join(format!("arx-kcache-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        let dir = tmp.join("a/b");
        let file = dc::path(&dir, arch).expect("NVRTC states its version");
        assert!(file.starts_with(&dir));
        // The key follows the architecture: another one, another file.
        assert_ne!(dc::path(&dir, "sm_75"), Some(file.clone()));

        // A file an earlier process wrote is what this one loads: plant a
        // CUBIN that differs from what NVRTC makes (one byte appended), so
        // that only a read from disk can return it.
        let mut planted = real.to_vec();
        planted.push(0xA5);
        dc::write(&file, &planted);
        let mode = |p: &std::path::Path| {
            use std::os::unix::fs::PermissionsExt;
            std::fs::metadata(p).unwrap().permissions().mode() & 0o777
        };
        assert_eq!((mode(&dir), mode(&file)), (0o700, 0o600));
        forget();
        assert_eq!(
            *cubin(arch, Some(&dir)).unwrap(),
            planted,
            "not read from the cache"
        );

        // Damaged (truncated, then one byte changed): compiled over, and
        // the file is whole again.
        for damage in [0usize, 1] {
            let mut data = std::fs::read(&file).unwrap();
            if damage == 0 {
                data.truncate(data.len() / 2);
            } else {
                let n = data.len();
                data[n - 100] ^= 1;
            }
            std::fs::write(&file, &data).unwrap();
            assert!(dc::read(&file).is_none(), "damage {damage} not seen");
            forget();
            assert_eq!(cubin(arch, Some(&dir)).unwrap(), real, "damage {damage}");
            assert_eq!(dc::read(&file).as_deref(), Some(&real[..]));
        }

        // Another user's file is not loaded (needs root to make one).
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } == 0 {
            dc::write(&file, &planted);
            std::os::unix::fs::chown(&file, Some(65534), None).unwrap();
            assert!(dc::read(&file).is_none(), "another user's file was loaded");
        } else {
            println!("disk cache: another user's file: not checked (needs root)");
        }

        // No directory can be made (a file is in the way): compiled, Ok.
        let blocked = tmp.join("file");
        std::fs::write(&blocked, b"x").unwrap();
        let under = dc::path(&blocked.join("d"), arch).unwrap();
        dc::write(&under, &real);
        assert!(!under.exists());
        forget();
        assert_eq!(cubin(arch, Some(&blocked.join("d"))).unwrap(), real);
        std::fs::remove_dir_all(&tmp).unwrap();
        println!("disk cache: read, damaged (2 ways), not ours, unwritable: as expected");
    }
}
