/*
 * The one-shot all-reduce (one launch per call): every rank's partial goes
 * to every peer, and every rank sums all partials in rank order.
 *
 *   stage    copy the input into send[p] (SM staging) or find it already
 *            there (copy-engine staging); a system-scope fence; the block
 *            that finishes the last staging chunk publishes meta[p] then
 *            ctrl.seq (st.release.sys);
 *   wait     poll every peer's flags with ld.acquire.sys, bounded by the
 *            abort word and a %globaltimer deadline; a block that sees them
 *            all complete posts ready_seq in device memory, which lets the
 *            other blocks stop polling the (PCIe-distant) flags early;
 *   sum      rank-order fp32 sum (or max / min / avg, p.op), one
 *            rounding, into the output; peers'
 *            partials are read with ld.global.cv (never a stale cached line);
 *   leave    the last block out resets the tickets, advances state.seq and
 *            stores ctrl.done (and poisons the output with NaN if the call
 *            failed).
 *
 * Deadlock freedom: no block ever waits for another block of its grid. Work
 * is handed out by tickets (atomic counters in device memory), so the grid
 * completes even if only one of its blocks is resident at a time (MPS ranks
 * sharing SMs, a busy GPU): a resident block keeps taking staging chunks
 * until none are left, so the publish never depends on an unscheduled block.
 * Every wait is bounded by the deadline and the abort word.
 */
#ifndef ARX_ONESHOT_CUH
#define ARX_ONESHOT_CUH

#include "device.cuh"

/* ---- reductions (ARX_OP_*), bit for bit as src/op.rs ----
 * sum, avg: IEEE addition in rank order (avg then divides once, below).
 * max, min: IEEE 754-2019 maximum / minimum: a NaN operand gives the
 * canonical quiet NaN 0x7FC00000 (which every dtype's store turns into its
 * own canonical NaN), and -0 < +0 (for equal operands the AND of the bits
 * is the maximum, the OR the minimum: they differ only in the sign of a
 * zero). The result is one of the inputs: exact. */
__device__ __forceinline__ float op_identity(u32 op) {
    if (op == ARX_OP_MAX) return bits_f32(0xFF800000u); /* -inf */
    if (op == ARX_OP_MIN) return bits_f32(0x7F800000u); /* +inf */
    /* -0.0 is the identity of IEEE addition, see the sum loop. */
    return -0.0f;
}
__device__ __forceinline__ float op_combine(u32 op, float a, float b) {
    if (op == ARX_OP_MAX || op == ARX_OP_MIN) {
        if (a != a || b != b) return bits_f32(0x7FC00000u);
        if (a == b) {
            u32 x = f32_bits(a), y = f32_bits(b);
            return bits_f32(op == ARX_OP_MAX ? (x & y) : (x | y));
        }
        return (op == ARX_OP_MAX) == (a > b) ? a : b;
    }
    return a + b;
}
/* avg: one correctly rounded f32 division by the world size (__fdiv_rn,
 * whatever the compile flags), a NaN made canonical. */
__device__ __forceinline__ float op_finish(u32 op, float a, u32 world) {
    if (op != ARX_OP_AVG) return a;
    float q = __fdiv_rn(a, (float)world);
    return q != q ? bits_f32(0x7FC00000u) : q;
}
template <class T>
__device__ __forceinline__ void acc_op(u32 op, float *acc, vec4 v) {
    if (op == ARX_OP_SUM || op == ARX_OP_AVG) {
        acc_add<T>(acc, v);
        return;
    }
    const u32 w[4] = {v.x, v.y, v.z, v.w};
    if (sizeof(typename T::S) == 2) {
#pragma unroll
        for (int k = 0; k < 4; k++) {
            acc[2 * k] = op_combine(op, acc[2 * k], T::load((u16)(w[k] & 0xFFFFu)));
            acc[2 * k + 1] = op_combine(op, acc[2 * k + 1], T::load((u16)(w[k] >> 16)));
        }
    } else {
#pragma unroll
        for (int k = 0; k < 4; k++) acc[k] = op_combine(op, acc[k], T::load(w[k]));
    }
}

