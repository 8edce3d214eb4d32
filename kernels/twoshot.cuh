/*
 * The two-shot all-reduce, reduce_scatter and all_gather (one launch per
 * chunk; the GPU twin of src/algo/twoshot.rs and src/algo/collective.rs):
 *
 *   stage     copy the partial into send[p] (SM staging; copy-engine
 *             staging finds it there): every peer's shard q of it, taken
 *             from the caller's block q (two-shot: the contiguous input;
 *             reduce_scatter: block q of the N·n input), not this rank's
 *             own (the reduce reads it from the input; own_units), or only
 *             this rank's shard (all_gather); a system fence; the block that
 *             finishes the last staging chunk publishes call seq (pattern
 *             SCATTER, or GATHER for all_gather), then counts `staged` once
 *             more, so that nothing waiting for `staged` (hence no gather
 *             publish) runs before ctrl.seq = seq is stored;
 *   reduce    (two-shot, reduce_scatter) wait for every peer's flags of
 *             seq; reduce ONLY this rank's shard in rank order with the
 *             one-shot kernel's reduce_span (fp32 accumulator, one
 *             rounding: the same bits), into the output's shard and, for
 *             a two-shot, into send[p ^ 1] at the shard's offset; a system
 *             fence; the block that finishes the last reduce chunk
 *             publishes call seq + 1 (pattern GATHER);
 *   gather    (two-shot, all_gather) wait for every peer's flags of the
 *             gather call; copy each peer's shard from its receive slot
 *             (ld.global.cv) into the output's block q (all_gather also
 *             copies its own input block, unless it is already there);
 *   leave     as one-shot: the last block out resets the tickets, advances
 *             state.seq past every call of the launch (two for a two-shot)
 *             and NaN-poisons what the call writes if it failed.
 *
 * Pipelined two-shot chunks (SM staging, a call longer than one slot:
 * arx_params_t.prestaged / next_*, arx_abi.h "A call longer than one
 * slot"): chunk k is calls seq = first + 2k (SCATTER) and seq + 1
 * (GATHER), both in half k & 1 of their slots. The launch of chunk k,
 * once every peer's flags of its gather call are in, stages chunk k + 1's
 * partial into its place (call seq + 2: parity p, half (k + 1) & 1) and
 * publishes it, then copies the gathered shards out, so the proxy sends
 * chunk k + 1's reduce-scatter step meanwhile; the launch of chunk k + 1
 * (`prestaged`) neither stages nor publishes its reduce-scatter call, it
 * waits for its flags and goes on as any launch. Every next chunk, the
 * last one's too, is published so (as the host side's twoshot::pipelined
 * does: the call's last call, the last chunk's gather step, is still
 * published only after every earlier chunk's copy out). The publish is
 * gated as one-shot's (ARX_GATE_*, the block whose bit completes the set
 * publishes, exactly once): the next chunk staged (by the blocks past the
 * gather wait, by tickets), this launch's gather call published (the
 * block that counts the last reduce chunk, after its release store: the
 * gather waiters may pass once `reduced` is complete, before that store),
 * every peer's gather flags in. Staging only after those flags: the rule
 * of arx_abi.h.
 *
 * Every property of the one-shot kernel holds, by the same means: work is
 * handed out by tickets and no block waits for another block of its grid
 * except one that holds work of this launch (a running block): a gather
 * waits for `reduced` to reach its count, advanced only by blocks holding
 * reduce chunks, as a reduce waits for `staged`; every wait is
 * wait_peers (bounded by the deadline and the abort word, failures
 * recorded naming the peer and lane); the counter lives in device memory
 * (graph capturable).
 *
 * A two-shot launch waits for two calls at once (blocks without a reduce
 * chunk go straight to the gather wait while others still wait for seq),
 * so each call elects its poller on its own word (state.poller[call & 1]):
 * with one word, a gather block's CAS to seq + 1 could land between every
 * reduce block's load and CAS, leaving seq with no poller. ready_seq can
 * stay shared: the gather's poller posts seq + 1 only once `reduced` is
 * complete, i.e. after every reduce block has left its wait for seq.
 *
 * Why send[p ^ 1] is free for the gather step, and recv[p ^ 1][q] for
 * peer q's: src/algo/twoshot.rs.
 */
