//! Run-time compilation of the arx kernels with NVRTC, once per
//! architecture and process (a compile takes a few hundred milliseconds).
//! The sources are `kernels/`, embedded in the library; no CUDA headers are
//! needed.

use std::ffi::CString;
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
/// Compiled CUBINs, one per architecture, for the whole process (NVRTC takes
/// a few hundred milliseconds per compile).
static CUBINS: Mutex<Vec<(String, Arc<Vec<u8>>)>> = Mutex::new(Vec::new());

fn nvrtc_err(call: &'static str, e: cudarc::nvrtc::result::NvrtcError) -> Error {
    Error::Cuda {
        call,
        detail: format!("{e:?}"),
    }
}

/// Compiles arx.cu for `arch` (e.g. `sm_90`), once per process.
pub(crate) fn cubin(arch: &str) -> Result<Arc<Vec<u8>>> {
    let mut cache = CUBINS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, c)) = cache.iter().find(|(a, _)| a == arch) {
        return Ok(Arc::clone(c));
    }
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
    let opts: Vec<CString> = [
        format!("--gpu-architecture={arch}"),
        "--std=c++17".into(),
        // The summation rule needs IEEE adds: no flush to zero.
        "--ftz=false".into(),
        "--fmad=false".into(),
    ]
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
    let bin = Arc::new(compiled?);
    log::info!(
        "arx: compiled kernels/arx.cu for {arch} ({} bytes)",
        bin.len()
    );
    cache.push((arch.to_string(), Arc::clone(&bin)));
    Ok(bin)
}