/* Waits, for the whole block, until every peer's flags of call `seq` carry
 * `flag` (peer `root`'s: `root_flag`, a broadcast's root; no peer by
 * default) and this GPU side's own part of the call is out (`*own_done` has
 * reached `own_target`: the staging, or whatever the call published),
 * bounded by the deadline and the abort word. Returns true if the call
 * failed (the failure is recorded; uniform across the block). Called by
 * every thread of the block.
 *
 * Thread i < nflags polls flag i (peer me+1+i/2, lane i%2), the last thread
 * watches the clock, the abort word, the grid's status and ready_seq. One
 * block per call polls the peers' flags (PCIe reads on a discrete GPU,
 * which would compete with the payload reads if every block polled); the
 * others watch ready_seq and the status in device memory (elected on the
 * poller word of the call's parity: state.poller). The poller is a
 * running block, so waiting for it needs no other block to be scheduled;
 * nor does waiting for `own_done`, advanced only by blocks that hold work
 * of this launch (running blocks).
 *
 * A one-block grid (oneshot_single) passes `own_done` null: its one block
 * polls without an election, has staged its own part itself, and tells no
 * other block (no ready_seq). */
__device__ bool wait_peers(const arx_params_t &p, arx_ctrl_t *ctrl, arx_gpu_state_t *st, u64 seq,
                           u64 flag, const u32 *own_done, u32 own_target, u32 *s_poll,
                           u32 *s_status, u32 root = 0xFFFFFFFFu, u64 root_flag = 0) {
    const u32 tid = threadIdx.x;
    const u32 bd = blockDim.x;
    const unsigned char *region = (const unsigned char *)p.region;
    const u32 world = p.layout.world;
    const u32 me = p.layout.rank;
    const u32 seq32 = (u32)seq;
    const u32 par = (u32)(seq & 1);
    const u32 nflags = (world - 1) * ARX_LANES;
    const u64 t0 = globaltimer();
    const u64 limit = st->timeout_ns;
    u32 have = 0; /* bit k: this thread's k-th flag arrived */
    u32 round = 0;
    bool failed = false;
    /* The election word of this call's parity: only blocks waiting for this
     * call move it within a launch (the other call of a two-shot launch has
     * the other parity), so a lost CAS means another block of this call won
     * it, and exactly one block polls. (One word for both calls let a
     * gather block's CAS to seq + 1 defeat every reduce block's CAS to seq
     * between its load and its CAS: no poller, every reduce block watching
     * ready_seq until the deadline, all flags in.) */
    u32 *poll_word = &st->poller[par];
    const bool single = own_done == 0;
    if (tid == 0 && !single) {
        /* The first block to swap seq in finds another value there: one
         * atomic, no ordering needed (launches of an instance never overlap,
         * so only this call's blocks swap this word now). */
        *s_poll = atom_exch_relaxed_gpu(poll_word, seq32) != seq32;
    }
    __syncthreads();
    const bool poller = single || *s_poll != 0;
    for (;; round++) {
        u32 ok = 1, bad = 0, stop = 0;
        u32 k = 0;
        if (!poller) ok = 0;
        for (u32 i = tid; poller && i < nflags; i += bd, k++) {
            if (k < 32 && (have >> k) & 1u) continue;
            u32 q = (me + 1 + i / ARX_LANES) % world;
            u32 lane = i % ARX_LANES;
            const u64 *fp = (const u64 *)(region + p.layout.flags_off) +
                            ((u64)(par * world + q) * ARX_LANES + lane);
            u64 f = ld_acquire_sys_u64(fp);
            u32 fseq = (u32)(f >> ARX_FLAG_SEQ_SHIFT);
            if (fseq == seq32) {
                if (f != (q == root ? root_flag : flag)) {
                    /* Same call, other count, dtype, op or pattern. */
                    arx_fail(ctrl, st, ARX_STATUS_MISMATCH, q, lane, seq, f);
                    bad = 1;
                } else if (k < 32) {
                    have |= 1u << k;
                }
            } else if (fseq == seq32 + 2u) {
                /* Two calls ahead: only a failed peer's poisoned flag
                 * (for its failing call + 1) gets here, overwriting
                 * its flag of this call; fail now, not at the
                 * deadline (src/protocol.rs, `look`). */
                arx_fail(ctrl, st, ARX_STATUS_MISMATCH, q, lane, seq, f);
                bad = 1;
            } else {
                ok = 0;
            }
        }
        if (tid == bd - 1) {
            /* Our own part must be out before any block writes the output
             * (in place, the output is the input the staging reads).
             * Blocks holding that work are running, so this wait needs no
             * other block scheduled. */
            if (!single && ld_acquire_gpu_u32(own_done) < own_target) ok = 0;
            if (!single && ld_acquire_gpu_u32(&st->ready_seq) == seq32) {
                stop = 1; /* another block saw it all complete */
                *s_status = 0;
            } else if (ld_relaxed_gpu_u32(&st->status) != 0) {
                stop = 1;
                *s_status = ld_relaxed_gpu_u32(&st->status);
            } else if (poller && (round & 7) == 7 && ld_relaxed_sys_u32(&ctrl->abort) != 0) {
                /* (a PCIe round trip on discrete GPUs: not every round) */
                stop = 1;
                *s_status = ARX_STATUS_ABORTED;
            } else if (globaltimer() - t0 > limit) {
                stop = 1;
                *s_status = ARX_STATUS_TIMEOUT;
            }
        }
        /* Uniform decisions: every thread leaves in the same round.
         * (__syncthreads_or returns 1 or 0, not the OR of its operands:
         * three votes, not one with three bits.) */
        int any_bad = __syncthreads_or((int)bad);
        int all = __syncthreads_and((int)ok);
        int any_stop = __syncthreads_or((int)stop);
        if (any_bad) {
            failed = true;
            break;
        }
        if (all) {
            /* ld.acquire.sys by the pollers, then the barrier:
             * everything the peers wrote before their flags is
             * visible to the whole block. */
            if (tid == 0 && !single) st_release_gpu_u32(&st->ready_seq, seq32);
            break;
        }
        if (any_stop) {
            u32 why = *s_status;
            if (why == ARX_STATUS_TIMEOUT || why == ARX_STATUS_ABORTED) {
                /* Name a missing peer and lane: the first thread to
                 * record wins; the rest are no-ops. */
                u32 kk = 0;
                for (u32 i = tid; i < nflags; i += bd, kk++) {
                    if (kk < 32 && (have >> kk) & 1u) continue;
                    u32 q = (me + 1 + i / ARX_LANES) % world;
                    u32 lane = i % ARX_LANES;
                    const u64 *fp = (const u64 *)(region + p.layout.flags_off) +
                                    ((u64)(par * world + q) * ARX_LANES + lane);
                    u64 f = ld_acquire_sys_u64(fp);
                    if ((u32)(f >> ARX_FLAG_SEQ_SHIFT) != seq32) {
                        arx_fail(ctrl, st, why, q, lane, seq, f);
                        break;
                    }
                }
                __syncthreads();
                /* No flag missing: our own part did not get out. The flag
                 * field carries what this block saw (src/device/status.rs
                 * prints it): the own counter and its target, ready_seq,
                 * the poller word of this call's parity (low 16 bits
                 * each), whether this block polled. */
                if (tid == 0) {
                    const u64 diag = (u64)((single ? 0u : ld_acquire_gpu_u32(own_done)) & 0xFFFFu) |
                                     ((u64)(own_target & 0xFFFFu) << 16) |
                                     ((u64)(ld_acquire_gpu_u32(&st->ready_seq) & 0xFFFFu) << 32) |
                                     ((u64)(ld_relaxed_gpu_u32(poll_word) & 0x7FFFu) << 48) |
                                     ((u64)(poller ? 1u : 0u) << 63);
                    arx_fail(ctrl, st, why, me, 0xFFFFFFFFu, seq, diag);
                }
            }
            if (why != 0) failed = true;
            break;
        }
    }
    /* `failed` and the exit reason are uniform across the block. Every
     * failed exit has recorded its cause (a mismatch, or the stop's reason
     * before the last barrier); should one ever not have, record that, so
     * the call cannot return Ok with its sums skipped (arx_fail keeps the
     * first failure: a no-op when one is recorded). */
    if (failed && tid == 0) arx_fail(ctrl, st, ARX_STATUS_INTERNAL, me, ARX_LANE_INTERNAL, seq, 0);
    return failed;
}

