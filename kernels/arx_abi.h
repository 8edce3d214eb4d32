/*
 * arx ABI: the one source of truth shared by the CUDA kernels (kernels/arx.cu,
 * compiled at run time by NVRTC) and the Rust crate (build.rs turns this file
 * into Rust with bindgen). Fixed-width types only, no CUDA or libc headers
 * under NVRTC, every struct padded explicitly so both sides agree on sizes
 * (checked by static asserts here and by const asserts in src/layout.rs).
 *
 * The mapped region of one instance (offsets computed in src/layout.rs only):
 *
 *   ctrl   arx_ctrl_t                       written by the device side, read by the proxy
 *   flags  uint64_t [2 parities][world][2 lanes]   written by peers (RDMA or shm)
 *   send   [2 parities][slot_bytes]          this rank's partial, read by the proxy/NIC
 *   recv   [2 parities][world][slot_bytes]   peers' partials, written by peers
 *
 * Protocol for call seq (1, 2, ...), parity p = seq & 1:
 *   1. the device side copies its partial into send[p], makes it visible
 *      system-wide, writes ctrl.meta[p] and ctrl.bytes[p], then
 *      ctrl.seq = seq (release);
 *   2. the proxy posts, for every seq in order, to every peer q (r+1, r+2, ...)
 *      and each lane l: the lane's half of the bytes of send[p] that the
 *      call's pattern gives q (the whole partial, shard q, or this rank's
 *      shard) into q's recv[p][r] at the same offsets, then the flag word
 *      into q's flags[p][r][l] on the same ordered channel;
 *   3. the device side waits until flags[p][q][l] carries seq for every peer and
 *      lane, checks that the peer's count, dtype and op equal its own, and
 *      reduces recv[p][0..world] (its own partial from send[p]) in rank order
 *      with an fp32 accumulator (sum, max, min, or avg: the sum divided once
 *      by world), rounding once, so every rank holds the same bits.
 *
 * A two-shot all-reduce is two calls of the same count: seq with pattern
 * SCATTER (every rank reduces only its own shard, as step 3 does, and
 * writes the result at the shard's offset in send[p ^ 1]), then seq + 1
 * with pattern GATHER (every rank copies the peers' reduced shards out of
 * recv[p ^ 1]). Each element is reduced once, by the same rank-order rule,
 * so the bits equal one-shot's. reduce_scatter is the first call alone,
 * all_gather the second alone.
 *
 * A broadcast is one call (pattern BCAST) per chunk: every rank publishes
 * the chunk's count, the root with its partial (ARX_BCAST_ROOT in the op
 * field: every peer gets the whole of it), every other rank with no data;
 * a receiver expects exactly the root's word from the root and the
 * non-root word from every other peer, and copies recv[p][root] out.
 */
#ifndef ARX_H
#define ARX_H

#ifdef __CUDACC_RTC__
typedef unsigned long long uint64_t;
typedef unsigned int uint32_t;
#else
#include <stdint.h>
#endif

/* "ARX1" as a little-endian u32. */
#define ARX_MAGIC 0x31585241u
/* Bump on any change to this file, to the wire format (src/wire.rs), to
 * the start-up's collective steps, or to a rule every rank must apply alike
 * (the automatic algorithm: 10, per-world host thresholds; 11: the
 * departure words after the probe words, src/layout). */
#define ARX_ABI_VERSION 11u

#define ARX_LANES 2u
#define ARX_PARITIES 2u
/* Largest communicator arx accepts. */
#define ARX_MAX_WORLD 256u
/* Every section of the region starts on a page; slots are multiples of this. */
#define ARX_SECTION_ALIGN 4096u
/* Lane split granularity: each lane's half starts on a 16-byte boundary so
 * the kernel can use 16-byte loads and stores. */
#define ARX_LANE_ALIGN 16u

