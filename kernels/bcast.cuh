/*
 * broadcast (one launch per chunk; the GPU twin of src/algo/broadcast.rs):
 *
 *   stage    the root copies its input into send[p] (SM staging;
 *            copy-engine staging finds it there), other ranks stage
 *            nothing; a system fence; the block that finishes the last
 *            staging chunk publishes call seq: the root's flag word (op
 *            field ARX_BCAST_ROOT) with the chunk's bytes, or, on any
 *            other rank, the same count without the root bit and 0 bytes;
 *   copy     wait for every peer's flags (wait_peers: the root's word from
 *            the root, the non-root word from every other peer, so ranks
 *            that disagree on the count or the root fail at once); a
 *            non-root copies recv[p][root] into the output (ld.global.cv),
 *            the root copies its input unless in place;
 *   leave    as one-shot: the last block out resets the tickets, advances
 *            state.seq, stores ctrl.done, NaN-poisons the output if the
 *            call failed.
 *
 * The one-shot kernel's properties hold by the same means: work by
 * tickets, no block waits for another block of its grid except through
 * `staged` (advanced only by blocks holding staging work, running blocks),
 * every wait bounded (wait_peers), the counter in device memory (graph
 * capturable). A zero-length chunk still publishes and waits.
 */
#ifndef ARX_BCAST_CUH
#define ARX_BCAST_CUH

#include "oneshot.cuh"

template <class T>
__device__ void bcast_run(const arx_params_t &p, u32 root) {
    typedef typename T::S S;
    const u32 VE = 16 / sizeof(S); /* elements per 16-byte vector */
    const u32 tid = threadIdx.x;
    const u32 bd = blockDim.x;
    unsigned char *region = (unsigned char *)p.region;
    arx_ctrl_t *ctrl = (arx_ctrl_t *)(region + p.layout.ctrl_off);
    arx_gpu_state_t *st = (arx_gpu_state_t *)p.state;
    const u32 world = p.layout.world;
    const u32 me = p.layout.rank;
    const u64 slot = p.layout.slot_bytes;
    const u32 count = p.count;
    const bool is_root = me == root;

    __shared__ u32 s_ticket;
    __shared__ u32 s_poll;
    __shared__ u32 s_status;

    /* As one-shot: every block reads seq before it can depart. */
    const u64 seq = st->seq + 1;
    const u32 par = (u32)(seq & 1);
    const u32 fields = (p.more & ARX_FLAG_MORE) | (ARX_PATTERN_BCAST << ARX_FLAG_PATTERN_SHIFT);
    const u64 root_flag = make_flag(seq, ARX_BCAST_ROOT, p.dtype, count, fields);
    const u64 other_flag = make_flag(seq, 0u, p.dtype, count, fields);

    const S *in = (const S *)p.input;
    S *out = (S *)p.output;
    S *send = (S *)(region + p.layout.send_off + (u64)par * slot);
    const unsigned char *from =
        region + p.layout.recv_off + ((u64)par * world + root) * slot;
    const bool vec = ((p.input | p.output) & 15ull) == 0;
    const u32 unit = vec ? VE : 1u;
    const u32 nunits = (count + unit - 1) / unit;
    const u32 unroll = p.unroll > 0 ? p.unroll : 1u;
    const u32 per_chunk = bd * unroll; /* units per chunk */
    const u32 nchunks = (nunits + per_chunk - 1) / per_chunk;
    /* At least one of each, so that every rank publishes and waits. */
    const u32 nstage = (p.sm_staging && is_root && nchunks > 0) ? nchunks : 1u;
    const u32 ncopy = nchunks > 0 ? nchunks : 1u;

    bool failed = block_status(st, &s_ticket) != 0;

    /* ---- stage (the root) and publish ---- */
    if (!failed) {
        u32 mine = 0;
        for (;;) {
            u32 c = block_ticket(&st->stage_next, &s_ticket);
            if (c >= nstage) break;
            mine++;
            if (p.sm_staging && is_root && nchunks > 0) {
                for (u32 k = 0; k < unroll; k++) {
                    u32 u = c * per_chunk + k * bd + tid;
                    if (u >= nunits) break;
                    u32 e0 = u * unit;
                    if (vec && e0 + VE <= count) {
                        *(vec4 *)(send + e0) = *(const vec4 *)(in + e0);
                    } else {
                        u32 e1 = e0 + unit < count ? e0 + unit : count;
                        for (u32 e = e0; e < e1; e++) send[e] = in[e];
                    }
                }
            }
        }
        if (mine > 0) {
            /* As one-shot: stores fenced at system scope, then counted. */
            fence_sc_sys();
            __syncthreads();
            if (tid == 0) {
                u32 before = atom_add_acq_rel_gpu(&st->staged, mine);
                if (before + mine == nstage) {
                    st_relaxed_sys_u64(&ctrl->meta[par], is_root ? root_flag : other_flag);
                    st_relaxed_sys_u64(&ctrl->bytes[par], is_root ? (u64)count * sizeof(S) : 0ull);
                    st_release_sys_u64(&ctrl->seq, seq);
                }
            }
        }
    }

    /* ---- wait for every peer, then copy ---- */
    bool ready = false;
    while (!failed) {
        u32 c = block_ticket(&st->sum_next, &s_ticket);
        if (c >= ncopy) break;
        if (!ready) {
            failed = wait_peers(p, ctrl, st, seq, other_flag, &st->staged, nstage, &s_poll,
                                &s_status, root, root_flag);
            if (failed) break;
            ready = true;
        }
        if (is_root && in == out) continue; /* in place: already there */
        for (u32 k = 0; k < unroll; k++) {
            u32 u = c * per_chunk + k * bd + tid;
            if (u >= nunits) break;
            u32 e0 = u * unit;
            u32 n = e0 + unit < count ? unit : count - e0;
            if (is_root) {
                if (vec && n == VE) {
                    *(vec4 *)(out + e0) = *(const vec4 *)(in + e0);
                } else {
                    for (u32 e = 0; e < n; e++) out[e0 + e] = in[e0 + e];
                }
            } else {
                const unsigned char *src = from + (u64)e0 * sizeof(S);
                if (vec && n == VE) {
                    *(vec4 *)(out + e0) = ld_cv_v4(src);
                } else {
                    for (u32 e = 0; e < n; e++) out[e0 + e] = ld_cv_elem((const S *)src + e);
                }
            }
        }
    }

    /* ---- leave: the last block out closes the call ---- */
    if (!depart_last(st, &s_ticket)) return;
    /* Copy-engine staging: as one-shot, a call that published ends only
     * once the proxy has finished reading its slot. */
    const u32 status =
        await_sent(ctrl, st, !p.sm_staging && ld_acquire_gpu_u32(&st->staged) >= nstage, seq, me);
    if (status != 0) {
        /* NaN over the output (see one-shot). */
        for (u32 e = tid; e < count; e += bd) out[e] = T::poison();
    }
    close_launch(ctrl, st, seq, status);
}

#endif /* ARX_BCAST_CUH */