/* Reduces n elements (at most one 16-byte vector's worth) in rank order,
 * the one rule of every algorithm: rank r's operand of element j is own[j]
 * for this rank, else element j at byte `off` of recv slot r (`recv`: the
 * slots of the call's parity), read with ld.global.cv; fp32 accumulator,
 * one rounding; the result goes to out[j] and, if out2 is not null, to
 * out2[j]. `vec`: n is a whole vector and own, out, out2 and `off` are
 * 16-byte aligned. */
template <class T>
__device__ __forceinline__ void reduce_span(u32 op, u32 world, u32 me, const typename T::S *own,
                                            const unsigned char *recv, u64 slot, u64 off,
                                            typename T::S *out, typename T::S *out2, u32 n,
                                            bool vec) {
    typedef typename T::S S;
    if (vec) {
        float acc[8];
        /* -0.0 is the identity of IEEE addition (-0 + x == x for
         * every x, -0 + -0 == -0), so the sum is exactly
         * ((p0 + p1) + p2) + ... including the sign of zero; a +0.0
         * start would turn all-(-0.0) inputs into +0.0. */
#pragma unroll
        for (int k = 0; k < 8; k++) acc[k] = op_identity(op);
        /* Loads for up to 8 ranks in flight, then added in rank order. */
        for (u32 r0 = 0; r0 < world; r0 += 8) {
            vec4 v[8];
            u32 nr = world - r0 < 8 ? world - r0 : 8;
#pragma unroll
            for (u32 j = 0; j < 8; j++) {
                if (j < nr) {
                    u32 r = r0 + j;
                    if (r == me) {
                        v[j] = *(const vec4 *)own;
                    } else {
                        v[j] = ld_cv_v4(recv + (u64)r * slot + off);
                    }
                }
            }
#pragma unroll
            for (u32 j = 0; j < 8; j++)
                if (j < nr) acc_op<T>(op, acc, v[j]);
        }
#pragma unroll
        for (int k = 0; k < 8; k++) acc[k] = op_finish(op, acc[k], world);
        vec4 res = acc_pack<T>(acc);
        *(vec4 *)out = res;
        if (out2) *(vec4 *)out2 = res;
    } else {
        for (u32 e = 0; e < n; e++) {
            float a = op_identity(op); /* see the vector path */
            for (u32 r = 0; r < world; r++) {
                S s;
                if (r == me) {
                    s = own[e];
                } else {
                    s = ld_cv_elem((const S *)(recv + (u64)r * slot + off) + e);
                }
                a = op_combine(op, a, T::load(s));
            }
            S res = T::store(op_finish(op, a, world));
            out[e] = res;
            if (out2) out2[e] = res;
        }
    }
}