/* The flag word: seq (low 32 bits of the call number) in the high half,
 * then the dtype and the count field of that call, so that a receiver
 * detects a peer that called with a different length or dtype.
 *
 * A call longer than one slot is split into chunks of half a slot, each
 * published, sent and summed as a call of its own (its own seq). The
 * count field of a chunk holds its element count, plus ARX_FLAG_MORE on
 * every chunk but the last: ranks that disagree on a call's total length
 * then differ in the first chunk where their counts or their MORE bits
 * differ, and fail there at once (a mismatch), never by a timeout.
 *
 * Chunk j (from 0) of such a call lives in the half (j >> 1) & 1 of its
 * parity's slots (ARX_FLAG_HIGH: the second half, at slot_bytes / 2), so
 * four consecutive chunks use four distinct places. That lets a rank
 * publish chunk j + 1 as soon as every peer's flag of chunk j is there,
 * before it sums chunk j (the next chunk's sends overlap this one's sum):
 * chunk j + 1's place was last used by chunk j - 3, and a peer published
 * chunk j only after it had summed chunk j - 2 (a peer publishes chunk j
 * once every flag of chunk j - 1 is there, after its sum of chunk j - 2);
 * chunk j + 1's flag overwrites chunk j - 1's, which every peer had seen
 * before it published chunk j. The last chunk is published only after the
 * sum of the one before, so that when a call ends, a peer's flag of its
 * last chunk still means "every earlier chunk is summed": the next call,
 * which uses whole slots, finds them free by the rule of any two calls.
 * (A two-shot chunk is two calls, j = 2k and 2k + 1, both in half k & 1;
 * the next chunk's reduce-scatter step, call 2k + 2, is published once
 * every peer's flags of the gather step 2k + 1 are there, before the copy
 * out of the gathered shards: its place was last used by call 2k - 2,
 * which a peer reduced before it published 2k - 1; its flag overwrites
 * 2k's, which a peer saw before it published 2k + 1. The gather step
 * 2k + 3, published after every peer's flag of 2k + 2, overwrites the
 * place and the flag of 2k - 1, which a peer copied out and saw before it
 * published 2k + 2 (the copy out of chunk k - 1 came before: in order on
 * the host side, in the launch before on the GPU side).
 * The last chunk's reduce-scatter step is published early too, on both
 * sides: the call's last call, the last chunk's gather step, still comes
 * only after every earlier chunk's copy out, which is what the next call
 * needs.) The next chunk is also staged (written into this rank's send
 * slot) only once every flag of chunk j is there (a two-shot's: of the
 * gather step): chunk j + 1's place may be the place of the call before
 * the call's first chunk, which this rank's proxy may still be sending
 * until every peer has published chunk j. */
#define ARX_FLAG_SEQ_SHIFT 32u
#define ARX_FLAG_DTYPE_SHIFT 28u
#define ARX_FLAG_DTYPE_MASK 0x3u
/* The reduction (ARX_OP_*) in the two bits above the dtype: ranks that
 * call with different ops differ in the flag word and fail at once. Sum is
 * 0, so sum's flag words (and the poison and refusal words) are those of
 * ABI version 4. */
#define ARX_FLAG_OP_SHIFT 30u
#define ARX_FLAG_OP_MASK 0x3u
#define ARX_FLAG_COUNT_MASK 0x0fffffffu
/* In the count field: more chunks of the same call follow this one. */
#define ARX_FLAG_MORE 0x08000000u
/* In the count field, below ARX_FLAG_MORE: the pattern of the call (which
 * bytes of the sender's partial go to which peer, ARX_PATTERN_*). Ranks
 * whose patterns differ (one all-reduces one-shot, another two-shot, or
 * one reduce-scatters while another all-gathers) differ in the flag word
 * and fail at once. */
#define ARX_FLAG_PATTERN_SHIFT 25u
#define ARX_FLAG_PATTERN_MASK 0x3u
/* Every peer gets the whole partial (one-shot all-reduce). */
#define ARX_PATTERN_WHOLE 0u
/* Peer q gets shard q of the partial (the reduce-scatter step: of a
 * two-shot all-reduce, with ARX_FLAG_ALLREDUCE, or a reduce_scatter). */
#define ARX_PATTERN_SCATTER 1u
/* Every peer gets the sender's own shard (the all-gather step: of a
 * two-shot all-reduce, with ARX_FLAG_ALLREDUCE, or an all_gather). */
