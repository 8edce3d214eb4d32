# Sourced by the batch scripts of slurm/ (they run in the directory sbatch
# was called from: the repository root). Sets `launch`, the command that
# starts one rank per Slurm task, and `launch_why`, from ARX_LAUNCHER:
#
#   auto (default)  srun --mpi=pmix --cpu-bind=none where this Slurm has
#                   the pmix plugin (`srun --mpi=list`), else Open MPI's
#                   mpirun --bind-to none inside the allocation (Ubuntu
#                   22.04's Slurm 21.08 has no pmix plugin)
#   mpirun          mpirun --bind-to none
#   any other       srun --mpi=<it> --cpu-bind=none; a type that
#                   `srun --mpi=list` does not name fails the job at once,
#                   naming the types this Slurm has
#
# arx_launcher returns non-zero (after a message on stderr) in that case.

# The MPI plugin types `srun --mpi=list` names, space-separated: lines
# "srun: pmix" (Slurm 21.08, 22.05) or "<tab>pmix" (23.02 and later, which
# name the versioned ones on a line "specific pmix plugin versions
# available: pmix_v4,pmix_v5"). Non-zero, with srun's message on stderr,
# when srun fails.
arx_srun_mpi_types() {
    local out
    if ! out=$(srun --mpi=list 2>&1); then
        printf '%s\n' "$out" | sed 's/^/arx: srun --mpi=list failed: /' >&2
        return 1
    fi
    printf '%s\n' "$out" | sed -n \
        -e 's/^\(srun:\)\{0,1\}[[:space:]]*\([A-Za-z0-9_]\{1,\}\)[[:space:]]*$/\2/p' \
        -e 's/.*versions available:[[:space:]]*//p' | tr ',' '\n' | tr -d ' \t' |
        sort -u | tr '\n' ' ' | sed 's/^ *//; s/ *$//'
}

arx_launcher() {
    local want=${ARX_LAUNCHER:-auto} types t
    if [ "$want" = mpirun ]; then
        launch=(mpirun --bind-to none)
        launch_why="ARX_LAUNCHER=mpirun"
        return 0
    fi
    if ! [[ $want =~ ^[A-Za-z0-9_]+$ ]]; then
        echo "arx: ARX_LAUNCHER='$want': expected auto, mpirun or one srun --mpi type" >&2
        return 1
    fi
    # Unknown when srun cannot list them (its message is above): auto then
    # takes mpirun, and another type is tried as given.
    types=$(arx_srun_mpi_types) || types="?"
    if [ "$want" = auto ]; then
        want=
        for t in $types; do
            case $t in pmix) want=pmix; break ;; pmix_v*) [ -n "$want" ] || want=$t ;; esac
        done
        if [ -n "$want" ]; then
            launch_why="auto: this Slurm has the $want plugin"
        else
            launch=(mpirun --bind-to none)
            if [ "$types" = "?" ]; then
                launch_why="auto: srun --mpi=list failed"
            else
                launch_why="auto: this Slurm has no pmix plugin (srun --mpi=list: ${types:-nothing})"
            fi
            return 0
        fi
    elif [ "$types" != "?" ] && [[ " $types " != *" $want "* ]]; then
        echo "arx: ARX_LAUNCHER=$want: this Slurm has no MPI plugin of that name" \
            "(srun --mpi=list: ${types:-nothing}); use one of those, mpirun, or auto" >&2
        return 1
    else
        launch_why="ARX_LAUNCHER=$want"
    fi
    launch=(srun --mpi="$want" --cpu-bind=none)
}