/* Reduces `nu` units of this thread, units u0 + j*stride (j < nu; a unit
 * as in reduce_span), each by reduce_span's rule, with B (2 or 4) vector
 * units' loads in flight at once (two ranks' operands each): a thread that
 * owns several units waits for a few round trips to the (PCIe-distant)
 * peers' partials, not one per unit. Rank order and one rounding as
 * reduce_span. Used by the one-block path (a 16 KB call: four units per
 * thread); the multi-block sum keeps one unit at a time (reduce_span):
 * with reduce_units there it was 1.3-3.9 us slower at 32-64 KB, 2 ranks
 * under MPS (three alternated rounds, docs/GPU.md). */
template <class T, u32 B>
__device__ __forceinline__ void reduce_units(u32 op, u32 world, u32 me, const typename T::S *in,
                                             const unsigned char *recv, u64 slot,
                                             typename T::S *out, u32 count, u32 u0, u32 stride,
                                             u32 nu, bool vec) {
    typedef typename T::S S;
    const u32 VE = 16 / sizeof(S);
    const u32 unit = vec ? VE : 1u;
    const u32 nunits = (count + unit - 1) / unit;
    for (u32 j0 = 0; j0 < nu; j0 += B) {
        u32 e[B];
        bool mine[B], full[B];
        float acc[B][8];
#pragma unroll
        for (u32 j = 0; j < B; j++) {
            u32 u = u0 + (j0 + j) * stride;
            mine[j] = j0 + j < nu && u < nunits;
            e[j] = mine[j] ? u * unit : 0u;
            full[j] = mine[j] && vec && e[j] + VE <= count;
#pragma unroll
            for (int k = 0; k < 8; k++) acc[j][k] = op_identity(op); /* see reduce_span */
        }
        for (u32 r0 = 0; r0 < world; r0 += 2) {
            vec4 v[B][2];
#pragma unroll
            for (u32 j = 0; j < B; j++) {
#pragma unroll
                for (u32 i = 0; i < 2; i++) {
                    u32 r = r0 + i;
                    if (full[j] && r < world) {
                        v[j][i] = r == me ? *(const vec4 *)(in + e[j])
                                          : ld_cv_v4(recv + (u64)r * slot + (u64)e[j] * sizeof(S));
                    }
                }
            }
#pragma unroll
            for (u32 j = 0; j < B; j++) {
#pragma unroll
                for (u32 i = 0; i < 2; i++)
                    if (full[j] && r0 + i < world) acc_op<T>(op, acc[j], v[j][i]);
            }
        }
#pragma unroll
        for (u32 j = 0; j < B; j++) {
            if (full[j]) {
#pragma unroll
                for (int k = 0; k < 8; k++) acc[j][k] = op_finish(op, acc[j][k], world);
                *(vec4 *)(out + e[j]) = acc_pack<T>(acc[j]);
            } else if (mine[j]) {
                u32 n = e[j] + unit < count ? unit : count - e[j];
                reduce_span<T>(op, world, me, in + e[j], recv, slot, (u64)e[j] * sizeof(S),
                               out + e[j], (S *)0, n, false);
            }
        }
    }
}