#define ARX_PATTERN_GATHER 2u
/* Every peer gets the whole partial of a sender whose op field is
 * ARX_BCAST_ROOT, nothing of any other sender (a broadcast: the root
 * sends, every rank announces the same count, so that ranks that disagree
 * on the count or on the root differ in some flag word and fail at once). */
#define ARX_PATTERN_BCAST 3u
/* The op field of a broadcast's flag word: the sender is the root (0: it
 * is not). A broadcast reduces nothing, so the field is free. */
#define ARX_BCAST_ROOT 1u
/* Shards. Of a call of `count` elements over `world` ranks, shard q is
 * elements [min(q*L, count), min((q+1)*L, count)) with
 *   L = count / world                       when world divides count,
 *   L = roundup(ceil(count / world), 16 B)  otherwise (in elements),
 * so that reduce_scatter and all_gather blocks are exact and a two-shot
 * all-reduce's shards start on 16-byte boundaries whenever they can. Each
 * shard lands at its own offset in the receiver's slot. */
/* Largest element count of one chunk: below ARX_FLAG_ALLREDUCE, and a
 * multiple of ARX_SECTION_ALIGN elements so that every chunk of every
 * dtype starts on a 4 KiB boundary of the caller's buffer (as its first
 * does). */
#define ARX_MAX_CHUNK 0x007ff000u
/* In the count field, below the pattern: this chunk's data sits in the
 * second half of its slots (at slot_bytes / 2), see "A call longer than
 * one slot" above. The sender's proxy, a relay and the receiver all place
 * the data by it. */
#define ARX_FLAG_HIGH 0x01000000u
/* In the count field, below HIGH: this SCATTER or GATHER call is a step of
 * a two-shot all-reduce, not a reduce_scatter or an all_gather (ABI 9).
 * The steps move the same bytes the same way, so without it a rank that
 * all-reduces two-shot and a peer that reduce-scatters then all-gathers
 * agreed on every flag word, and both returned Ok with the other's
 * meaning. With it they differ in the first step's word and fail at once. */
#define ARX_FLAG_ALLREDUCE 0x00800000u
/* The element count of the count field (without MORE, the pattern, HIGH
 * and ALLREDUCE). */
#define ARX_FLAG_ELEMS_MASK 0x007fffffu
/* Count field of the "invalid" flag words a rank whose fabric failed writes
 * to its peers (so that they fail at once): every count, HIGH and pattern
 * bit, no MORE; no call or refusal announces it (its element count is
 * above ARX_MAX_CHUNK). */
#define ARX_FLAG_POISON_COUNT 0x07ffffffu
/* Count field of the "invalid" flag words a rank writes to its peers when
 * a call of its own timed out: as ARX_FLAG_POISON_COUNT, one element less,
 * so that the peers' errors say which. */
#define ARX_FLAG_FAILED_COUNT 0x07fffffeu
/* Count field of the "invalid" flag word a rank's proxy writes into its
 * own region, in place of a peer's flag, when that peer closed its
 * instance (its departure word, which no kernel reads) before the call
 * this rank waits for: as ARX_FLAG_POISON_COUNT, two elements less. */
#define ARX_FLAG_DEPARTED_COUNT 0x07fffffdu
/* Largest slot size in bytes (ARX_SLOT_BYTES). */
#define ARX_MAX_COUNT 0x0fffffffu

/* Element types, as carried in the flag word and PeerInfo's dtype set.
 * INVALID marks a call a rank refused (bad arguments): its peers fail at
 * once instead of timing out. */
#define ARX_DTYPE_INVALID 0u
#define ARX_DTYPE_BF16 1u
#define ARX_DTYPE_F16 2u
#define ARX_DTYPE_F32 3u

/* Reductions, as carried in the flag word and arx_params_t.op. */
#define ARX_OP_SUM 0u
#define ARX_OP_MAX 1u
#define ARX_OP_MIN 2u
#define ARX_OP_AVG 3u

