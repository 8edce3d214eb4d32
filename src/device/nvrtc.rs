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
static CUBINS: Mutex<Vec<(String, Cubin)>> = Mutex::new(Vec::new());

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

/// A compiled module image and where this process got it.
#[derive(Clone)]
pub(crate) struct Cubin {
    pub(crate) image: Arc<Vec<u8>>,
    /// Read from the disk cache (not compiled by this process).
    pub(crate) from_disk: bool,
}

/// The CUBIN of arx.cu for `arch` (e.g. `sm_90`): compiled once per
/// process; with `disk` (a directory, `ARX_KERNEL_CACHE`) read from there
/// when an earlier process compiled the same sources with the same NVRTC
/// and options, and written there after a compile. The disk cache never
/// fails a call: anything wrong with it is logged and the kernels are
/// compiled (and a cached image the driver refuses is compiled anew by
/// the caller, [`recompile`]).
pub(crate) fn cubin(arch: &str, disk: Option<&Path>) -> Result<Cubin> {
    let mut cache = CUBINS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, c)) = cache.iter().find(|(a, _)| a == arch) {
        return Ok(c.clone());
    }
    let entry = disk.and_then(|d| disk_cache::entry(d, arch));
    if let Some(e) = &entry {
        if let Some(bin) = disk_cache::read(e) {
            log::info!(
                "arx: kernels for {arch} from the cache {} ({} bytes)",
                e.file.display(),
                bin.len()
            );
            let c = Cubin {
                image: Arc::new(bin),
                from_disk: true,
            };
            cache.push((arch.to_string(), c.clone()));
            return Ok(c);
        }
    }
    let c = compile_and_keep(arch, entry.as_ref())?;
    cache.push((arch.to_string(), c.clone()));
    Ok(c)
}

/// Compiles `arch` anew, whatever the caches hold, and puts the result in
/// both (the disk cache's file is replaced): for a cached image the driver
/// would not load.
pub(crate) fn recompile(arch: &str, disk: Option<&Path>) -> Result<Cubin> {
    let mut cache = CUBINS.lock().unwrap_or_else(|e| e.into_inner());
    let entry = disk.and_then(|d| disk_cache::entry(d, arch));
    let c = compile_and_keep(arch, entry.as_ref())?;
    cache.retain(|(a, _)| a != arch);
    cache.push((arch.to_string(), c.clone()));
    Ok(c)
}