/* Copies staging chunk c of a `count`-element partial from `in` to `send`:
 * thread tid owns units c*per_chunk + k*bd + tid, k < unroll (a unit is a
 * 16-byte vector when `vec`, else one element). Four units' loads are
 * issued before their stores, so a thread has four loads in flight, not
 * one (a one-block call stages all its units this way). */
template <class S>
__device__ __forceinline__ void stage_chunk(const S *in, S *send, u32 count, u32 c, u32 per_chunk,
                                            u32 unroll, bool vec, u32 skip0 = 0, u32 skip1 = 0) {
    const u32 VE = 16 / sizeof(S);
    const u32 unit = vec ? VE : 1u;
    const u32 nunits = (count + unit - 1) / unit;
    const u32 B = 4;
    for (u32 k0 = 0; k0 < unroll; k0 += B) {
        vec4 v[B];
        u32 e[B];
        bool full[B];
#pragma unroll
        for (u32 j = 0; j < B; j++) {
            u32 u = c * per_chunk + (k0 + j) * blockDim.x + threadIdx.x;
            /* Units [skip0, skip1) are not staged (own_units); the tickets
             * count the others, so the index steps over them. */
            if (u >= skip0) u += skip1 - skip0;
            bool mine = k0 + j < unroll && u < nunits;
            e[j] = mine ? u * unit : count;
            full[j] = mine && vec && e[j] + VE <= count;
            if (full[j]) v[j] = *(const vec4 *)(in + e[j]);
        }
#pragma unroll
        for (u32 j = 0; j < B; j++) {
            if (full[j]) {
                *(vec4 *)(send + e[j]) = v[j];
            } else {
                u32 e1 = e[j] + unit < count ? e[j] + unit : count;
                for (u32 x = e[j]; x < e1; x++) send[x] = in[x];
            }
        }
    }
}

/* The staging units (16-byte vectors when `vec`, else elements) of a
 * count-element call that lie wholly inside this rank's shard [r0, r1):
 * [*k0, *k1), empty when none does. A two-shot or reduce_scatter does not
 * stage them: its reduce reads its own shard from the input, and the
 * proxy sends each peer only that peer's shard (the host side's
 * twoshot::stage_peers_shards). A unit that straddles a shard boundary
 * is staged. */
__device__ __forceinline__ void own_units(u32 r0, u32 r1, u32 count, u32 unit, u32 *k0,
                                          u32 *k1) {
    u32 a = (r0 + unit - 1) / unit;
    u32 b = r1 >= count ? (count + unit - 1) / unit : r1 / unit;
    if (r0 >= r1 || b <= a) {
        a = 0;
        b = 0;
    }
    *k0 = a;
    *k1 = b;
}

/* Takes staging tickets of `next` until all `n` are handed out, copying
 * each chunk (`copy` false: the chunks are only counted, the host staged
 * the data), then makes the block's stores visible system-wide and adds
 * its count to `done`. Returns true in the one block whose count completes
 * `done` (uniform across the block): every chunk is staged then, and the
 * acq_rel chain on `done` orders every block's stores before whatever that
 * block stores next.
 *
 * One system fence per block, by the thread that counts, after the
 * barrier: PTX release patterns are cumulative, so the fence orders every
 * store the barrier made visible to that thread (the whole block's), the
 * way NCCL's Simple protocol posts a step (barrier, then one thread's
 * fence.acq_rel.sys and flag store). A fence in every thread cost 0.5 us
 * more per call (scripts/gpu-floor.cu, H200). */
template <class S>
__device__ bool stage_all(u32 *next, u32 *done, u32 n, const S *in, S *send, u32 count,
                          u32 per_chunk, u32 unroll, bool vec, bool copy, u32 *s_ticket,
                          u32 first = 0xFFFFFFFFu, u32 skip0 = 0, u32 skip1 = 0) {
    u32 mine = 0;
    for (;;) {
        /* `first`: a ticket of `next` the caller already took (uniform). */
        u32 c = first != 0xFFFFFFFFu ? first : block_ticket(next, s_ticket);
        first = 0xFFFFFFFFu;
        if (c >= n) break;
        mine++;
        if (copy) stage_chunk<S>(in, send, count, c, per_chunk, unroll, vec, skip0, skip1);
    }
    if (mine == 0) return false;
    __syncthreads();
    if (threadIdx.x == 0) {
        fence_acq_rel_sys();
        u32 before = atom_add_acq_rel_gpu(done, mine);
        *s_ticket = before + mine == n;
    }
    __syncthreads();
    return *s_ticket != 0;
}