/* Status recorded by the device side in arx_ctrl_t.status. */
#define ARX_STATUS_OK 0u
/* A peer's flag did not arrive before the deadline. */
#define ARX_STATUS_TIMEOUT 1u
/* ctrl.abort was set (by the proxy after a fabric error, or by the host). */
#define ARX_STATUS_ABORTED 2u
/* A peer called with another count or dtype (its flag word in err_flag). */
#define ARX_STATUS_MISMATCH 3u
/* The device side's wait failed with nothing recorded: an internal
 * invariant of arx broke (a bug). Recorded so that the call fails (output
 * NaN, an error naming it) instead of returning Ok with the output
 * unwritten. err_peer is this rank, err_lane ARX_LANE_INTERNAL. */
#define ARX_STATUS_INTERNAL 4u
#define ARX_LANE_INTERNAL 0xFFFFFFFEu

/* Control block, at offset 0 of the region (one 256-byte block). */
typedef struct arx_ctrl {
    /* Last seq whose partial is complete in send[seq & 1]; release-stored by
     * the device side, acquire-loaded by the proxy. */
    uint64_t seq;
    /* Flag word announced for the seq of parity p; written before seq. */
    uint64_t meta[2];
    /* Last seq the device side finished (result written). */
    uint64_t done;
    /* Nonzero: the device side stops waiting and records ABORTED. */
    uint32_t abort;
    /* ARX_STATUS_* of the first failure, then the details. */
    uint32_t status;
    uint32_t err_peer;
    uint32_t err_lane;
    uint64_t err_seq;
    uint64_t err_flag;
    /* Deadline for one call's flag wait, in nanoseconds (set at start-up). */
    uint64_t timeout_ns;
    /* Last seq whose sends the proxy has completed locally (the send slots
     * of that seq and every earlier one may be overwritten); release-stored
     * by the proxy. The GPU side's copy-engine staging waits on it. */
    uint64_t sent;
    /* Bytes of the partial of the seq of parity p (written with meta[p],
     * before seq): what the proxy sends, so it never derives a size. */
    uint64_t bytes[2];
    uint64_t reserved[20];
} arx_ctrl_t;

/* Offsets of the region's sections, as computed by src/layout.rs. */
typedef struct arx_layout {
    uint64_t ctrl_off;
    uint64_t flags_off;
    uint64_t send_off;
    uint64_t recv_off;
    uint64_t slot_bytes;
    uint64_t region_bytes;
    uint32_t world;
    uint32_t rank;
} arx_layout_t;

/* Device-memory state of the GPU device side (not in the mapped region):
 * the call counter lives here so that a captured CUDA graph needs no host
 * work per replay. Work inside one launch is handed out by tickets, so no
 * block ever waits for another block of its grid (a grid that is not fully
 * co-resident, e.g. under MPS, still finishes); the last block to leave
 * resets the tickets and advances seq. */
typedef struct arx_gpu_state {
    /* Last call launched and finished on this GPU side. */
    uint64_t seq;
    /* Staging chunks handed out / finished (the block that finishes the
     * last one publishes the call). */
    uint32_t stage_next;
    uint32_t staged;
    /* Sum chunks handed out. */
    uint32_t sum_next;
    /* Blocks that have left the kernel. */
    uint32_t depart;
    /* Low 32 bits of the last seq whose flags some block saw complete. */
    uint32_t ready_seq;
    /* Sticky ARX_STATUS_* of the first failure (device copy of ctrl.status). */
    uint32_t status;
    /* Bound on one call's waits, in nanoseconds of %globaltimer. */
    uint64_t timeout_ns;
    /* Low 32 bits of the seq whose flags one block has taken on polling
     * (the others watch ready_seq in device memory instead of PCIe), one
     * word per call parity: a two-shot launch waits for two calls (seq and
     * seq + 1, of both parities) at once, and one shared word lets a block
     * electing itself for one call make every block of the other call lose
     * its election, leaving that call with no poller (kernels/oneshot.cuh,
     * wait_peers). Within a launch each word serves one call only. */
    uint32_t poller[2];
    /* Two-shot, reduce_scatter, all_gather (kernels/twoshot.cuh): reduce
     * chunks finished (the block that finishes the last one publishes a
     * two-shot's gather step), gather chunks handed out. */
    uint32_t reduced;
    uint32_t gather_next;
    /* Pipelined chunks, one-shot and two-shot (kernels/oneshot.cuh,
     * kernels/twoshot.cuh, arx_params_t.next_*): staging chunks of the
     * next chunk handed out / finished, and the gate of its publish
     * (ARX_GATE_* bits: the block whose bit completes the set publishes it,
     * exactly once). */
    uint32_t next_stage_next;
    uint32_t next_staged;
    uint32_t gate;
    uint32_t reserved;
} arx_gpu_state_t;

