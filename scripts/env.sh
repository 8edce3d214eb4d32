# Sourced by the scripts: Rust on PATH, and mpirun allowed as root (CI runs
# as root; Open MPI refuses root unless told).
if [ -f "$HOME/.cargo/env" ]; then . "$HOME/.cargo/env"; fi
if [ "$(id -u)" = 0 ]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
# Quiet Open MPI about transports a laptop or CI machine does not have.
export OMPI_MCA_btl=${OMPI_MCA_btl:-self,vader,tcp}
export CARGO_TERM_COLOR=${CARGO_TERM_COLOR:-never}
# CUDA's libraries that arx loads at run time by name (NVRTC; libcuda comes
# with the driver, on the loader's path). The toolkit keeps them under
# targets/<platform>/lib: sbsa-linux on arm64 servers and DGX OS (Ubuntu
# 24.04 on the Spark), aarch64-linux on Jetson, x86_64-linux on x86. Add that
# directory when the loader's cache does not already list libnvrtc.
case "$(uname -m)" in
    aarch64) arx_cuda_platforms="sbsa-linux aarch64-linux" ;;
    x86_64) arx_cuda_platforms="x86_64-linux" ;;
    *) arx_cuda_platforms="" ;;
esac
if ! { command -v ldconfig >/dev/null && ldconfig -p 2>/dev/null | grep 'libnvrtc\.so' >/dev/null; }; then
    for arx_p in $arx_cuda_platforms; do
        arx_d=${CUDA_HOME:-/usr/local/cuda}/targets/$arx_p/lib
        if ls "$arx_d"/libnvrtc.so* >/dev/null 2>&1; then
            case ":${LD_LIBRARY_PATH:-}:" in
                *":$arx_d:"*) ;;
                *) export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$arx_d ;;
            esac
            break
        fi
    done
fi
unset arx_cuda_platforms arx_p arx_d
# rdma-sys's bindgen needs libclang 15 or older (scripts/setup says why).
# Where a newer one is installed too (Ubuntu 24.04's default is 18), bindgen
# would take the newest: point it at the newest of 15 and older.
if [ -z "${LIBCLANG_PATH:-}" ]; then
    arx_newer=0
    for arx_d in /usr/lib/llvm-*/lib; do
        arx_v=${arx_d#/usr/lib/llvm-}
        arx_v=${arx_v%/lib}
        case $arx_v in '' | *[!0-9]*) ;; *) [ "$arx_v" -lt 16 ] || arx_newer=1 ;; esac
    done
    if [ "$arx_newer" = 1 ]; then
        for arx_v in 15 14 13 12 11 10; do
            if ls /usr/lib/llvm-$arx_v/lib/libclang*.so* >/dev/null 2>&1; then
                export LIBCLANG_PATH=/usr/lib/llvm-$arx_v/lib
                break
            fi
        done
    fi
    unset arx_newer arx_d arx_v
fi