fn compile_and_keep(arch: &str, entry: Option<&disk_cache::Entry>) -> Result<Cubin> {
    let t0 = std::time::Instant::now();
    let bin = compile(arch)?;
    log::info!(
        "arx: compiled kernels/arx.cu for {arch} in {:.1} s ({} bytes)",
        t0.elapsed().as_secs_f64(),
        bin.len()
    );
    if let Some(e) = entry {
        disk_cache::write(e, &bin);
    }
    Ok(Cubin {
        image: Arc::new(bin),
        from_disk: false,
    })
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
/// version and the library file it was loaded from). A file holds a magic
/// line, the whole key, the SHA-256 of the CUBIN and the CUBIN; it is used
/// only if the directory is this user's and not writable by others, the
/// file is a regular file (not a link, not a FIFO) of this user's, not
/// writable by others, at most 64 MiB, and its key and hash agree. So a
/// truncated, altered, renamed or planted file is compiled over, never
/// loaded. Files are written under a fresh name, created exclusively, and
/// renamed, so ranks compiling at once never see each other's half-written
/// file. An architecture keeps its KEEP_PER_ARCH most recently used files
/// and any used within IN_USE (`prune`).
mod disk_cache {
    use super::{options, HEADERS, SOURCE};
    use sha2::{Digest, Sha256};
    use std::io::{Read, Write};
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
    use std::path::{Path, PathBuf};

    const MAGIC: &[u8] = b"arx kernel cache 2\n";
    /// Far above any CUBIN of arx (about 1 MB), far below harm.
    const MAX_BYTES: u64 = 64 << 20;
    /// A writer's temporary file older than this is a leftover (the
    /// writer died between create and rename) and is removed.
    const STALE_TMP: std::time::Duration = std::time::Duration::from_secs(3600);
    /// Files kept per architecture (about 1 MB each): other keys' files
    /// (older arx versions, another NVRTC) beyond the newest this many
    /// are removed when a new one is written, unless used within
    /// IN_USE. A file in use is kept: each load renews its modification
    /// time (at most once an hour).
    const KEEP_PER_ARCH: usize = 4;
    /// A file loaded within this long (its time renewed within twice
    /// RENEW_AFTER) is never removed, however many others are newer.
    const IN_USE: std::time::Duration = std::time::Duration::from_secs(2 * 3600);
    /// How stale a loaded file's modification time may grow before a load
    /// renews it (so that many ranks starting at once do not all write
    /// the file's metadata).
    const RENEW_AFTER: std::time::Duration = std::time::Duration::from_secs(3600);

    /// Where one architecture's CUBIN lives, and the key its file must hold.
    pub(super) struct Entry {
        pub(super) file: PathBuf,
        key: [u8; 32],
    }

    #[cfg(test)]
    impl Entry {
        pub(crate) fn for_test(file: PathBuf, key: [u8; 32]) -> Self {
            Entry { file, key }
        }
    }

    fn me() -> u32 {
        // SAFETY: geteuid has no preconditions.
        unsafe { libc::geteuid() }
    }

    /// NVRTC's version (major.minor: it reports no patch level) and the
    /// file the process loaded it from, with its size and modification
    /// time, so that an updated libnvrtc makes a new key. `None` when the
    /// version cannot be asked (then nothing is cached).
    pub(super) fn nvrtc_identity() -> Option<String> {
        let (mut major, mut minor) = (0, 0);
        // SAFETY: two out-parameters, live for the call.
        unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) }
            .result()
            .ok()?;
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
        let lib = maps
            .lines()
            .filter_map(|l| l.split_whitespace().nth(5))
            .find(|p| {
                let name = p.rsplit('/').next().unwrap_or("");
                name.starts_with("libnvrtc.so") || name.starts_with("libnvrtc64")
            })
            .map(|p| match std::fs::metadata(p) {
                Ok(m) => format!("{p} {} {}.{}", m.len(), m.mtime(), m.mtime_nsec()),
                Err(_) => p.to_string(),
            })
            .unwrap_or_default();
        Some(format!("nvrtc {major}.{minor} {lib}"))
    }

    /// The entry for `arch` in `dir`; `None` when NVRTC cannot say its
    /// version.
    pub(super) fn entry(dir: &Path, arch: &str) -> Option<Entry> {
        let nvrtc = nvrtc_identity()?;
        let mut h = Sha256::new();
        let mut part = |b: &[u8]| {
            h.update((b.len() as u64).to_le_bytes());
            h.update(b);
        };
        part(env!("CARGO_PKG_VERSION").as_bytes());
        part(nvrtc.as_bytes());
        for o in options(arch) {
            part(o.as_bytes());
        }
        part(SOURCE.as_bytes());
        for (name, text) in HEADERS {
            part(name.to_bytes());
            part(text.as_bytes());
        }
        let key: [u8; 32] = h.finalize().into();
        let hex: String = key[..16].iter().map(|b| format!("{b:02x}")).collect();
        Some(Entry {
            file: dir.join(format!("arx-{arch}-{hex}.cubin")),
            key,
        })
    }

    /// Whether `dir` may hold cached kernels: this user's, and writable by
    /// no one else (a directory others can write to lets them plant or
    /// swap files). `Ok(false)`: it does not exist.
    fn dir_ok(dir: &Path) -> std::result::Result<bool, String> {
        match std::fs::metadata(dir) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(e.to_string()),
            Ok(m) if !m.is_dir() => Err("not a directory".into()),
            Ok(m) if m.uid() != me() => Err(format!("owned by uid {}, not this user", m.uid())),
            Ok(m) if m.permissions().mode() & 0o022 != 0 => Err(format!(
                "writable by group or others (mode {:o}); chmod go-w it",
                m.permissions().mode() & 0o7777
            )),
            Ok(_) => Ok(true),
        }
    }

    /// The cached CUBIN for `e`, if it is there and passes every check.
    pub(super) fn read(e: &Entry) -> Option<Vec<u8>> {
        let file = &e.file;
        let dir = file.parent().unwrap_or(Path::new("."));
        match dir_ok(dir) {
            Ok(true) => {}
            Ok(false) => return None,
            Err(why) => {
                log::warn!(
                    "arx: kernel cache {} not used: {why}; compiling",
                    dir.display()
                );
                return None;
            }
        }
        // Not through a symbolic link, and without blocking on a FIFO;
        // owner, type and contents from the one open file.
        let opened = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(file)
            .and_then(|mut f| {
                let m = f.metadata()?;
                let mut data = Vec::new();
                if m.is_file() && m.len() <= MAX_BYTES {
                    (&mut f).take(MAX_BYTES + 1).read_to_end(&mut data)?;
                }
                Ok((f, m, data))
            });
        let (f, m, data) = match opened {
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => return None,
            Err(err) => {
                log::warn!(
                    "arx: kernel cache {} unreadable ({err}); compiling",
                    file.display()
                );
                return None;
            }
            Ok((f, m, data)) => {
                let why = if !m.is_file() {
                    Some("not a regular file".to_string())
                } else if m.uid() != me() {
                    Some(format!("owned by uid {}, not this user", m.uid()))
                } else if m.permissions().mode() & 0o022 != 0 {
                    Some("writable by group or others".to_string())
                } else if m.len() > MAX_BYTES || data.len() as u64 > MAX_BYTES {
                    Some(format!("larger than {MAX_BYTES} bytes"))
                } else {
                    None
                };
                if let Some(why) = why {
                    log::warn!(
                        "arx: kernel cache {} not loaded ({why}); compiling",
                        file.display()
                    );
                    return None;
                }
                (f, m, data)
            }
        };
        let whole = data
            .strip_prefix(MAGIC)
            .filter(|b| b.len() > 64)
            .and_then(|b| {
                let (key, rest) = b.split_at(32);
                let (sum, bin) = rest.split_at(32);
                (key == e.key
                    && Sha256::digest(bin).as_slice() == sum
                    && bin.starts_with(b"\x7fELF"))
                .then_some(bin)
            });
        match whole {
            Some(bin) => {
                // In use: renew the time the pruning in `write` goes by.
                let stale = m
                    .modified()
                    .ok()
                    .and_then(|t| t.elapsed().ok())
                    .map_or(true, |age| age > RENEW_AFTER);
                if stale {
                    let _ = f.set_modified(std::time::SystemTime::now());
                }
                Some(bin.to_vec())
            }
            None => {
                log::warn!(
                    "arx: kernel cache {} is damaged or not this key's ({} bytes); compiling over it",
                    file.display(),
                    data.len()
                );
                None
            }
        }
    }

    /// Removes writers' temporary files in `dir` older than STALE_TMP.
    fn sweep(dir: &Path) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for d in entries.flatten() {
            let name = d.file_name();
            let name = name.to_string_lossy();
            if !(name.starts_with(".arx-") && name.ends_with(".tmp")) {
                continue;
            }
            let old = d
                .metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.elapsed().ok())
                .is_some_and(|age| age > STALE_TMP);
            if old {
                let _ = std::fs::remove_file(d.path());
            }
        }
    }

    /// The architecture in a cache file's name `arx-<arch>-<32 hex>.cubin`
    /// (the names `entry` makes); `None` for any other name.
    fn arch_of(name: &str) -> Option<&str> {
        let stem = name.strip_prefix("arx-")?.strip_suffix(".cubin")?;
        let (arch, hex) = stem.rsplit_once('-')?;
        let lower_hex = |b: u8| b.is_ascii_digit() || (b'a'..=b'f').contains(&b);
        (!arch.is_empty() && hex.len() == 32 && hex.bytes().all(lower_hex)).then_some(arch)
    }

    /// Whether `path` is one of this user's cache files: a regular file
    /// (not followed through a link) of this user's that starts with
    /// MAGIC. Its modification time when it is.
    fn ours(path: &Path) -> Option<std::time::SystemTime> {
        let mut f = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(path)
            .ok()?;
        let m = f.metadata().ok()?;
        let mut head = [0u8; MAGIC.len()];
        (m.is_file() && m.uid() == me() && f.read_exact(&mut head).is_ok() && head == MAGIC)
            .then_some(())?;
        m.modified().ok()
    }

    /// Keeps the newest KEEP_PER_ARCH files of `kept`'s architecture in
    /// `dir` (by modification time, `kept` always among them; a time in
    /// the future counts as the oldest) and every file used within
    /// IN_USE, and removes the rest: only this user's cache files (`ours`)
    /// with the names `entry` makes. A process that opened a removed file
    /// still reads it whole; one that had not compiles again.
    fn prune(dir: &Path, kept: &Path) {
        let Some(arch) = kept.file_name().and_then(|n| n.to_str()).and_then(arch_of) else {
            return;
        };
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        let mut others: Vec<(std::time::SystemTime, PathBuf)> = entries
            .flatten()
            .filter(|d| {
                let name = d.file_name();
                name.to_str().and_then(arch_of) == Some(arch) && d.path() != kept
            })
            .filter_map(|d| Some((ours(&d.path())?, d.path())))
            .collect();
        let now = std::time::SystemTime::now();
        // Newest first; a time in the future (copied with its times, a
        // skewed clock) last: a load sets it to now.
        others.sort_by_key(|(t, _)| std::cmp::Reverse((*t <= now).then_some(*t)));
        for (t, p) in others.iter().skip(KEEP_PER_ARCH - 1) {
            let in_use = now.duration_since(*t).is_ok_and(|age| age < IN_USE);
            if !in_use && std::fs::remove_file(p).is_ok() {
                log::info!(
                    "arx: kernel cache: removed {} (unused the longest)",
                    p.display()
                );
            }
        }
    }

    /// Writes `bin` for `e` (creating its directory, this user's only),
    /// then prunes the architecture's older files; a failure is logged,
    /// never returned.
    pub(super) fn write(e: &Entry, bin: &[u8]) {
        let file = &e.file;
        let dir = file.parent().unwrap_or(Path::new("."));
        if let Err(err) = std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
        {
            log::warn!(
                "arx: could not make the kernel cache {} ({err}); the next process compiles again (ARX_KERNEL_CACHE)",
                dir.display()
            );
            return;
        }
        if let Err(why) = dir_ok(dir) {
            log::warn!(
                "arx: kernel cache {} not used: {why}; the next process compiles again (ARX_KERNEL_CACHE)",
                dir.display()
            );
            return;
        }
        sweep(dir);
        // A fresh name, created exclusively and never through a link, then
        // renamed over the file.
        let tmp = dir.join(format!(
            ".{}.{}.{:08x}.tmp",
            file.file_name()
                .and_then(|n| n.to_str())
                .unwrap_or("arx.cubin"),
            std::process::id(),
            rand::random::<u32>()
        ));
        let result = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&tmp)
            .and_then(|mut f| {
                f.write_all(MAGIC)?;
                f.write_all(&e.key)?;
                f.write_all(&Sha256::digest(bin))?;
                f.write_all(bin)?;
                f.sync_all()
            })
            .and_then(|()| std::fs::rename(&tmp, file));
        match result {
            Ok(()) => {
                log::info!("arx: kernels cached in {}", file.display());
                prune(dir, file);
            }
            Err(err) => {
                let _ = std::fs::remove_file(&tmp);
                log::warn!(
                    "arx: could not cache the kernels in {} ({err}); the next process compiles again (ARX_KERNEL_CACHE)",
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
    /// (comma-separated; default: sm_75, the oldest NVRTC 13 compiles for;
    /// sm_90, the H200; sm_121, the GB10 of a DGX Spark). Needs libnvrtc and no GPU; ignored by a
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
            std::env::var("ARX_NVRTC_ARCHS").unwrap_or_else(|_| "sm_75,sm_90,sm_121".into());
        let out = std::env::var_os("ARX_NVRTC_OUT").map(std::path::PathBuf::from);
        for arch in archs.split(',').map(str::trim).filter(|a| !a.is_empty()) {
            let t0 = std::time::Instant::now();
            let bin = super::cubin(arch, None)
                .unwrap_or_else(|e| panic!("{arch}: {e}"))
                .image;
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
                &super::cubin(arch, None).unwrap().image
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
            std::env::var("ARX_NVRTC_CACHE_CASES").as_deref() != Ok("0"),
        );
    }

    /// The CUBIN cache as the library uses it, with `arch` compiled in
    /// this process already: a file an earlier process wrote is what the
    /// next one loads (planted: a CUBIN NVRTC would not make), `recompile`
    /// replaces it (the driver-refused case), a damaged file is compiled
    /// over, and a directory that cannot be made fails nothing. Without
    /// `compiles` (`ARX_NVRTC_CACHE_CASES=0`: scripts/test-aarch64, where
    /// NVRTC runs emulated, a minute a compile) the cases that compile
    /// again are left out.
    fn disk_cache(arch: &str, compiles: bool) {
        use super::{cubin, disk_cache as dc, forget, recompile};
        // The key holds the libnvrtc file this process loaded.
        let id = dc::nvrtc_identity().expect("NVRTC states its version");
        let lib = id.split_whitespace().nth(2).unwrap_or("");
        assert!(
            lib.contains("libnvrtc") && std::path::Path::new(lib).is_file(),
            "the kernel cache's key names no libnvrtc file: {id}"
        );
        println!("disk cache key: {id}");
        let real = cubin(arch, None).unwrap().image;
        let tmp = std::env::temp_dir().join(format!("arx-kcache-nvrtc-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        let dir = tmp.join("a/b");
        let e = dc::entry(&dir, arch).expect("NVRTC states its version");
        assert!(e.file.starts_with(&dir));
        let other = if arch == "sm_75" { "sm_86" } else { "sm_75" };
        assert_ne!(dc::entry(&dir, other).unwrap().file, e.file);

        let mut planted = real.to_vec();
        planted.push(0xA5);
        dc::write(&e, &planted);
        forget();
        let t0 = std::time::Instant::now();
        let got = cubin(arch, Some(&dir)).unwrap();
        let read_ms = t0.elapsed().as_secs_f64() * 1e3;
        assert!(
            got.from_disk && *got.image == planted,
            "not read from the cache"
        );
        if !compiles {
            std::fs::remove_dir_all(&tmp).unwrap();
            println!("disk cache: read ({arch} in {read_ms:.1} ms); the cases that compile again not run here (ARX_NVRTC_CACHE_CASES=0)");
            return;
        }
        // The driver would refuse it: compiled anew, in both caches.
        let again = recompile(arch, Some(&dir)).unwrap();
        assert!(!again.from_disk && again.image == real);
        assert!(std::sync::Arc::ptr_eq(
            &cubin(arch, Some(&dir)).unwrap().image,
            &again.image
        ));
        assert_eq!(dc::read(&e).as_deref(), Some(&real[..]));

        // Damaged: compiled over, and the file is whole again.
        let mut data = std::fs::read(&e.file).unwrap();
        data.truncate(data.len() / 2);
        std::fs::write(&e.file, &data).unwrap();
        forget();
        let c = cubin(arch, Some(&dir)).unwrap();
        assert!(!c.from_disk && c.image == real);
        assert_eq!(dc::read(&e).as_deref(), Some(&real[..]));

        // No directory can be made (a file is in the way): compiled, Ok.
        let blocked = tmp.join("file");
        std::fs::write(&blocked, b"x").unwrap();
        forget();
        assert_eq!(cubin(arch, Some(&blocked.join("d"))).unwrap().image, real);
        std::fs::remove_dir_all(&tmp).unwrap();
        println!("disk cache: read ({arch} in {read_ms:.1} ms), recompiled over, damaged, unwritable: as expected");
    }
}

/// The disk cache's checks, with planted files (no NVRTC, no compile).
#[cfg(test)]
mod disk_cache_tests {
    use super::disk_cache::{self as dc, Entry};
    use std::os::unix::fs::PermissionsExt;
    use std::path::{Path, PathBuf};

    /// A fresh private directory for one test.
    fn fresh(name: &str) -> PathBuf {
        let d = std::env::temp_dir()
            .join(format!("arx-kcache-{}-{name}", std::process::id()))
            .join("k");
        let _ = std::fs::remove_dir_all(d.parent().unwrap());
        std::fs::DirBuilder::new()
            .recursive(true)
            .create(&d)
            .unwrap();
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700)).unwrap();
        d
    }
    fn done(d: &Path) {
        let _ = std::fs::remove_dir_all(d.parent().unwrap());
    }
    /// A CUBIN-like image: ELF magic and a seeded body.
    fn image(seed: u8, n: usize) -> Vec<u8> {
        let mut v = b"\x7fELF".to_vec();
        v.extend((0..n).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)));
        v
    }
    fn entry(dir: &Path, name: &str, key: u8) -> Entry {
        Entry::for_test(dir.join(name), [key; 32])
    }

    #[test]
    fn written_then_read_back_and_modes() {
        let d = fresh("rw");
        let sub = d.join("x/y");
        let e = entry(&sub, "a.cubin", 1);
        let img = image(1, 5000);
        dc::write(&e, &img);
        assert_eq!(dc::read(&e).as_deref(), Some(&img[..]));
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(
            (mode(&d.join("x")), mode(&sub), mode(&e.file)),
            (0o700, 0o700, 0o600)
        );
        // Nothing else left in the directory (the temporary was renamed).
        assert_eq!(std::fs::read_dir(&sub).unwrap().count(), 1);
        done(&d);
    }

    #[test]
    fn another_keys_file_is_not_loaded() {
        // A file renamed, copied or linked to another key's name.
        let d = fresh("key");
        let a = entry(&d, "a.cubin", 1);
        let b = entry(&d, "b.cubin", 2);
        dc::write(&a, &image(1, 3000));
        std::fs::copy(&a.file, &b.file).unwrap();
        assert!(dc::read(&b).is_none());
        std::fs::remove_file(&b.file).unwrap();
        std::os::unix::fs::symlink(&a.file, &b.file).unwrap();
        assert!(dc::read(&b).is_none());
        assert!(dc::read(&a).is_some());
        done(&d);
    }

    #[test]
    fn a_link_to_the_right_file_is_not_followed() {
        let d = fresh("link");
        let a = entry(&d, "a.cubin", 1);
        dc::write(&a, &image(1, 3000));
        let l = entry(&d, "l.cubin", 1);
        std::os::unix::fs::symlink(&a.file, &l.file).unwrap();
        assert!(dc::read(&l).is_none(), "read through a link");
        done(&d);
    }

    #[test]
    fn damaged_or_odd_files_are_not_loaded() {
        let d = fresh("odd");
        let e = entry(&d, "a.cubin", 1);
        let img = image(1, 4000);
        dc::write(&e, &img);
        let whole = std::fs::read(&e.file).unwrap();
        let mut cases: Vec<(&str, Vec<u8>)> = vec![
            ("empty", vec![]),
            ("magic only", whole[..19].to_vec()),
            ("truncated", whole[..whole.len() - 1].to_vec()),
            ("one byte longer", [&whole[..], b"x"].concat()),
        ];
        let mut flipped = whole.clone();
        let n = flipped.len();
        flipped[n - 7] ^= 0x10;
        cases.push(("a bit flipped", flipped));
        // Right key and hash, but not an ELF image.
        let mut not_elf = whole.clone();
        not_elf.truncate(19 + 32);
        let body = b"not an ELF image at all".to_vec();
        {
            use sha2::{Digest, Sha256};
            not_elf.extend_from_slice(&Sha256::digest(&body));
        }
        not_elf.extend_from_slice(&body);
        cases.push(("not ELF", not_elf));
        for (what, bytes) in cases {
            std::fs::write(&e.file, &bytes).unwrap();
            assert!(dc::read(&e).is_none(), "{what} was loaded");
        }
        // A directory, and a FIFO (which must not block), at the name.
        std::fs::remove_file(&e.file).unwrap();
        std::fs::create_dir(&e.file).unwrap();
        assert!(dc::read(&e).is_none());
        std::fs::remove_dir(&e.file).unwrap();
        let c = std::ffi::CString::new(e.file.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let (tx, rx) = std::sync::mpsc::channel();
        let f = entry(&d, "a.cubin", 1);
        std::thread::spawn(move || tx.send(dc::read(&f).is_none()).unwrap());
        assert_eq!(
            rx.recv_timeout(std::time::Duration::from_secs(20)),
            Ok(true),
            "a FIFO blocked or was loaded"
        );
        // Larger than the cap: refused without reading it.
        std::fs::remove_file(&e.file).unwrap();
        let big = std::fs::File::create(&e.file).unwrap();
        big.set_len((64 << 20) + 1).unwrap();
        assert!(dc::read(&e).is_none());
        done(&d);
    }

    #[test]
    fn writable_or_foreign_places_are_not_used() {
        let d = fresh("perm");
        let e = entry(&d, "a.cubin", 1);
        let img = image(1, 3000);
        dc::write(&e, &img);
        // The directory writable by others: neither read nor written.
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o777)).unwrap();
        assert!(dc::read(&e).is_none());
        let e2 = entry(&d, "b.cubin", 2);
        dc::write(&e2, &img);
        assert!(!e2.file.exists());
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700)).unwrap();
        // The file writable by others.
        std::fs::set_permissions(&e.file, std::fs::Permissions::from_mode(0o666)).unwrap();
        assert!(dc::read(&e).is_none());
        std::fs::set_permissions(&e.file, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(dc::read(&e).is_some());
        // Another user's file or directory (only root can make one).
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } == 0 {
            std::os::unix::fs::chown(&e.file, Some(65534), None).unwrap();
            assert!(dc::read(&e).is_none(), "another user's file was loaded");
            std::os::unix::fs::chown(&e.file, Some(0), None).unwrap();
            std::os::unix::fs::chown(&d, Some(65534), None).unwrap();
            assert!(dc::read(&e).is_none(), "read from another user's directory");
            std::os::unix::fs::chown(&d, Some(0), None).unwrap();
            assert!(dc::read(&e).is_some());
        } else {
            println!("another user's file and directory: not checked (needs root)");
        }
        done(&d);
    }

    #[test]
    fn a_dead_writers_temporary_is_swept() {
        let d = fresh("sweep");
        let stale = d.join(".arx-sm_90-0.cubin.1.00000000.tmp");
        let fresh_tmp = d.join(".arx-sm_90-0.cubin.2.00000000.tmp");
        let other = d.join(".keep.tmp");
        for p in [&stale, &fresh_tmp, &other] {
            std::fs::write(p, b"x").unwrap();
        }
        let two_hours_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(7200);
        for p in [&stale, &other] {
            std::fs::File::options()
                .write(true)
                .open(p)
                .unwrap()
                .set_modified(two_hours_ago)
                .unwrap();
        }
        dc::write(&entry(&d, "a.cubin", 1), &image(1, 100));
        assert!(!stale.exists() && fresh_tmp.exists() && other.exists());
        done(&d);
    }

    #[test]
    fn an_archs_older_files_are_pruned_and_files_in_use_kept() {
        let d = fresh("prune");
        let name = |arch: &str, i: u32| format!("arx-{arch}-{i:032x}.cubin");
        let now = std::time::SystemTime::now();
        let set_time = |p: &Path, t: std::time::SystemTime| {
            std::fs::File::options()
                .write(true)
                .open(p)
                .unwrap()
                .set_modified(t)
                .unwrap()
        };
        let ago = |secs: u64| now - std::time::Duration::from_secs(secs);
        let mtime = |p: &Path| std::fs::symlink_metadata(p).unwrap().modified().unwrap();
        const MIN: u64 = 60;
        const DAY: u64 = 86_400;
        // Whole cache files of sm_90, written then dated: a (7 days, loaded
        // below), b1-b3 (10 minutes), u (50 minutes: loaded then, so not
        // renewed since), o1, o2 (3 and 2 days), f (a year ahead).
        let file = |tag: u32| d.join(name("sm_90", tag));
        let (a, b1, b2, b3, u, o1, o2, f) = (0xa, 0xb1, 0xb2, 0xb3, 0x0, 0x1, 0x2, 0xf);
        // Written first (just written means in use, so no write prunes
        // another here), dated after.
        for t in [a, b1, b2, b3, u, o1, o2, f] {
            dc::write(
                &entry(&d, &name("sm_90", t), t as u8),
                &image(t as u8, 2000),
            );
        }
        set_time(&file(a), ago(7 * DAY));
        for b in [b1, b2, b3] {
            set_time(&file(b), ago(10 * MIN));
        }
        set_time(&file(u), ago(50 * MIN));
        set_time(&file(o1), ago(3 * DAY));
        set_time(&file(o2), ago(2 * DAY));
        set_time(&file(f), now + std::time::Duration::from_secs(365 * DAY));
        // Never removed, however old: another architecture's file, other
        // names (upper-case hex, not hex, not ours), a file with an entry's
        // name but not the cache's contents, a link, a directory.
        let kept_always: Vec<PathBuf> = vec![
            d.join(name("sm_121", 1)),
            d.join(format!("arx-sm_90-{}.cubin", "AB".repeat(16))),
            d.join("arx-sm_90-notahash.cubin"),
            d.join("notes.txt"),
            file(0xc),
        ];
        for (i, p) in kept_always.iter().enumerate() {
            if i < 2 {
                dc::write(&Entry::for_test(p.clone(), [9; 32]), &image(9, 100));
            } else {
                std::fs::write(p, image(9, 100)).unwrap();
            }
            set_time(p, ago(30 * DAY));
        }
        let link = file(0xd);
        std::os::unix::fs::symlink(file(o1), &link).unwrap();
        let a_dir = file(0xe);
        std::fs::create_dir(&a_dir).unwrap();

        // A load renews a stale time, and leaves a recent one alone.
        let ea = entry(&d, &name("sm_90", a), a as u8);
        assert!(dc::read(&ea).is_some());
        assert!(mtime(&ea.file) > ago(60), "a load did not renew the time");
        set_time(&ea.file, ago(10 * MIN));
        assert!(dc::read(&ea).is_some());
        assert_eq!(
            mtime(&ea.file),
            ago(10 * MIN),
            "a recent time was rewritten"
        );
        set_time(&ea.file, ago(MIN));

        // A new file n: the 3 newest others stay (a, b1, b2 or b3), and so
        // does every file used within two hours (b1-b3, u); o1, o2 and the
        // future-dated f go.
        let n = 0x11;
        dc::write(
            &entry(&d, &name("sm_90", n), n as u8),
            &image(n as u8, 2000),
        );
        let present = |tags: &[u32]| tags.iter().map(|&t| file(t).exists()).collect::<Vec<_>>();
        assert_eq!(
            present(&[n, a, b1, b2, b3, u, o1, o2, f]),
            [true, true, true, true, true, true, false, false, false],
            "after n: n a b1 b2 b3 u o1 o2 f"
        );
        // All of them days old now: n2 keeps the 3 newest (a, b1, b2).
        for (i, t) in [a, b1, b2, b3, u, n].into_iter().enumerate() {
            set_time(&file(t), ago((i as u64 + 1) * DAY));
        }
        let n2 = 0x12;
        dc::write(
            &entry(&d, &name("sm_90", n2), n2 as u8),
            &image(n2 as u8, 2000),
        );
        assert_eq!(
            present(&[n2, a, b1, b2, b3, u, n]),
            [true, true, true, true, false, false, false],
            "after n2: n2 a b1 b2 b3 u n"
        );
        assert!(dc::read(&ea).is_some());
        for p in kept_always.iter().chain([&a_dir]) {
            assert!(p.exists(), "{} removed", p.display());
        }
        assert!(
            std::fs::symlink_metadata(&link).is_ok(),
            "a link was removed"
        );
        // A name of another pattern (the unit tests' own) prunes nothing.
        set_time(&file(b1), ago(30 * DAY));
        dc::write(&entry(&d, "a.cubin", 3), &image(3, 100));
        assert!(file(b1).exists());
        done(&d);
    }

    #[test]
    fn racing_writers_and_readers_see_whole_files_only() {
        let d = fresh("race");
        let imgs: Vec<Vec<u8>> = (0..4)
            .map(|i| image(i, 20_000 + 3_000 * i as usize))
            .collect();
        std::thread::scope(|s| {
            for img in &imgs {
                let e = entry(&d, "a.cubin", 1);
                s.spawn(move || {
                    for _ in 0..40 {
                        dc::write(&e, img);
                    }
                });
            }
            for _ in 0..2 {
                let e = entry(&d, "a.cubin", 1);
                let imgs = &imgs;
                s.spawn(move || {
                    for _ in 0..200 {
                        if let Some(got) = dc::read(&e) {
                            assert!(imgs.contains(&got), "a partial or mixed file was loaded");
                        }
                    }
                });
            }
        });
        let got = dc::read(&entry(&d, "a.cubin", 1)).unwrap();
        assert!(imgs.contains(&got));
        assert_eq!(
            std::fs::read_dir(&d).unwrap().count(),
            1,
            "temporaries left"
        );
        done(&d);
    }
}