/* The three conditions of a pipelined chunk's early publish: the next
 * chunk is staged, this launch's own last call is published (one-shot:
 * its chunk, set from the start when the previous launch published it;
 * two-shot: its gather step, set by the block that published it), every
 * peer's flags of that call are in. */
#define ARX_GATE_STAGED 1u
#define ARX_GATE_OWN 2u
#define ARX_GATE_FLAGS 4u
#define ARX_GATE_ALL 7u

/* Kernel parameters, passed by value to every arx kernel. */
typedef struct arx_params {
    /* Device address of the mapped region (host == device pointer under UVA). */
    uint64_t region;
    /* Device address of arx_gpu_state_t. */
    uint64_t state;
    uint64_t input;
    uint64_t output;
    arx_layout_t layout;
    /* Elements in this call (chunk) and its dtype. */
    uint32_t count;
    uint32_t dtype;
    /* 1: the kernel stages the partial with SM stores and a system fence;
     * 0: the host staged it with a copy-engine copy before the launch. */
    uint32_t sm_staging;
    /* 16-byte vectors (or elements, for unaligned buffers) each thread
     * handles per work chunk; at least 1. */
    uint32_t unroll;
    /* Count-field bits of this chunk, or'ed into the flag word:
     * ARX_FLAG_MORE when more chunks of the same call follow this launch,
     * ARX_FLAG_HIGH when its data sits in the second half of the slots
     * (every slot address of the call moves by slot_bytes / 2). */
    uint32_t more;
    /* ARX_OP_* of the call. */
    uint32_t op;
    /* Pipelined all-reduce chunks, one-shot and two-shot (SM staging only;
     * arx_abi.h "A call longer than one slot"): `prestaged` 1: the previous
     * launch already staged and published this chunk (a two-shot's: its
     * reduce-scatter call). `next_count` > 0: this launch stages the next
     * chunk of the call (`next_count` elements at `next_input`, count
     * -field bits `next_more`) into its place, and publishes it once every
     * peer's flags of this chunk (a two-shot's: of its gather call) are
     * in, before summing this one (a two-shot: before copying the gathered
     * shards out). Zero in every other launch. */
    uint32_t prestaged;
    uint32_t next_count;
    uint32_t next_more;
    /* Test hook (Builder::test_sum_delay; 0 otherwise): in a one-shot
     * launch each block pauses this long after its wait, before it sums; in
     * a collective launch (two-shot, reduce_scatter, all_gather) after each
     * of its waits, before it reduces or copies out; so that a test can
     * make one rank the slow one. */
    uint32_t sum_delay_ns;
    uint64_t next_input;
} arx_params_t;

#ifndef __CUDACC_RTC__
#ifdef __cplusplus
#define ARX_STATIC_ASSERT static_assert
#else
#define ARX_STATIC_ASSERT _Static_assert
#endif
ARX_STATIC_ASSERT(sizeof(arx_ctrl_t) == 256, "arx_ctrl_t is 256 bytes");
ARX_STATIC_ASSERT(sizeof(arx_layout_t) == 56, "arx_layout_t is 56 bytes");
ARX_STATIC_ASSERT(sizeof(arx_gpu_state_t) == 72, "arx_gpu_state_t is 72 bytes");
ARX_STATIC_ASSERT(sizeof(arx_params_t) == 136, "arx_params_t is 136 bytes");
#endif

#endif /* ARX_H */
