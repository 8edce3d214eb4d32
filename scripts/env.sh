# Sourced by the scripts: Rust on PATH, and mpirun allowed as root (CI runs
# as root; Open MPI refuses root unless told).
if [ -f "$HOME/.cargo/env" ]; then . "$HOME/.cargo/env"; fi
if [ "$(id -u)" = 0 ]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
# Quiet Open MPI about transports a laptop or CI machine does not have.
export OMPI_MCA_btl=${OMPI_MCA_btl:-self,vader,tcp}
export CARGO_TERM_COLOR=${CARGO_TERM_COLOR:-never}