/* One of a pipelined chunk's gate conditions (ARX_GATE_*) is met: the
 * block whose bit completes the set publishes the next call (exactly one
 * block: the transition to ARX_GATE_ALL happens once). Thread 0 only. */
__device__ __forceinline__ void gate_arrive(arx_ctrl_t *ctrl, arx_gpu_state_t *st, u32 bit,
                                            u64 next_seq, u64 next_flag, u64 next_bytes) {
    u32 old = atom_or_acq_rel_gpu(&st->gate, bit);
    if (old != ARX_GATE_ALL && (old | bit) == ARX_GATE_ALL)
        publish_call(ctrl, next_seq, next_flag, next_bytes);
}

/* Test hook (arx_params_t.sum_delay_ns, 0 otherwise): the block pauses
 * after a wait, before it sums or copies out, so that a test can make this
 * rank the slow one. Called by every thread (uniform: a kernel parameter). */
__device__ __forceinline__ void test_pause(const arx_params_t &p) {
    if (p.sum_delay_ns == 0) return;
    if (threadIdx.x == 0) {
        const u64 t0 = globaltimer();
        while (globaltimer() - t0 < p.sum_delay_ns) {
        }
    }
    __syncthreads();
}

/* What both one-shot paths derive from arx_params_t: the call's place in
 * the region, its seq and flag, and how its elements split into units (a
 * 16-byte vector when input and output are aligned, else one element) and
 * chunks (`unroll` units per thread of the block). Every block reads seq
 * before it can depart; the last block to depart advances it, so every
 * block of a launch sees the same value. */
template <class S> struct OneshotCall {
    unsigned char *region;
    arx_ctrl_t *ctrl;
    arx_gpu_state_t *st;
    u32 world, me;
    u64 slot;
    /* A refused call (dtype INVALID) announces its count but moves no data. */
    bool valid;
    u32 count;
    u64 seq;
    u32 par, op;
    u64 flag;
    /* Where this chunk's data sits in its slots (arx_abi.h: ARX_FLAG_HIGH). */
    u64 base;
    const S *in;
    S *out, *send;
    /* The peers' partials of this call's parity, slot r for rank r. */
    const unsigned char *recv;
    bool vec;
    u32 unit, nunits, unroll, per_chunk, nchunks;

    __device__ explicit OneshotCall(const arx_params_t &p) {
        region = (unsigned char *)p.region;
        ctrl = (arx_ctrl_t *)(region + p.layout.ctrl_off);
        st = (arx_gpu_state_t *)p.state;
        world = p.layout.world;
        me = p.layout.rank;
        slot = p.layout.slot_bytes;
        valid = p.dtype != ARX_DTYPE_INVALID;
        count = valid ? p.count : 0u;
        seq = st->seq + 1;
        par = (u32)(seq & 1);
        op = p.op & ARX_FLAG_OP_MASK;
        flag = make_flag(seq, op, p.dtype, p.count, p.more & (ARX_FLAG_MORE | ARX_FLAG_HIGH));
        base = (p.more & ARX_FLAG_HIGH) ? slot / 2 : 0;
        in = (const S *)p.input;
        out = (S *)p.output;
        send = (S *)(region + p.layout.send_off + par * slot + base);
        recv = region + p.layout.recv_off + (u64)par * world * slot + base;
        vec = ((p.input | p.output) & 15ull) == 0;
        unit = vec ? 16u / (u32)sizeof(S) : 1u;
        nunits = (count + unit - 1) / unit;
        unroll = p.unroll > 0 ? p.unroll : 1u;
        per_chunk = blockDim.x * unroll;
        nchunks = (nunits + per_chunk - 1) / per_chunk;
    }
};

/* A call the host launched as one block (one-shot calls up to 16 KB,
 * ONE_BLOCK_BYTES in src/device/gpu.rs) that is not part of a pipelined
 * call, with SM staging: the same steps and the
 * same result as oneshot_run, without what exists only to share the work
 * among blocks -- the tickets, the staging count, the poller election,
 * ready_seq and the departure count, each an atomic or a fence in device
 * memory on the call's critical path (0.3-0.6 us each on an H200,
 * scripts/gpu-floor.cu). The block stages the partial, and one thread
 * publishes it after the barrier: st.release.sys is cumulative, so it
 * orders the whole block's staging stores before ctrl.seq (one system
 * fence per call). */