#ifndef ARX_TWOSHOT_CUH
#define ARX_TWOSHOT_CUH

#include "oneshot.cuh"

/* The `kind` argument of the collective kernels (src/device/gpu.rs `Coll`). */
#define ARX_COLL_TWOSHOT 1u
#define ARX_COLL_REDUCE_SCATTER 2u
#define ARX_COLL_ALL_GATHER 3u

/* One chunk of a collective of `p.count` elements (N blocks of `p.count / N`
 * for reduce_scatter and all_gather): shard q of the call (the protocol's
 * shard rule) is block q of the caller's buffers, at `p.input + q *
 * in_stride` and `p.output + q * out_stride` elements (a two-shot ignores
 * the strides: its buffers are contiguous). Refusals never come here (they
 * run the one-shot kernel). */
template <class T>
__device__ void collective_run(const arx_params_t &p, u32 kind, u64 in_stride, u64 out_stride) {
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

    __shared__ u32 s_ticket;
    __shared__ u32 s_poll;
    __shared__ u32 s_status;

    /* As one-shot: every block reads seq before it can depart. */
    const u64 seq = st->seq + 1;
    const bool two = kind == ARX_COLL_TWOSHOT;
    const bool reduce = kind != ARX_COLL_ALL_GATHER;
    const bool gather = kind != ARX_COLL_REDUCE_SCATTER;
    /* The call of the gather step (a two-shot's second call). */
    const u64 gseq = two ? seq + 1 : seq;
    const u32 op = p.op & ARX_FLAG_OP_MASK;
    const u32 more = p.more & (ARX_FLAG_MORE | ARX_FLAG_HIGH);
    /* Where this chunk's data sits in its slots (arx_abi.h: ARX_FLAG_HIGH;
     * both steps of a two-shot chunk use the same half). */
    const u64 base = (p.more & ARX_FLAG_HIGH) ? slot / 2 : 0;
    const u32 pat1 = reduce ? ARX_PATTERN_SCATTER : ARX_PATTERN_GATHER;
    /* A two-shot's steps say so (ARX_FLAG_ALLREDUCE): a peer that
     * reduce-scatters or all-gathers instead differs in the flag word. */
    const u32 ar = two ? ARX_FLAG_ALLREDUCE : 0u;
    const u64 flag1 =
        make_flag(seq, op, p.dtype, count, more | ar | (pat1 << ARX_FLAG_PATTERN_SHIFT));
    const u64 gflag = make_flag(gseq, op, p.dtype, count,
                                more | ar | (ARX_PATTERN_GATHER << ARX_FLAG_PATTERN_SHIFT));

    const u32 L = shard_len(count, world, sizeof(S));
    if (two) {
        in_stride = L;
        out_stride = L;
    }
    const u32 par = (u32)(seq & 1);
    const u32 gpar = (u32)(gseq & 1);
    S *send = (S *)(region + p.layout.send_off + (u64)par * slot + base);
    S *gsend = (S *)(region + p.layout.send_off + (u64)gpar * slot + base);
    const unsigned char *recv = region + p.layout.recv_off + (u64)par * world * slot + base;
    const unsigned char *grecv = region + p.layout.recv_off + (u64)gpar * world * slot + base;
    const S *in = (const S *)p.input;
    S *out = (S *)p.output;

    /* This rank's shard [r0, r1) of the call. */
    const u32 r0 = (u32)((u64)me * L < count ? (u64)me * L : count);
    const u32 r1 = (u32)((u64)(me + 1) * L < count ? (u64)(me + 1) * L : count);
    /* 16-byte units never straddle a shard (L a whole number of vectors)
     * and every address they touch is aligned. */
    const bool vec = ((p.input | p.output) & 15ull) == 0 && (in_stride * sizeof(S)) % 16 == 0 &&
                     (out_stride * sizeof(S)) % 16 == 0 && ((u64)L * sizeof(S)) % 16 == 0;
    const u32 unit = vec ? VE : 1u;
    const u32 unroll = p.unroll > 0 ? p.unroll : 1u;
    const u32 per_chunk = bd * unroll; /* units per chunk */

    /* Pipelined two-shot chunks (see the top of this file): `pre`, the
     * previous launch staged and published call seq; `ahead`, this launch
     * stages and publishes the next chunk's call seq + 2. */
    const bool pipe = two && p.sm_staging;
    const bool pre = pipe && p.prestaged != 0;
    const bool ahead = pipe && p.next_count != 0;

    /* Staged: the slot's elements [s0, s1). At least one chunk of each
     * phase, so that a zero-length call still publishes and waits; no
     * staging when prestaged. */
    const u32 s0 = reduce ? 0u : r0;
    const u32 s1 = reduce ? count : r1;
    /* A reduce stages every unit but its own shard's [ou0, ou1) (own_units). */
    u32 ou0 = 0, ou1 = 0;
    if (reduce) own_units(r0, r1, count, unit, &ou0, &ou1);
    const u32 nsu = (s1 - s0 + unit - 1) / unit - (ou1 - ou0);
    const u32 nsc = (nsu + per_chunk - 1) / per_chunk;
    const u32 nstage = pre ? 0u : p.sm_staging ? (nsc > 0 ? nsc : 1u) : 1u;
    const u32 nru = (r1 - r0 + unit - 1) / unit;
    const u32 nrc = (nru + per_chunk - 1) / per_chunk;
    const u32 nred = nrc > 0 ? nrc : 1u;
    const u32 ngu = (count + unit - 1) / unit;
    const u32 ngc = (ngu + per_chunk - 1) / per_chunk;
    const u32 ngath = ngc > 0 ? ngc : 1u;
    /* `staged` once every staging chunk is counted and call seq published
     * (the publishing block adds one more after its release store); 0 when
     * prestaged (the previous launch published it: stream order). */
    const u32 published = pre ? 0u : nstage + 1u;

    /* The next chunk's reduce-scatter call (seq + 2, this parity, its
     * half), when `ahead`: a contiguous copy of its partial, as this
     * chunk's own staging is for a two-shot (in_stride == L). */
    const u32 ncount = ahead ? p.next_count : 0u;
    const S *nin = (const S *)p.next_input;
    S *nsend = (S *)(region + p.layout.send_off + (u64)par * slot +
                     ((p.next_more & ARX_FLAG_HIGH) ? slot / 2 : 0));
    const bool nvec = (p.next_input & 15ull) == 0;
    const u32 nunit = nvec ? VE : 1u;
    /* The next chunk's own shard is not staged either (own_units). */
    const u32 nL = shard_len(ncount, world, sizeof(S));
    const u32 nr0 = (u32)((u64)me * nL < ncount ? (u64)me * nL : ncount);
    const u32 nr1 = (u32)((u64)(me + 1) * nL < ncount ? (u64)(me + 1) * nL : ncount);
    u32 nk0 = 0, nk1 = 0;
    own_units(nr0, nr1, ncount, nunit, &nk0, &nk1);
    /* At least one ticket when `ahead`, as for this launch's own staging:
     * the block that counts it arrives at the gate, and the next chunk may
     * be this rank's own shard alone (a short last chunk: 3 elements of
     * bf16 at 2 ranks are all rank 0's), with nothing to stage. */
    const u32 nnu = (ncount + nunit - 1) / nunit - (nk1 - nk0);
    const u32 nstage_next = nnu > 0 ? (nnu + per_chunk - 1) / per_chunk : 1u;
    const u64 nflag = make_flag(seq + 2, op, p.dtype, ncount,
                                (p.next_more & (ARX_FLAG_MORE | ARX_FLAG_HIGH)) | ar |
                                    (ARX_PATTERN_SCATTER << ARX_FLAG_PATTERN_SHIFT));
    const u64 nbytes = (u64)ncount * sizeof(S);

    bool failed = block_status(st, &s_ticket) != 0;

    /* ---- stage and publish call seq (unless prestaged) ---- */
    if (!failed && nstage > 0) {
        u32 mine = 0;
        for (;;) {
            u32 c = block_ticket(&st->stage_next, &s_ticket);
            if (c >= nstage) break;
            mine++;
            if (p.sm_staging) {
                for (u32 k = 0; k < unroll; k++) {
                    u32 u = c * per_chunk + k * bd + tid;
                    if (u >= nsu) break;
                    if (u >= ou0) u += ou1 - ou0;
                    u32 e0 = s0 + u * unit;
                    u32 q = e0 / L;
                    u32 j = e0 - q * L;
                    const S *src = in + (u64)q * in_stride + j;
                    if (vec && e0 + VE <= s1) {
                        *(vec4 *)(send + e0) = *(const vec4 *)src;
                    } else {
                        u32 n = e0 + unit < s1 ? unit : s1 - e0;
                        for (u32 e = 0; e < n; e++) send[e0 + e] = src[e];
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
                    publish_call(ctrl, seq, flag1, (u64)count * sizeof(S));
                    /* Counted once more only once call seq is out: a
                     * two-shot's gather call is published by another
                     * block, which must come after this store (else
                     * ctrl.seq goes back from seq + 1 to seq and the proxy
                     * never posts the gather step, or it reads meta[par]
                     * before this block wrote it). The reduce waits for
                     * this count; the release above orders the stores
                     * before it. */
                    atom_add_acq_rel_gpu(&st->staged, 1u);
                }
            }
        }
    }

    /* ---- reduce this rank's shard (two-shot, reduce_scatter) ---- */
    if (reduce) {
        u32 mine = 0;
        bool ready = false;
        while (!failed) {
            u32 c = block_ticket(&st->sum_next, &s_ticket);
            if (c >= nred) break;
            if (!ready) {
                failed = wait_peers(p, ctrl, st, seq, flag1, &st->staged, published, &s_poll,
                                    &s_status);
                if (failed) break;
                ready = true;
                test_pause(p);
            }
            mine++;
            for (u32 k = 0; k < unroll; k++) {
                u32 u = c * per_chunk + k * bd + tid;
                if (u >= nru) break;
                u32 j0 = u * unit;
                u32 n = j0 + unit < r1 - r0 ? unit : r1 - r0 - j0;
                reduce_span<T>(op, world, me, in + (u64)me * in_stride + j0, recv, slot,
                               (u64)(r0 + j0) * sizeof(S), out + (u64)me * out_stride + j0,
                               two ? gsend + r0 + j0 : (S *)0, n, vec && n == VE);
            }
        }
        if (two && mine > 0) {
            /* The reduced shard in send[p ^ 1] is made visible system-wide
             * before the block counts its chunks; the block that counts
             * the last one publishes the gather call (not after a
             * failure: the call ends there, as on the host side), then,
             * pipelined, arrives at the gate: the next chunk's publish
             * must come after this one (ctrl.seq only grows). */
            fence_sc_sys();
            __syncthreads();
            if (tid == 0) {
                u32 before = atom_add_acq_rel_gpu(&st->reduced, mine);
                if (before + mine == nred && ld_relaxed_gpu_u32(&st->status) == 0) {
                    publish_call(ctrl, gseq, gflag, (u64)count * sizeof(S));
                    if (ahead) gate_arrive(ctrl, st, ARX_GATE_OWN, seq + 2, nflag, nbytes);
                }
            }
        }
    }

    /* ---- gather every peer's shard (two-shot, all_gather) ---- */
    if (gather) {
        /* Our own gather call is out: a two-shot's once every reduce chunk
         * is counted, an all_gather's once staged. */
        const u32 *own_done = two ? &st->reduced : &st->staged;
        const u32 own_target = two ? nred : published;
        bool ready = false;
        while (!failed) {
            u32 c = block_ticket(&st->gather_next, &s_ticket);
            if (c >= ngath) break;
            if (!ready) {
                failed = wait_peers(p, ctrl, st, gseq, gflag, own_done, own_target, &s_poll,
                                    &s_status);
                if (failed) break;
                ready = true;
                if (ahead) {
                    /* Only now (arx_abi.h: the next chunk is staged once
                     * every flag of this one is there), then published by
                     * whichever block completes the gate; the copy out
                     * below overlaps its sends. */
                    if (tid == 0) gate_arrive(ctrl, st, ARX_GATE_FLAGS, seq + 2, nflag, nbytes);
                    if (stage_all<S>(&st->next_stage_next, &st->next_staged, nstage_next, nin,
                                     nsend, ncount, per_chunk, unroll, nvec, true, &s_ticket,
                                     0xFFFFFFFFu, nk0, nk1) &&
                        tid == 0)
                        gate_arrive(ctrl, st, ARX_GATE_STAGED, seq + 2, nflag, nbytes);
                }
                test_pause(p);
            }
            for (u32 k = 0; k < unroll; k++) {
                u32 u = c * per_chunk + k * bd + tid;
                if (u >= ngu) break;
                u32 e0 = u * unit;
                u32 q = e0 / L;
                u32 j = e0 - q * L;
                u32 n = e0 + unit < count ? unit : count - e0;
                S *dst = out + (u64)q * out_stride + j;
                if (q == me) {
                    /* A two-shot's own shard was written by the reduce. */
                    if (two) continue;
                    const S *src = in + (u64)me * in_stride + j;
                    if (src == dst) continue; /* in place */
                    if (vec && n == VE) {
                        *(vec4 *)dst = *(const vec4 *)src;
                    } else {
                        for (u32 e = 0; e < n; e++) dst[e] = src[e];
                    }
                } else {
                    const unsigned char *src = grecv + (u64)q * slot + (u64)e0 * sizeof(S);
                    if (vec && n == VE) {
                        *(vec4 *)dst = ld_cv_v4(src);
                    } else {
                        for (u32 e = 0; e < n; e++) dst[e] = ld_cv_elem((const S *)src + e);
                    }
                }
            }
        }
    }

    /* ---- leave: the last block out closes the launch's calls ---- */
    if (!depart_last(st, &s_ticket)) return;
    /* Copy-engine staging: as one-shot, the launch ends only once the proxy
     * has finished reading every slot it published (the next call's
     * copies overwrite both send slots): the last call it published, read
     * back from ctrl.seq (this GPU side's own release store) by the one
     * thread that waits (await_sent looks at `wait` in thread 0 only; in
     * the others `pub` stays 0, below seq). */
    u64 pub = 0;
    if (!p.sm_staging && tid == 0) pub = ld_acquire_sys_u64(&ctrl->seq);
    const u32 status = await_sent(ctrl, st, pub >= seq, pub, me);
    if (status != 0) {
        /* NaN over everything the call writes (see one-shot). */
        const u32 p0 = kind == ARX_COLL_REDUCE_SCATTER ? r0 : 0u;
        const u32 p1 = kind == ARX_COLL_REDUCE_SCATTER ? r1 : count;
        for (u32 e = p0 + tid; e < p1; e += bd) {
            u32 q = e / L;
            out[(u64)q * out_stride + (e - q * L)] = T::poison();
        }
    }
    close_launch(ctrl, st, gseq, status);
}

#endif /* ARX_TWOSHOT_CUH */
