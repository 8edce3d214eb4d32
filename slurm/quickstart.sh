#!/bin/bash
# The Slurm quick start of README.md: the lines below the marker are copied
# there verbatim; scripts/test-slurm runs this file under real Slurm daemons
# and fails when README.md's copy differs.
set -euo pipefail
cd "$(dirname "$0")/.."
# --- quick start ---
cargo build --release --examples                      # on a node, from the repository root
sbatch --wait --nodes=2 slurm/hello.sbatch            # srun --mpi=pmix (mpirun where Slurm lacks pmix)
ARX_LAUNCHER=mpirun sbatch --wait --nodes=2 slurm/hello.sbatch         # mpirun inside the allocation
sbatch --wait --nodes=2 slurm/allreduce_perf.sbatch -d bfloat16 -e 64K  # checked sweep, 8K..64K