template <class T>
__device__ void oneshot_single(const arx_params_t &p) {
    typedef typename T::S S;
    const u32 tid = threadIdx.x;
    const u32 bd = blockDim.x;
    const OneshotCall<S> cl(p);

    __shared__ u32 s_slot;
    __shared__ u32 s_status;

    bool failed = block_status(cl.st, &s_slot) != 0;
    if (!failed) {
        for (u32 c = 0; c < cl.nchunks; c++)
            stage_chunk<S>(cl.in, cl.send, cl.count, c, cl.per_chunk, cl.unroll, cl.vec);
        __syncthreads();
        if (tid == 0) publish_call(cl.ctrl, cl.seq, cl.flag, (u64)cl.count * sizeof(S));
        failed = wait_peers(p, cl.ctrl, cl.st, cl.seq, cl.flag, (const u32 *)0, 0, &s_slot,
                            &s_status);
    }
    if (!failed) test_pause(p);
    if (!failed) {
        /* B units in flight per thread: as many as it owns, up to four
         * (the loop's code runs for all B, owned or not, and a one-block
         * kernel is latency-bound on its few warps). */
        const u32 nu = (cl.nunits + bd - 1) / bd;
        if (nu <= 2)
            reduce_units<T, 2>(cl.op, cl.world, cl.me, cl.in, cl.recv, cl.slot, cl.out, cl.count,
                               tid, bd, nu, cl.vec);
        else
            reduce_units<T, 4>(cl.op, cl.world, cl.me, cl.in, cl.recv, cl.slot, cl.out, cl.count,
                               tid, bd, nu, cl.vec);
    }

    /* leave: the grid's status is this block's (arx_fail records it) */
    const u32 status = block_status(cl.st, &s_slot);
    if (status != 0) {
        for (u32 e = tid; e < cl.count; e += bd) cl.out[e] = T::poison();
    }
    if (tid == 0) {
        /* The tickets were not touched; the next launch reads seq after
         * this kernel ends (stream order). */
        cl.st->seq = cl.seq;
        if (status == 0) st_relaxed_sys_u64(&cl.ctrl->done, cl.seq);
    }
}

template <class T>
__device__ void oneshot_run(const arx_params_t &p) {
    if (gridDim.x == 1 && p.sm_staging &&
        !(p.dtype != ARX_DTYPE_INVALID && (p.prestaged != 0 || p.next_count != 0))) {
        oneshot_single<T>(p);
        return;
    }
    typedef typename T::S S;
    const u32 VE = 16 / sizeof(S); /* elements per 16-byte vector */
    const u32 tid = threadIdx.x;
    const u32 bd = blockDim.x;
    const OneshotCall<S> cl(p);

    __shared__ u32 s_ticket;
    __shared__ u32 s_poll;
    __shared__ u32 s_status;
    /* Pipelined chunks (SM staging only, arx_abi.h "A call longer than one
     * slot"): `pre`, the previous launch staged and published this chunk;
     * `ahead`, once every peer's flags of this chunk are in, this launch
     * stages the next chunk into its place (the next call's parity, its
     * half) and publishes it (the gate: staged, this chunk published,
     * flags in), then sums: the next chunk's sends overlap this chunk's
     * sum. */
    const bool pipe = cl.valid && p.sm_staging;
    const bool pre = pipe && p.prestaged != 0;
    const bool ahead = pipe && p.next_count != 0;
    /* At least one of each so that a zero-length call still publishes and
     * waits (its flags keep the ranks in step); none when prestaged. */
    const u32 nstage = pre ? 0u : p.sm_staging ? (cl.nchunks > 0 ? cl.nchunks : 1u) : 1u;
    const u32 nsum = cl.nchunks > 0 ? cl.nchunks : 1u;

    /* The next chunk, when `ahead`. */
    const u32 ncount = ahead ? p.next_count : 0u;
    const S *nin = (const S *)p.next_input;
    S *nsend = (S *)(cl.region + p.layout.send_off + (cl.par ^ 1u) * cl.slot +
                     ((p.next_more & ARX_FLAG_HIGH) ? cl.slot / 2 : 0));
    const bool nvec = (p.next_input & 15ull) == 0;
    const u32 nunit = nvec ? VE : 1u;
    const u32 nchunks_next = ((ncount + nunit - 1) / nunit + cl.per_chunk - 1) / cl.per_chunk;
    const u64 nflag = make_flag(cl.seq + 1, cl.op, p.dtype, ncount,
                                p.next_more & (ARX_FLAG_MORE | ARX_FLAG_HIGH));
    const u64 nbytes = (u64)ncount * sizeof(S);

    /* The grid's status and the first staging ticket in one round trip (a
     * ticket taken by a block that then finds the call failed is never
     * staged: a failed call publishes nothing more). */
    __syncthreads();
    if (tid == 0) {
        s_status = ld_relaxed_gpu_u32(&cl.st->status);
        s_ticket = nstage > 0 ? atomicAdd(&cl.st->stage_next, 1u) : 0xFFFFFFFFu;
    }
    __syncthreads();
    bool failed = s_status != 0;
    const u32 first = s_ticket;

    /* ---- stage and publish this chunk (unless prestaged) ---- */
    if (!failed && nstage > 0) {
        if (stage_all<S>(&cl.st->stage_next, &cl.st->staged, nstage, cl.in, cl.send, cl.count,
                         cl.per_chunk, cl.unroll, cl.vec, p.sm_staging && cl.nchunks > 0,
                         &s_ticket, first) &&
            tid == 0) {
            publish_call(cl.ctrl, cl.seq, cl.flag, (u64)cl.count * sizeof(S));
            if (ahead) gate_arrive(cl.ctrl, cl.st, ARX_GATE_OWN, cl.seq + 1, nflag, nbytes);
        }
    }
    if (!failed && ahead && pre && tid == 0)
        gate_arrive(cl.ctrl, cl.st, ARX_GATE_OWN, cl.seq + 1, nflag, nbytes);

    /* ---- wait for every peer, stage the next chunk (pipelined), sum ---- */
    bool ready = false;
    while (!failed) {
        u32 c = block_ticket(&cl.st->sum_next, &s_ticket);
        if (c >= nsum) break;
        if (!ready) {
            failed = wait_peers(p, cl.ctrl, cl.st, cl.seq, cl.flag, &cl.st->staged, nstage,
                                &s_poll, &s_status);
            if (failed) break;
            ready = true;
            if (ahead) {
                /* Only now: the next chunk's place may be the one of the
                 * call before this one (the call before a call's first
                 * chunk, whole slots), which this rank's proxy may still be
                 * sending; every peer's flag of this call says the peer
                 * has had that call's partial from this rank. */
                if (tid == 0)
                    gate_arrive(cl.ctrl, cl.st, ARX_GATE_FLAGS, cl.seq + 1, nflag, nbytes);
                if (stage_all<S>(&cl.st->next_stage_next, &cl.st->next_staged, nchunks_next, nin,
                                 nsend, ncount, cl.per_chunk, cl.unroll, nvec, true, &s_ticket) &&
                    tid == 0)
                    gate_arrive(cl.ctrl, cl.st, ARX_GATE_STAGED, cl.seq + 1, nflag, nbytes);
            }
            test_pause(p);
        }

        /* Sum chunk c: thread tid owns units c*per_chunk + k*bd + tid (one
         * unit at a time: see reduce_units). */
        for (u32 k = 0; k < cl.unroll; k++) {
            u32 u = c * cl.per_chunk + k * bd + tid;
            if (u >= cl.nunits) break;
            u32 e0 = u * cl.unit;
            u32 n = e0 + cl.unit < cl.count ? cl.unit : cl.count - e0;
            reduce_span<T>(cl.op, cl.world, cl.me, cl.in + e0, cl.recv, cl.slot,
                           (u64)e0 * sizeof(S), cl.out + e0, (S *)0, n, cl.vec && n == VE);
        }
    }

    /* ---- leave: the last block out closes the call ---- */
    if (!depart_last(cl.st, &s_ticket)) return;
    /* A call that did not publish (failed before staging) leaves nothing in
     * flight (copy-engine staging never pipelines). */
    const u32 status =
        await_sent(cl.ctrl, cl.st, !p.sm_staging && ld_acquire_gpu_u32(&cl.st->staged) >= nstage,
                   cl.seq, cl.me);
    if (status != 0) {
        /* A failed call must not leave a plausible result behind (a graph
         * replay has no host to check): NaN everywhere. */
        for (u32 e = tid; e < cl.count; e += bd) cl.out[e] = T::poison();
    }
    close_launch(cl.ctrl, cl.st, cl.seq, status);
}


#endif /* ARX_ONESHOT_CUH */
