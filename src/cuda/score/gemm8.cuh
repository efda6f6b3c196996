// The GEMM-shaped scorer of E4M3 keys (issue "Prefill indexer at tensor-core speed"), in both
// precision modes. fp8_mma ("gemm8"): keys whose stored bytes are already the MMA operand (the
// prefill gather's FP8 rows, an FP8 cache with at least 128 rows per page) go from global memory
// straight into the wgmma B operand, with no expansion and no register staging; NVFP4 keys with
// E4M3 rounding (R >= 128) are expanded into it by the threads instead. fp32 ("gemm16", template
// flag F16; INDEXCP_SCORE_GEMM16=0 keeps the tile scorer; its paragraph is the last): the same shape on
// fp16 operands. Private to score.cu (src/cuda/score.cu has the overview).
//
// Shape (the fp8_mma form; the fp32 form differs as its paragraph at the end says; the producer
// form adds a third warpgroup, see its paragraph): 256 threads = two warpgroups; the CTA holds 256 query vectors of its slice, 128 per warpgroup, as the A operand
// in registers (two m64 tiles of raw E4M3 bytes per warpgroup, loaded once per request: 32
// registers). A stage is one selection block: 128 keys x 128 bytes (16 KiB) in the
// 128-byte-swizzled K-major layout, read by both warpgroups: each multiplies it with two chains of
// 4 wgmma m64n128k32 (one per m64 tile), so a key byte copied from L2 serves 256 query vectors (the
// 128-vector version of session 18 read every key from L2 once per 128 vectors, about 3.3 TB/s at
// its speed: bench/NOTES.md v19). The block maximum of a query vector is then a maximum over the
// 128 accumulator columns of its row: 31 fmax in the thread and a reduce-scatter over the quad. The
// two chains are two wgmma commit groups, so tile 0's maxima are taken while tile 1's chain runs
// (INDEXCP_SCORE_G8_SPLIT; no maxima are held beyond the block). The warpgroups take turns at
// issuing their chains of a block (two mbarriers of 128 arrivals each: warpgroup 0 issues block c
// after warpgroup 1 issued block c - 1, warpgroup 1 after warpgroup 0 issued block c), so the
// tensor cores run one warpgroup's chains while the other takes its maxima ("ping-pong" on a shared
// stage). Neither barrier can run two phases ahead of its waiter: each arrival waits for the
// other's.
//
// The bits are those of every other scorer of the mode (form.hpp, form8_dim): k slot 16 half +
// 4 t4 + i of k-step s8 multiplies dimension 32 t4 + 8 s8 + 4 half + i, with the queries as A and
// the keys as B (score_kernel has them the other way round; the products and their order per
// k-step are the same). So the copy places raw 4-byte piece p = 8 t4 + 2 s8 + half of a key
// (dims 4p .. 4p + 3) at logical 16-byte chunk 2 s8 + half, word t4 of the key's 128-byte row, which
// the swizzle stores at physical chunk (2 s8 + half) ^ (row & 7): one cp.async of 4 bytes per lane,
// lane = p, one instruction per key row, conflict-free (the 32 lanes hit 32 different banks). The
// GPU suite compares these scores with score_kernel's bit for bit (All/GpuFp8MmaForm.*,
// GpuFp8Mma.GemmScorerEqualsTheTileScorer).
//
// Pipeline (the two-warpgroup form; the producer form's paragraph follows): one ring of
// G8Form::kStages stages shared by the warpgroups, kStages - 2 blocks in flight, two mbarriers per
// stage. FP8 keys in fp8_mma: every warp copies 16 rows of a block (warp
// w: rows 16 w .. 16 w + 15, 4 bytes per lane per row); every thread arrives on the stage's `full`
// barrier when its copies land (cp.async.mbarrier.arrive.noinc), or, for NVFP4 keys (E4M3 rounding,
// R >= 128), expands half a row into it (gemm8_expand_half), fences its stores for the async proxy
// and arrives; thread 0 also writes the stage's block index and arrives once more. A thread waits
// on `full`, fences the copies for the async proxy and issues its warpgroup's chains; once they are
// done it arrives on the stage's `empty` barrier, which a thread waits on before it copies into the
// stage again. The counters (stage, phase) run on over the requests of the CTA.
//
// The producer form (PROD; fp8_mma's default, INDEXCP_SCORE_G8_PRODUCER=0 keeps the form above): a
// third warpgroup (threads 256 .. 383) walks the pairs and fills every stage, so that the two math
// warpgroups only wait on `full`, issue their chains, take the maxima and arrive on `empty`. FP8
// keys: producer warp p copies rows 32 p .. 32 p + 31 of a block (the copies above, two runs of 16
// rows). NVFP4 keys: producer thread t expands both halves of row t, its codes and scale bytes
// loaded one pair ahead in registers. At the end of each request the producer publishes a stage
// with block -1 and no keys, which ends the math warpgroups' loop over the request's blocks. The
// roles split right after the persistent prologue, each with its own setmaxnreg (kProdRegs,
// kMathRegs) and its own copy of the code (ptxas ignores setmaxnreg for code both roles reach).
// The producer may fill all kStages stages ahead; its leader (thread 256) writes a stage's block
// index. The first segment is planned before the roles split (the prologue), and so is the second
// where a persistent share crosses into a second slice (INDEXCP_SCORE_G8_PLAN_AHEAD, batches of up to
// 1,024 requests), so the producer goes on into that slice's stages while the math warpgroups finish
// the first. Both roles meet at the CTA barriers of any later segment's plan (plan_block),
// each at its own copy of the bar.sync: every warp belongs to one role and both roles reach the
// same barriers in the same order (the loops' bounds come from the plan alone), the pattern of
// warp-specialized kernels; the ring drains there (the producer waits).
// INDEXCP_SCORE_DEBUG's bit 2 (no key loads) is not honoured by the producer's loads.
// Measured: bench/NOTES.md v25 (an H100: the replicated NVFP4 scorer 13% faster, the FP8 gather's 4%).
// With NVFP4 keys the math warpgroups' loop is rotated (INDEXCP_SCORE_G8_ROTATED): a warpgroup
// takes the next stage (the `full` wait, the proxy fence, the block index) while tile 1's chain
// of the current block runs, and stores the block's scores after it has issued the next block's
// chains, so that only tile 1's maxima (and the turn) lie between the end of its chains and its
// next issue (bench/NOTES.md v27: 7-8% faster on an H100; for E4M3 rows it made the gather's
// kernel spill and was 3% slower at 128K, so those keep the loop in block order). Issuing tile
// 0's next chain before tile 1's maxima instead makes ptxas serialize every wgmma (C7514: a
// chain's accumulators read between the chains of one pipeline stage).
//
// The fp32 form (F16): wgmma m64n128k16 with fp32 accumulation, both operands fp16 in shared memory
// in the 128-byte swizzle (a 256-byte row is two 128-byte halves of 64 dimensions, 16 KiB per half
// of a stage): the CTA's 256 query vectors are converted from E4M3 once per request (64 KiB), and
// every key passes through the threads: FP8 bytes converted (cvt.rn.f16x2.e4m3x2), NVFP4 codes
// expanded (form_expand_e4m3), half a row per thread, into a ring of stages (32 KiB each). The raw
// key bytes of E4M3 rows come from a ring of the thread's own in shared memory, filled by cp.async
// 3 blocks ahead (one commit group per block, cp.async.wait_group), beside 3 stages; NVFP4 codes
// and scales are loaded one pair ahead into registers, beside 4 stages (INDEXCP_SCORE_G16_RAW4 /
// RAW8 swap these; bench/NOTES.md v21 has the measurements). A thread expands its half row of the
// next block after it has issued its chains of a block, as the NVFP4 fp8_mma form does. At the start
// of a request the first key loads (the block-table entry, then the registers or the raw ring) are
// issued before the query tile is converted, so their latency overlaps the queries' (bench/NOTES.md v22:
// 3.5-4.4% faster, more than this overlap explains; ptxas also schedules the block loop differently). The k
// slots are those of form_dim: the products and their order per k-step are the tile scorer's, so
// the scores have its bits (GpuFp8Mma.GemmScorerEqualsTheTileScorer).
#pragma once

#include <cub/block/block_scan.cuh>

#include <type_traits>

#include "cuda/common.cuh"
#include "cuda/kernels.cuh"
#include "cuda/rows.cuh"
#include "cuda/score/ptx.cuh"
#include "cuda/score/schedule.cuh"
#include "cuda/score/tiles.cuh"

namespace indexcp::cuda::detail {

// Internal linkage on purpose: this header is part of score.cu's one translation unit.
namespace {

constexpr int kG8Threads = 256;
// Each block's chains as two commit groups (m64 tile 0, tile 1), so that tile 0's maxima are taken
// while tile 1's chain runs; 0: one group
#ifndef INDEXCP_SCORE_G8_SPLIT
#define INDEXCP_SCORE_G8_SPLIT 1
#endif
constexpr bool kG8Split = INDEXCP_SCORE_G8_SPLIT != 0;
// The producer form's math loop for NVFP4 keys rotated (1: the next stage is taken while tile 1 of
// a block runs, the block's scores stored after the next issue; see the top), or in block order
// (0). INDEXCP_SCORE_G8_TURNS=0 drops the rotated loop's turns (measured 1-2% slower: v27).
#ifndef INDEXCP_SCORE_G8_ROTATED
#define INDEXCP_SCORE_G8_ROTATED 1
#endif
constexpr bool kG8Rotated = INDEXCP_SCORE_G8_ROTATED != 0;
#ifndef INDEXCP_SCORE_G8_TURNS
#define INDEXCP_SCORE_G8_TURNS 1
#endif
#ifndef INDEXCP_SCORE_G8_DEBUG
#define INDEXCP_SCORE_G8_DEBUG 0
#endif
constexpr int kG8Vectors = 256;  // query vectors per CTA: 128 per warpgroup (NT = 16 each)
#ifndef INDEXCP_SCORE_G8_STAGES
#define INDEXCP_SCORE_G8_STAGES 12
#endif
// The fp32 form's raw key bytes: a ring in shared memory, cp.async'd several blocks ahead (1), or
// one pair ahead in registers (0), per key type: NVFP4 caches (RAW4) and E4M3 rows (RAW8: the
// gather's FP8 rows, an FP8 cache); 4 fp16 stages with the registers, 3 beside the ring (the most
// that fits). Its expansion of the next block after a block's chains are issued (0) or before (1).
// Measured: bench/NOTES.md v21.
#ifndef INDEXCP_SCORE_G16_RAW4
#define INDEXCP_SCORE_G16_RAW4 0
#endif
#ifndef INDEXCP_SCORE_G16_RAW8
#define INDEXCP_SCORE_G16_RAW8 1
#endif
#ifndef INDEXCP_SCORE_G16_EARLY
#define INDEXCP_SCORE_G16_EARLY 0
#endif
// The fp32 form's first key loads of a request issued before its query tile is converted (1), or
// after (0)
#ifndef INDEXCP_SCORE_G16_KEYS_FIRST
#define INDEXCP_SCORE_G16_KEYS_FIRST 1
#endif
// The wgmma descriptors: from one warp-uniform base per operand plus a constant per k-step (1), or
// each computed from its shared-memory address (0); 2: 1 for NVFP4 keys and in fp8_mma, 0 for the
// fp32 form's E4M3 rows (the fastest of each on an H100, bench/NOTES.md v23)
#ifndef INDEXCP_SCORE_G8_UDESC
#define INDEXCP_SCORE_G8_UDESC 2
#endif
// Keys through the threads (NVFP4 keys; the fp32 form's E4M3 rows): a warp takes both halves of 16
// rows, so its loads cover whole rows, and each quarter warp's 16-byte stores go to 8 rows of one
// half (no bank conflict) (1); or thread t takes half t / 128 of row t % 128 (0). Measured:
// bench/NOTES.md v23
#ifndef INDEXCP_SCORE_G8_PAIRLANES
#define INDEXCP_SCORE_G8_PAIRLANES 1
#endif
#ifndef INDEXCP_SCORE_G16_STAGES
#define INDEXCP_SCORE_G16_STAGES 0  // 0: 3 with the raw ring, 4 without
#endif
// The shapes of the two forms. fp8_mma (F16 false): a stage holds a block's raw E4M3 key bytes (16
// KiB), the queries are registers. fp32 (F16, "gemm16"): a stage holds a block's keys as fp16 (32
// KiB: two 16 KiB halves of 64 dimensions, as the 128-byte swizzle holds 64 fp16 per row), the
// CTA's 256 query vectors sit in shared memory as fp16 too (64 KiB, the same two halves), and,
// with the raw ring (kRaw), the raw key bytes that each thread converts into a stage come from a
// ring of its own in shared memory (kRawSlots blocks ahead, cp.async): piece k (8 bytes of NVFP4
// codes or scales, 16 bytes of FP8) of thread t at (k * 256 + t) * kRawPiece of its slot, so a
// warp's reads are contiguous.
// The producer form (PROD, fp8_mma only; see the top): its warpgroup's registers and the math
// warpgroups' (setmaxnreg; the launch allows 168 per thread for 384 threads): kProdRegs for the
// producer, kMathRegs for the math warps (128 accumulators and 32 query registers each; 192 / 120
// leave no spill in either role; a first producer, with a ring of raw blocks, spilled at 40 and 56).
#ifndef INDEXCP_SCORE_G8P_PREGS
#define INDEXCP_SCORE_G8P_PREGS 120
#endif
#ifndef INDEXCP_SCORE_G8P_MREGS
#define INDEXCP_SCORE_G8P_MREGS 192
#endif
constexpr int kProdRegs = INDEXCP_SCORE_G8P_PREGS, kMathRegs = INDEXCP_SCORE_G8P_MREGS;
// The launch gives each of the 384 threads kLaunchRegs (the launch bounds' 65,536 / 384, rounded down
// to a multiple of 8); setmaxnreg.inc takes registers from what the producer's setmaxnreg.dec gave
// back to the CTA's pool, and blocks (here: forever) when the pool is short. So the split must fit
// what the launch allocated, not the register file.
constexpr int kLaunchRegs = (65536 / 384) & ~7;  // 168
static_assert(kProdRegs % 8 == 0 && kMathRegs % 8 == 0 && kProdRegs >= 24 && kProdRegs <= kLaunchRegs &&
                  kMathRegs >= kLaunchRegs && kMathRegs <= 256 && 128 * kProdRegs + 256 * kMathRegs <= 384 * kLaunchRegs,
              "INDEXCP_SCORE_G8P_PREGS / MREGS: multiples of 8, 24 <= PREGS <= 168 <= MREGS <= 256, and "
              "128 x PREGS + 256 x MREGS <= 384 x 168 (the registers the launch allocates)");
template <bool PROD>
constexpr int g8_threads() { return PROD ? 384 : kG8Threads; }
template <bool F16, bool NVFP4, bool PROD = false>
struct G8Form {
  static_assert(!(PROD && F16), "the producer warpgroup is a form of fp8_mma only");
  static constexpr int kThreads = g8_threads<PROD>();
  static constexpr bool kRaw = F16 && (NVFP4 ? INDEXCP_SCORE_G16_RAW4 : INDEXCP_SCORE_G16_RAW8);  // F16: the raw ring
  static constexpr int kStages = !F16 ? INDEXCP_SCORE_G8_STAGES
                                      : INDEXCP_SCORE_G16_STAGES > 0 ? INDEXCP_SCORE_G16_STAGES : (kRaw ? 3 : 4);  // the ring
  static constexpr int kAhead = kStages - 2;                                                 // blocks in flight
  static constexpr int kStageBytes = kBlockTokens * kHeadDim * (F16 ? 2 : 1);
  static constexpr int kHalfBytes = kBlockTokens * 128;               // F16: one 64-dimension half of a stage
  static constexpr int kQBytes = F16 ? kG8Vectors * kHeadDim * 2 : 0;  // F16: the query tile
  static constexpr int kRawPiece = NVFP4 ? 8 : 16;                    // F16: the raw ring
  static constexpr int kRawPieces = NVFP4 ? 5 : 4;                    // (4 code pieces and the scales / 4 pieces)
  static constexpr int kRawSlotBytes = kG8Threads * kRawPieces * kRawPiece;
  static constexpr int kRawSlots = kRaw ? (NVFP4 ? 5 : 3) : 0;
  static constexpr bool kEarly = F16 && INDEXCP_SCORE_G16_EARLY;  // the expansion before the chains
  static constexpr bool kKeysFirst = F16 && INDEXCP_SCORE_G16_KEYS_FIRST;  // key loads before the query tile
  static constexpr bool kUDesc = INDEXCP_SCORE_G8_UDESC == 2 ? (!F16 || NVFP4) : INDEXCP_SCORE_G8_UDESC != 0;  // uniform bases
  static_assert(kStages >= (F16 ? 3 : 4), "INDEXCP_SCORE_G8_STAGES: at least 4; INDEXCP_SCORE_G16_STAGES: at least 3");
  static_assert(INDEXCP_SCORE_G8_UDESC >= 0 && INDEXCP_SCORE_G8_UDESC <= 2, "INDEXCP_SCORE_G8_UDESC: 0, 1 or 2");
};
template <bool F16, bool NVFP4, bool PROD = false>
constexpr int gemm8_smem_bytes() {
  using S = G8Form<F16, NVFP4, PROD>;
  return 1024 /* alignment of the swizzled stages */ + S::kStages * S::kStageBytes + S::kQBytes +
         S::kRawSlots * S::kRawSlotBytes + (2 * S::kStages + 2) * 8 /* mbarriers */ + S::kStages * 4 +
         (kPlanLocal + 2) * 4 + 8 /* alignment of the table */ + 256 * 8 /* the NVFP4 k_hat table */;
}
// cp.async of 8 (through L1) or 16 bytes (L2 only), its commit and its wait for all but the N newest
// groups (one group per block of the fp32 form's raw ring)
template <int N>
__device__ __forceinline__ void cp_async_n(uint32_t dst, const void* src) {
  if constexpr (N == 16) asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
  else asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(dst), "l"(src), "n"(N) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// 4 bytes global -> shared (cp.async, through L1), the row offsets as immediates of the instruction
template <int DOFF, int SOFF>
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0+%2], [%1+%3], 4;" ::"r"(dst), "l"(src), "n"(DOFF), "n"(SOFF) : "memory");
}
// Rows i = 0..15 of a run: dst[i & 7] holds the lane's swizzled address of row i & 7.
template <int I = 0>
__device__ __forceinline__ void cp_async_run(const uint32_t (&dst)[8], const uint8_t* src) {
  if constexpr (I < 16) {
    cp_async4<(I & 8) * kHeadDim, I * kHeadDim>(dst[I & 7], src);
    cp_async_run<I + 1>(dst, src);
  }
}
// A value every lane of the warp holds, made visibly uniform for ptxas (redux.sync writes a uniform
// register): the loops and branches around the wgmma instructions are then convergent (otherwise
// ptxas serializes the wgmma instructions: C7518).
__device__ __forceinline__ int32_t uniform(int32_t x) { return __reduce_max_sync(0xffffffffu, x); }
// The thread's arrival on a stage's `full` barrier when its cp.async copies so far have landed
// (counted in the barrier's expected count: .noinc).
__device__ __forceinline__ void cp_async_arrive(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_u32(bar)) : "memory");
}
// The descriptor of a K-major tile in the 128-byte swizzle (B, the keys; in the fp32 form A too;
// PTX ISA, "Matrix Descriptor Format"): start address (the stage, 1024-aligned, plus 32 bytes per
// k-step), LBO unused (1), SBO = 1024 bytes between groups of 8 rows, layout type 1 (128B swizzle)
// in bits 62-63.
// sw128_desc_lo: its low word (address and LBO); sw128_desc_of: the descriptor of a low word. The
// address field (bits 0-13) holds a shared-memory address / 16 below 256 KiB, so lo + offset / 16
// stays in it (no carry into the LBO field) for every address of the CTA's shared memory
// (INDEXCP_SCORE_G8_UDESC).
__device__ __forceinline__ uint32_t sw128_desc_lo(uint32_t saddr) { return ((saddr & 0x3FFFFu) >> 4) | (1u << 16); }
__device__ __forceinline__ uint64_t sw128_desc_of(uint32_t lo) {
  return static_cast<uint64_t>(lo) | (uint64_t{1024 >> 4} << 32) | (uint64_t{1} << 62);
}
__device__ __forceinline__ uint64_t sw128_desc(uint32_t saddr) { return sw128_desc_of(sw128_desc_lo(saddr)); }

// The block-table entry of pair s of request b (a page id, or the gather's unit), or -1 past the
// pages the request needs. Read one pair ahead of its use (the refills' `pend`), so that its load
// latency is not waited for in the loop. Uniform over the CTA.
template <bool GATHER>
__device__ __forceinline__ int32_t gemm8_bt(const ScoreArgs& a, const Geo& G, int32_t b, const ReqInfo& ri, int32_t s) {
  const int32_t lp = GATHER ? (s * kBlockTokens) >> G.lgP : s >> (G.lgR - 7);
  if (GATHER ? s >= ri.max_local : lp >= ri.npages_needed) return -1;
  return a.block_table[static_cast<int64_t>(b) * a.max_pages + lp];
}

// Row j of pair s (block-table entry `page`) at *src: for the copies, the first of the 16 rows of
// warp w (j = 16 w), contiguous in memory (R is a multiple of 16 and a block starts on a multiple
// of 128 of its page); for the fp32 form, the thread's own row. False when the pair is not scored
// (past the request's historical blocks, filtered out, or an invalid page id): uniform over the
// CTA.
template <bool GATHER>
__device__ __forceinline__ bool gemm8_rows(const ScoreArgs& a, const Geo& G, const ReqInfo& ri, int32_t s, int32_t page,
                                           int j, int32_t* blk, const uint8_t** src) {
  if (GATHER) {
    if (s >= ri.max_local || page < 0 || page >= a.keys.num_pages) return false;
    *blk = s;
    const int32_t u = ((s * kBlockTokens) & (G.P - 1)) + j;
    const int32_t owner = u >> G.lgR, row = u & (G.R - 1);  // owner rank and local row of offset u
    *src = a.keys.base + ((static_cast<int64_t>(owner) * a.keys.num_pages + page) * G.R + row) * kHeadDim;
    return true;
  }
  const int32_t lgspp = G.lgR - 7;  // blocks per page on this rank: R / 128 (R >= 128 here)
  const int32_t lp = s >> lgspp;
  if (lp >= ri.npages_needed) return false;
  const int32_t j0 = (s & ((1 << lgspp) - 1)) << 7;
  const int32_t bk = ((lp << G.lgP) + G.rank_off + j0) >> 7;
  if (bk >= ri.max_local) return false;
  if (a.filter_mod > 1 && bk % a.filter_mod != a.filter_res) return false;
  if (page < 0 || page >= a.keys.num_pages) return false;
  *blk = bk;
  *src = a.keys.base + page * G.stride + static_cast<int64_t>(j0 + j) * G.rowb;
  return true;
}

// NVFP4 (R >= 128): the page of pair s (block-table entry `page`) and the block's first row j0 on
// it, or false (the checks of gemm8_rows). Uniform over the CTA.
__device__ __forceinline__ bool gemm8_page(const ScoreArgs& a, const Geo& G, const ReqInfo& ri, int32_t s, int32_t page,
                                           int32_t* blk, const uint8_t** pg, int32_t* j0) {
  const int32_t lgspp = G.lgR - 7;
  const int32_t lp = s >> lgspp;
  if (lp >= ri.npages_needed) return false;
  *j0 = (s & ((1 << lgspp) - 1)) << 7;
  const int32_t bk = ((lp << G.lgP) + G.rank_off + *j0) >> 7;
  if (bk >= ri.max_local) return false;
  if (a.filter_mod > 1 && bk % a.filter_mod != a.filter_res) return false;
  if (page < 0 || page >= a.keys.num_pages) return false;
  *blk = bk;
  *pg = a.keys.base + page * G.stride;
  return true;
}

// NVFP4 with E4M3 rounding: the k_hat table entry of scale byte g (0..7) of `scales` (the entry
// carries the scale's sign: form_khat_entry), from the table's generic address, or from its
// shared-memory address, which the producer warpgroup passes: there the byte is taken by one prmt
// and the entry's address by one mad (written in PTX, since the compiler otherwise turns the
// index into a shift, a mask and an add). That asm is not volatile and has no memory clobber,
// which is safe because the table is written once, before the kernel's first __syncthreads, and
// the index comes from loads made after it.
__device__ __forceinline__ uint2 g8_scale_entry(uint64_t scales, int g, const uint2* lut) {
  return lut[static_cast<uint32_t>(scales >> (8 * g)) & 0xffu];
}
__device__ __forceinline__ uint2 g8_scale_entry(uint64_t scales, int g, uint32_t lut_s) {
  const uint32_t w = static_cast<uint32_t>(scales >> (g >= 4 ? 32 : 0));
  uint2 v;
  asm("{\n.reg .b32 e, a;\nprmt.b32 e, %2, %3, %4;\nmad.lo.u32 a, e, 8, %5;\nld.shared.v2.u32 {%0, %1}, [a];\n}"
      : "=r"(v.x), "=r"(v.y)
      : "r"(w), "r"(0u), "r"(0x4440u | static_cast<uint32_t>(g & 3)), "r"(lut_s));
  return v;
}

// NVFP4 with E4M3 rounding: half h of one key row (8 of its 16 code words, 4 of its 8 scale bytes)
// expanded to its signed E4M3 bytes (form_khat_bytes, the table entry of the scale) and stored as
// swizzled 16-byte chunks 4h .. 4h + 3 of its row of the stage. Chunk c holds pieces c, c + 8,
// c + 16, c + 24 (word t4 = piece c + 8 t4 = dims 4c + 32 t4 .. + 3), i.e. the lo (c even) or hi
// (c odd) bytes of code words c / 2 + 4 t4: half h needs words 2h + jj + 4k (jj = 0, 1; k = 0..3),
// rw[k] = (word 2h + 4k, word 2h + 1 + 4k), of scale group h + 2k. A warp's 8 consecutive rows
// write 8 different chunk positions per 16-byte store: no conflict.
template <class LUT>
__device__ __forceinline__ void gemm8_expand_half(const uint2 (&rw)[4], uint64_t scales, int h, LUT lut, uint32_t row_addr,
                                                  uint32_t r7) {
  uint32_t lo[2][4], hi[2][4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const uint2 l = g8_scale_entry(scales, h + 2 * k, lut);
    form_khat_bytes(rw[k].x, l.x, l.y, &lo[0][k], &hi[0][k]);
    form_khat_bytes(rw[k].y, l.x, l.y, &lo[1][k], &hi[1][k]);
  }
#pragma unroll
  for (int c4 = 0; c4 < 4; ++c4) {
    const int jj = c4 >> 1;
    const bool odd = c4 & 1;  // (c = 4h + c4 has the parity of c4)
    const uint32_t dst = row_addr + (((static_cast<uint32_t>(4 * h + c4)) ^ r7) << 4);
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(dst), "r"(odd ? hi[jj][0] : lo[jj][0]),
                 "r"(odd ? hi[jj][1] : lo[jj][1]), "r"(odd ? hi[jj][2] : lo[jj][2]), "r"(odd ? hi[jj][3] : lo[jj][3])
                 : "memory");
  }
}

// The fp32 form (F16): one 128-byte row of a 64-dimension half h of a stage (a key) or of the query
// tile (a query vector) from its 8 logical 16-byte chunks: chunk c = 2 (s & 3) + pair holds the
// fp16 pair `pair` of k-step s = 4 h + (c >> 1) of quad lanes t4 = 0..3 (ch[c][t4]: k slots
// 8 pair + 2 t4, + 1 of the k-step, dims form_dim(s, t4, pair, 0..1)), stored at physical chunk
// c ^ (row & 7). Keys and queries take the same places, so the k-step multiplies the dimensions
// of the tile scorer's k-step in the same k slots (A and B swapped, as in the fp8_mma form).
__device__ __forceinline__ void g16_store_row(const uint32_t (&ch)[8][4], uint32_t row_addr, uint32_t r7) {
#pragma unroll
  for (int c = 0; c < 8; ++c)
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(row_addr + ((static_cast<uint32_t>(c) ^ r7) << 4)),
                 "r"(ch[c][0]), "r"(ch[c][1]), "r"(ch[c][2]), "r"(ch[c][3])
                 : "memory");
}
// E4M3 bytes (the gather's FP8 rows, an FP8 cache, the queries) into half h of a row:
// x[t4] = bytes 32 t4 + 16 h .. + 15 of the row, whose word i (dims 32 t4 + 4 (4 h + i) .. + 3) is
// k-step 4 h + i: its first pair (bytes 0, 1) goes to chunk 2 i, its second to 2 i + 1
// (form_expand_fp8).
__device__ __forceinline__ void g16_store_fp8(const uint4 (&x)[4], uint32_t row_addr, uint32_t r7) {
  uint32_t ch[8][4];
#pragma unroll
  for (int t4 = 0; t4 < 4; ++t4) {
    const uint32_t w[4] = {x[t4].x, x[t4].y, x[t4].z, x[t4].w};
#pragma unroll
    for (int i = 0; i < 4; ++i) form_expand_fp8(w[i], &ch[2 * i][t4], &ch[2 * i + 1][t4]);
  }
  g16_store_row(ch, row_addr, r7);
}
// NVFP4 with E4M3 rounding into half h of a key row: rw[t4] = (code word 2 h + 4 t4, word 2 h + 1 +
// 4 t4) of scale group h + 2 t4 (gemm8_expand_half's loads); word jj's fp16 pair p of
// form_expand_e4m3 (k-step 4 h + 2 jj + (p >> 1), pair p & 1) goes to chunk 4 jj + p.
__device__ __forceinline__ void g16_expand_half(const uint2 (&rw)[4], uint64_t scales, int h, const uint2* lut,
                                                uint32_t row_addr, uint32_t r7) {
  uint32_t ch[8][4];
#pragma unroll
  for (int t4 = 0; t4 < 4; ++t4) {
    const uint2 l = g8_scale_entry(scales, h + 2 * t4, lut);
    uint32_t v0[4], v1[4];
    form_expand_e4m3(rw[t4].x, l.x, l.y, v0);
    form_expand_e4m3(rw[t4].y, l.x, l.y, v1);
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      ch[p][t4] = v0[p];
      ch[4 + p][t4] = v1[p];
    }
  }
  g16_store_row(ch, row_addr, r7);
}
// 4 bytes of a query row as one word (byte loads where q is not aligned for the word), and 16
__device__ __forceinline__ uint32_t g8_q_word(const uint8_t* p, bool aligned) {
  return aligned ? *reinterpret_cast<const uint32_t*>(p)
                 : static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 | static_cast<uint32_t>(p[2]) << 16 |
                       static_cast<uint32_t>(p[3]) << 24;
}
__device__ __forceinline__ uint4 g16_load16(const uint8_t* p, bool aligned) {
  if (aligned) return *reinterpret_cast<const uint4*>(p);
  return make_uint4(g8_q_word(p, false), g8_q_word(p + 4, false), g8_q_word(p + 8, false), g8_q_word(p + 12, false));
}

// The epilogue of one block, in two parts. gemm8_block_max: the maxima over the thread's 32 columns
// of m64 tile m (rows g, g + 8 of its warp's 16: values 2 m + r), as a tree (depth 5, not a chain
// of 16: one warp per scheduler runs it, so its latency counts). gemm8_store: the four values
// reduce-scattered over the quad so that lane t4 ends with value t4 over all 128 keys (3 shuffles),
// written where the block is historical for the vector's row. fmaxf drops NaN as fold_max does, and
// max is exact, so the order of the reduction does not change the result.
__device__ __forceinline__ void gemm8_block_max(const float (&acc)[16][4], float* r0, float* r1) {
  float x[16], y[16];
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    x[j] = fmaxf(acc[j][0], acc[j][1]);
    y[j] = fmaxf(acc[j][2], acc[j][3]);
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    x[j] = fmaxf(x[j], x[j + 8]);
    y[j] = fmaxf(y[j], y[j + 8]);
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    x[j] = fmaxf(x[j], x[j + 4]);
    y[j] = fmaxf(y[j], y[j + 4]);
  }
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    x[j] = fmaxf(x[j], x[j + 2]);
    y[j] = fmaxf(y[j], y[j + 2]);
  }
  x[0] = fmaxf(x[0], x[1]);
  y[0] = fmaxf(y[0], y[1]);
  *r0 = x[0];
  *r1 = y[0];
}
__device__ __forceinline__ void gemm8_store(const float (&v)[4], int t4, int32_t blk, float* out, int64_t obase,
                                            int32_t olim) {
  const bool hi = t4 & 2, lo = t4 & 1;
  const float w0 = fmaxf(hi ? v[2] : v[0], __shfl_xor_sync(0xffffffffu, hi ? v[0] : v[2], 2));
  const float w1 = fmaxf(hi ? v[3] : v[1], __shfl_xor_sync(0xffffffffu, hi ? v[1] : v[3], 2));
  const float x = fmaxf(lo ? w1 : w0, __shfl_xor_sync(0xffffffffu, lo ? w0 : w1, 1));
  if (blk < olim) out[obase + blk] = x;
}

// Query slice y (256 vectors: rows y * 256 / nh .. (y * 256 + 255) / nh of each request), and its
// pairs over all requests: the total of that slice's plan (plan_block). For the persistent grid.
__device__ __forceinline__ Slice gemm8_slice(const ScoreArgs& a, int32_t y) {
  const int32_t v0 = y * kG8Vectors;
  return Slice{v0, (v0 + kG8Vectors - 1) / a.nh};
}
template <bool GATHER>
__device__ __forceinline__ int64_t gemm8_slice_pairs(const ScoreArgs& a, int32_t y) {
  const Slice sl = gemm8_slice(a, y);
  int64_t t = 0;
  for (int32_t b = 0; b < a.rows.num_requests; ++b) t += num_pairs<GATHER>(a, request_info(a, b, sl));
  return t;
}

// NVFP4: the keys are an NVFP4 cache with E4M3 rounding and R >= 128 (not GATHER), expanded by the
// threads into the stage (half a row each) instead of copied. F16: the fp32 form (G8Form): wgmma
// m64n128k16 on fp16 operands, both in shared memory; every key passes through the threads (FP8
// bytes converted, NVFP4 expanded: half a row each) and the queries are converted once per request.
// PROD: the producer form (fp8_mma only; see the top): threads 256 .. 383 fill the stages, the two
// math warpgroups (threads 0 .. 255) only multiply.
template <bool GATHER, bool NVFP4, bool F16 = false, bool PROD = false>
__global__ void __launch_bounds__(g8_threads<PROD>(), 1) gemm8_score_kernel(const ScoreArgs a) {
#if INDEXCP_HAVE_WGMMA
  using S = G8Form<F16, NVFP4, PROD>;
  constexpr int kStages = S::kStages;
  constexpr int kT = S::kThreads;
  extern __shared__ __align__(128) unsigned char g8_smem[];
  __shared__ typename cub::BlockScan<int32_t, kT>::TempStorage scan_tmp;
  uint8_t* stages = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(g8_smem) + 1023) & ~uintptr_t{1023});
  uint8_t* qtile = stages + kStages * S::kStageBytes;  // F16: [2 halves][256 vectors][128 bytes]
  uint8_t* rawring = qtile + S::kQBytes;               // F16: [kRawSlots][kRawPieces][256 threads][kRawPiece]
  uint64_t* full = reinterpret_cast<uint64_t*>(rawring + S::kRawSlots * S::kRawSlotBytes);  // [kStages]
  uint64_t* empty = full + kStages;                                   // [kStages]
  uint64_t* turn = empty + kStages;  // [2]: warpgroup 0 / 1 has issued its chains of a block
  int32_t* smeta = reinterpret_cast<int32_t*>(turn + 2);  // [kStages]: the block of a stage (-1: PROD, the request's end)
  int32_t* splan = smeta + kStages;                       // [kPlanLocal + 2]
  uint2* lut = reinterpret_cast<uint2*>((reinterpret_cast<uintptr_t>(splan + kPlanLocal + 2) + 7) & ~uintptr_t{7});  // [256] (NVFP4)
  // The table's entries are loaded first and stored after the share's loads are issued, so that the
  // two latencies overlap (bench/NOTES.md v31).
  [[maybe_unused]] uint2 lut_v{};
  if constexpr (NVFP4)
    if (threadIdx.x < 256) lut_v = g_khat_lut[threadIdx.x];  // (signed entries: form_khat_entry)

  const int32_t B = a.rows.num_requests;
  // The work: the pairs of every query slice (256 vectors each, y = 0 .. slices - 1). Either each
  // CTA takes a share of one slice's pairs (grid x = CTAs per slice, y = slices), or, persistent
  // (a.g8_slices > 0, grid y = 1: gemm8_persistent), an equal share of all slices' pairs in slice
  // order, slice by slice ("segments"), so that every multiprocessor gets the same work whatever
  // the slices' sizes (a prefill chunk's later rows see more blocks) and fills its ring once per
  // segment rather than once per CTA of a wave.
  const int32_t nslices = a.g8_slices;
  const bool persist = nslices > 0;
  int32_t y = blockIdx.y;   // the segment's slice
  int64_t lo = 0, hi = 0;   // persistent: this CTA's share of all slices' pairs
  int64_t pre = 0;          // persistent: the pairs of slices before y
  bool idle = false;        // persistent: a CTA of no pairs (W below the CTA count)
  bool second = false;      // persistent: the share goes on into slice y + 1
  using Scan64 = cub::BlockScan<int64_t, kT>;
  __shared__ typename Scan64::TempStorage scan64;
  __shared__ int64_t s_first[3];  // the first slice of the share, the pairs before it and its pairs
  // this thread's slice of the first kT (persistent; not read again below)
  const int64_t t_first = persist && static_cast<int32_t>(threadIdx.x) < nslices
                              ? gemm8_slice_pairs<GATHER>(a, static_cast<int32_t>(threadIdx.x)) : 0;
  if constexpr (NVFP4)
    if (threadIdx.x < 256) lut[threadIdx.x] = lut_v;
  if (threadIdx.x == 0) {
    for (int i = 0; i < kStages; ++i) {
      // every filling thread's copies (expansion), and the block index of the first of them
      mbar_init(&full[i], (PROD ? 128 : kG8Threads) + 1);
      mbar_init(&empty[i], kG8Threads);     // every math thread's chains done
    }
    mbar_init(&turn[0], kG8Threads / 2);  // the threads of one warpgroup
    mbar_init(&turn[1], kG8Threads / 2);
    mbar_fence_init();
  }
  __syncthreads();

  if (persist) {
    // the slice holding pair lo: the thread of slice yy with pairs t and excl before it
    auto find = [&](int32_t yy, int64_t t, int64_t before) {
      if (t > 0 && before <= lo && lo < before + t) {
        s_first[0] = yy;
        s_first[1] = before;
        s_first[2] = t;
      }
    };
    int64_t W = 0;
    if (nslices <= kT) {  // one scan: each slice is one thread's (the usual case: 64 slices at 8,192 rows and 2 heads)
      int64_t excl;
      Scan64(scan64).ExclusiveSum(t_first, excl, W);
      lo = W * blockIdx.x / gridDim.x;
      hi = W * (blockIdx.x + 1) / gridDim.x;
      idle = lo >= hi;  // (no pairs: only the fill below, if any)
      if (!idle) find(static_cast<int32_t>(threadIdx.x), t_first, excl);
      __syncthreads();  // s_first is written
    } else {
      for (int32_t y0 = 0; y0 < nslices; y0 += kT) {
        const int32_t yy = y0 + static_cast<int32_t>(threadIdx.x);
        const int64_t t = y0 == 0 ? t_first : yy < nslices ? gemm8_slice_pairs<GATHER>(a, yy) : 0;
        int64_t incl, tot;
        Scan64(scan64).InclusiveSum(t, incl, tot);
        W += tot;
        __syncthreads();  // scan64 is reused
      }
      lo = W * blockIdx.x / gridDim.x;
      hi = W * (blockIdx.x + 1) / gridDim.x;
      idle = lo >= hi;
      int64_t carry = 0;
      for (int32_t y0 = 0; !idle && y0 < nslices; y0 += kT) {
        const int32_t yy = y0 + static_cast<int32_t>(threadIdx.x);
        const int64_t t = y0 == 0 ? t_first : yy < nslices ? gemm8_slice_pairs<GATHER>(a, yy) : 0;
        int64_t excl, tot;
        Scan64(scan64).ExclusiveSum(t, excl, tot);
        find(yy, t, carry + excl);
        carry += tot;
        __syncthreads();  // scan64 is reused; s_first is written
        if (carry > lo) break;
      }
    }
    if (!idle) {
      y = static_cast<int32_t>(s_first[0]);
      pre = s_first[1];
      second = pre + s_first[2] < hi && y + 1 < nslices;
    }
  }

  // PROD: the plans (plan_block) of the CTA's first segment and, where the share goes on into the
  // next slice and both fit the table (a.g8_plan_ahead), of its second, computed here by the whole
  // CTA, so that at the switch between them neither role waits for the other: the producer fills
  // the next slice's stages while the math warpgroups finish the last blocks of this one
  // (bench/NOTES.md v31). Later segments (and every segment of the forms without a producer, where
  // the same threads fill and multiply) compute theirs at a CTA barrier, where the ring drains.
  __shared__ int32_t s_npre;  // the segments whose plan is ready: splan, then splan + kPlanHalf
  if (PROD && a.plan_local && !idle) {
    const Slice s0 = gemm8_slice(a, y);
    const bool two = second && a.g8_plan_ahead && B + 1 <= kPlanHalf;
    if (threadIdx.x == 0) s_npre = two ? 2 : 1;  // (read after plan_block's closing barrier)
    if (two) plan_block2<GATHER, kT>(a, s0, gemm8_slice(a, y + 1), splan, splan + kPlanHalf, scan64);
    else plan_block<GATHER, kT>(a, s0, splan, scan_tmp);
  }

  // The rest runs as one role: `producer` true for the producer warpgroup (PROD), false for the
  // math warpgroups (and every thread without PROD). PROD: each role is its own copy of the code,
  // so that ptxas can give each the registers of its setmaxnreg (the launch bounds give 168 per
  // thread; every warp of a warpgroup executes the same setmaxnreg; code both roles reached would
  // keep 168 for both).
  auto run = [&](auto role) {
    constexpr bool producer = decltype(role)::value;
    // prefill_scores' -Inf where no scorer writes (ScoreLaunch::fill_unscored), shared by the math
    // warps of every CTA of the grid, idle ones included: no scorer store touches those entries
    // (rows.cuh), so there is nothing to order. At the start: with a producer (its first plans made
    // in the prologue) the producer fills the first stages meanwhile; placed after the in-loop plan
    // it made ptxas spill in three instances (bench/NOTES.md v28). (Before the role split it made
    // ptxas spill.)
    if (!producer && a.fill_unscored) {
      constexpr int64_t wpc = kG8Threads / 32;
      const int64_t cta = static_cast<int64_t>(blockIdx.y) * gridDim.x + blockIdx.x;
      fill_unscored(a.rows, a.nh, a.max_blocks, a.block_table, a.max_pages, a.keys.layout.page_size, a.keys.num_pages,
                    a.scores, cta * wpc + (threadIdx.x >> 5), static_cast<int64_t>(gridDim.x) * gridDim.y * wpc);
    }
    if (idle) return;  // (both roles: no barrier follows)
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    const int wg = warp >> 2, wq = warp & 3;
    const Geo G(a.keys);
    // this lane's 4-byte piece p = lane of a key row: logical chunk p & 7, word p >> 3 (see the top),
    // stored in row r at r * 128 + (((p & 7) ^ (r & 7)) << 4) + 4 (p >> 3); warp w copies rows 16 w ..
    uint32_t lane_off[8];
  #pragma unroll
    for (int i = 0; i < 8; ++i)
      lane_off[i] = static_cast<uint32_t>((16 * warp + i) * kHeadDim) +
                    ((static_cast<uint32_t>(lane & 7) ^ static_cast<uint32_t>(i)) << 4) + (static_cast<uint32_t>(lane >> 3) << 2);
    // INDEXCP_SCORE_DEBUG's bits (ScoreArgs::debug) in a build with -DINDEXCP_SCORE_G8_DEBUG=1 only:
    // the checks cost registers and time in the kernel that is measured
    const int32_t dbg = INDEXCP_SCORE_G8_DEBUG ? a.debug : 0;
    const bool q_aligned = (reinterpret_cast<uintptr_t>(a.q) & (F16 ? 15u : 3u)) == 0;
    const uint32_t ring0 = smem_u32(stages), q0 = smem_u32(qtile);
    const uint32_t raw0 = smem_u32(rawring) + threadIdx.x * S::kRawPiece;  // F16: this thread's piece 0 of slot 0
    // the cursors, over the requests: the next stage to fill and its phase, the next to multiply
    int32_t ist = 0, cst = 0;
    uint32_t iph = 0, cph = 0;
    uint32_t chains = 0;  // blocks this warpgroup has issued its chains of (the turn barriers' phases)

    for (;;) {  // the segments: one (non-persistent), or the slices of the share
      const int32_t n0 = y * kG8Vectors;
      const Slice sl = a.plan_local ? gemm8_slice(a, y) : Slice{};
      const int32_t* plan = a.plan;
      if (a.plan_local) {
        // the segment's index in the share (from shared memory: a register kept over the loop made
        // ptxas spill in two instances)
        const int32_t seg = persist ? y - static_cast<int32_t>(s_first[0]) : 0;
        if (PROD && seg < s_npre) {  // computed before the roles split
          plan = seg == 0 ? splan : splan + kPlanHalf;
        } else {
          __syncthreads();  // the previous segments' reads of splan are done
          plan_block<GATHER, kT>(a, sl, splan, scan_tmp);
          plan = splan;
        }
      }
      const int64_t total = plan[B];
      int64_t p0, p1;
      if (persist) {  // the share's part of this slice
        p0 = lo > pre ? lo - pre : 0;
        p1 = hi - pre < total ? hi - pre : total;
      } else {
        p0 = total * blockIdx.x / gridDim.x;
        p1 = total * (blockIdx.x + 1) / gridDim.x;
      }
      int32_t b_first = 0;
      {
        int32_t blo = 0, bhi = B - 1;  // largest b with plan[b] <= p0
        while (blo < bhi) {
          const int32_t mid = (blo + bhi + 1) >> 1;
          if (plan[mid] <= p0) blo = mid;
          else bhi = mid - 1;
        }
        b_first = uniform(blo);
      }
      if (p0 >= p1) b_first = B;  // nothing of this slice
      for (int32_t b = b_first; b < B && uniform(plan[b] < p1); ++b) {
        const int64_t lo = plan[b] > p0 ? plan[b] : p0, hi = plan[b + 1] < p1 ? plan[b + 1] : p1;
        const int32_t s0 = uniform(static_cast<int32_t>(lo - plan[b])), s1 = uniform(static_cast<int32_t>(hi - plan[b]));
        if (s0 >= s1) continue;
        const ReqInfo ri = request_info(a, b, sl);
        const int32_t nvec = ri.cnt * a.nh;
        if (!uniform(n0 < nvec)) continue;  // a slice past the request's vectors scores nothing
        // A: query vectors v(m, r) = n0 + 128 wg + 64 m + 16 wq + g + 8 r (rows g, g + 8 of this warp's
        // 16 in m64 tile m), raw E4M3 words of form8_dim: k-step s8 takes dims 32 t4 + 8 s8 + 0..3 (a0
        // row g, a1 row g + 8) and + 4..7 (a2, a3)
        const int32_t nw = n0 + 128 * wg;  // this warpgroup's first vector
        [[maybe_unused]] uint32_t qa[2][4][4];  // (fp8_mma)
        // the fp32 form: vector n0 + tid as fp16 into row tid of the query tile
        auto f16_queries = [&]() {
          __syncthreads();  // every thread's chains of the previous request are done (wg_wait0)
          const int32_t v = n0 + static_cast<int32_t>(threadIdx.x);
          uint4 x[2][4];
    #pragma unroll
          for (int h = 0; h < 2; ++h)
    #pragma unroll
            for (int t4q = 0; t4q < 4; ++t4q) x[h][t4q] = make_uint4(0u, 0u, 0u, 0u);  // (+0.0) past nvec
          if (v < nvec) {
            const int32_t i = v / a.nh, hh = v % a.nh;
            const uint8_t* qv = a.q + ((static_cast<int64_t>(ri.row0) + i) * a.heads + a.h0 + hh) * kHeadDim;
    #pragma unroll
            for (int h = 0; h < 2; ++h)
    #pragma unroll
              for (int t4q = 0; t4q < 4; ++t4q) x[h][t4q] = g16_load16(qv + 32 * t4q + 16 * h, q_aligned);
          }
    #pragma unroll
          for (int h = 0; h < 2; ++h)
            g16_store_fp8(x[h], q0 + static_cast<uint32_t>(h * kG8Vectors * 128 + threadIdx.x * 128), threadIdx.x & 7u);
          asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the stores, for wgmma (async proxy)
          __syncthreads();
        };
        if constexpr (F16) {
          if (!S::kKeysFirst) f16_queries();
        } else if (!producer) {
    #pragma unroll
        for (int m = 0; m < 2; ++m)
    #pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int32_t v = nw + 64 * m + 16 * wq + g + 8 * r;
            const uint8_t* qv = nullptr;
            if (v < nvec) {
              const int32_t i = v / a.nh, hh = v % a.nh;
              qv = a.q + ((static_cast<int64_t>(ri.row0) + i) * a.heads + a.h0 + hh) * kHeadDim + 32 * t4;
            }
    #pragma unroll
            for (int s8 = 0; s8 < 4; ++s8)
    #pragma unroll
              for (int half = 0; half < 2; ++half) {
                uint32_t w = 0u;  // (= +0.0 in E4M3) for vectors past nvec
                if (qv != nullptr) {
                  const uint8_t* p = qv + 8 * s8 + 4 * half;
                  w = g8_q_word(p, q_aligned);
                }
                qa[m][s8][2 * half + r] = w;
              }
          }
        }
        // the score this lane writes: value t4 of the epilogue, vector v(t4 >> 1, t4 & 1)
        int64_t obase = 0;
        int32_t olim = 0;
        if (!producer) {
          const int32_t v = nw + 64 * (t4 >> 1) + 16 * wq + g + 8 * (t4 & 1);
          if (v < nvec) {
            const int32_t i = v / a.nh, hh = v % a.nh;
            olim = (ri.seq - ri.cnt + i) >> 7;  // historical blocks of this row (spec/indexer.md section 2)
            obase = ((static_cast<int64_t>(ri.row0) + i) * a.nh + hh) * a.max_blocks;
          }
        }

        // the request's blocks: pairs s0 .. s1 - 1, each copied by all 8 warps and multiplied by both
        // warpgroups
        int32_t next = s0;  // the next pair to look at
        int32_t pend = gemm8_bt<GATHER>(a, G, b, ri, next);  // its block-table entry
        int head = 0;       // blocks of this request issued
        // the next scored pair into stage ist, once both warpgroups are done with it: copied (FP8 keys)
        auto next_stage = [&]() {
          mbar_wait(&empty[ist], iph ^ 1u);  // (a fresh barrier: the phase before it counts as done)
          return ring0 + static_cast<uint32_t>(ist * S::kStageBytes);
        };
        auto published = [&](int32_t blk) {  // the stage's block index; the cursor moves on
          if (threadIdx.x == (PROD ? kG8Threads : 0)) {
            smeta[ist] = blk;
            mbar_arrive(&full[ist]);
          }
          if (++ist == kStages) {
            ist = 0;
            iph ^= 1u;
          }
          ++head;
        };
        // the next scored pair from `next` on (uniform): its block and the source of its row j (the
        // copies: 16 w; the threads' own rows: xrow), or for NVFP4 its page and first row there;
        // false past s1
        // (src16: FP8 keys, also the source of row j + 16, which need not follow row j + 15 in the
        // gather's rows)
        auto walk = [&](int j, int32_t* blk, const uint8_t** src, int32_t* j0, const uint8_t** src16 = nullptr) -> bool {
          while (next < s1) {
            const int32_t s = next, page = pend;
            ++next;
            pend = next < s1 ? gemm8_bt<GATHER>(a, G, b, ri, next) : -1;  // used by the next refill
            if constexpr (NVFP4) {
              if (gemm8_page(a, G, ri, s, page, blk, src, j0)) return true;
            } else {
              if (gemm8_rows<GATHER>(a, G, ri, s, page, j, blk, src)) {
                if (src16 != nullptr) gemm8_rows<GATHER>(a, G, ri, s, page, j + 16, blk, src16);
                return true;
              }
            }
          }
          return false;
        };
        // Keys through the threads: each expands (converts) half xh of row xrow into the stage: from
        // registers loaded one pair ahead (load_next: fp8_mma NVFP4, and fp32 without the ring, NVFP4
        // by default), or in fp32 with the ring (kRaw, E4M3 rows by default) from the thread's raw
        // ring (raw_fill: kRawSlots pairs ahead, cp.async; rblk: their blocks, oldest first, -1 past
        // the request's pairs; rslot: the slot of the oldest).
        // (PAIRLANES: lanes 0-7 of each 16 take half 0 of 8 rows, lanes 8-15 half 1 of the same rows;
        // otherwise row tid & 127, half wg)
        const int xrow = INDEXCP_SCORE_G8_PAIRLANES ? static_cast<int>(((threadIdx.x >> 4) << 3) | (threadIdx.x & 7))
                                                   : static_cast<int>(threadIdx.x & 127);
        const int xh = INDEXCP_SCORE_G8_PAIRLANES ? static_cast<int>((threadIdx.x >> 3) & 1) : wg;  // the half of the row
        [[maybe_unused]] uint2 rw[4];  // NVFP4: code words 2 xh + 4 t4 (.x) and + 1 (.y)
        [[maybe_unused]] uint64_t rsc = 0;  // NVFP4: the row's scale bytes
        [[maybe_unused]] uint4 rx[4];  // F16, E4M3 keys: bytes 32 t4 + 16 xh .. + 15 of the row (g16_store_fp8)
        int32_t raw_blk = -1;
        [[maybe_unused]] int32_t rblk[S::kRawSlots > 0 ? S::kRawSlots : 1] = {};
        [[maybe_unused]] int rslot = 0;
        auto load_next = [&]() {  // the register path (fp8_mma NVFP4; fp32 without the raw ring)
          int32_t blk, j0;
          const uint8_t* src;
          raw_blk = -1;
          if (!walk(xrow, &blk, &src, &j0)) return;
          raw_blk = blk;
          if (dbg & 2) return;  // benchmarking aid: no key loads
          if constexpr (NVFP4) {
            const uint8_t* rowp = src + static_cast<int64_t>(j0 + xrow) * kNvfp4DataBytesPerKey + 8 * xh;
    #pragma unroll
            for (int k = 0; k < 4; ++k) rw[k] = *reinterpret_cast<const uint2*>(rowp + 16 * k);
            rsc = *reinterpret_cast<const uint64_t*>(src + G.scale0 + static_cast<int64_t>(j0 + xrow) * kNvfp4ScalesPerKey);
          } else {
    #pragma unroll
            for (int k = 0; k < 4; ++k) rx[k] = *reinterpret_cast<const uint4*>(src + 32 * k + 16 * xh);
          }
        };
        auto raw_fill = [&](int slot) -> int32_t {  // F16: the next pair's pieces into `slot` (one group)
          int32_t blk = -1, j0 = 0;
          const uint8_t* src;
          if (walk(xrow, &blk, &src, &j0) && !(dbg & 2)) {
            const uint32_t d = raw0 + static_cast<uint32_t>(slot * S::kRawSlotBytes);
            constexpr uint32_t kStride = kG8Threads * S::kRawPiece;  // between a thread's pieces
            if constexpr (NVFP4) {
              const uint8_t* rowp = src + static_cast<int64_t>(j0 + xrow) * kNvfp4DataBytesPerKey + 8 * xh;
    #pragma unroll
              for (int k = 0; k < 4; ++k) cp_async_n<8>(d + k * kStride, rowp + 16 * k);
              cp_async_n<8>(d + 4 * kStride, src + G.scale0 + static_cast<int64_t>(j0 + xrow) * kNvfp4ScalesPerKey);
            } else {
    #pragma unroll
              for (int k = 0; k < 4; ++k) cp_async_n<16>(d + k * kStride, src + 32 * k + 16 * xh);
            }
          }
          cp_async_commit();
          return blk;
        };
        // this thread's half row of block blk, in registers (rw / rsc or rx), expanded (converted) into
        // the next stage, fenced for the async proxy and arrived on the stage's `full` barrier
        auto fill_stage = [&](int32_t blk) {
          const uint32_t base = next_stage();
          if (dbg & 2) {  // (benchmarking aid: no expansion; the stage keeps what it held)
          } else if constexpr (!F16) {
            gemm8_expand_half(rw, rsc, xh, lut, base + static_cast<uint32_t>(xrow * kHeadDim), xrow & 7);
          } else {
            const uint32_t dst = base + static_cast<uint32_t>(xh * S::kHalfBytes + xrow * 128), r7 = xrow & 7;
            if constexpr (NVFP4) g16_expand_half(rw, rsc, xh, lut, dst, r7);
            else g16_store_fp8(rx, dst, r7);
          }
          asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the stores, for wgmma (async proxy)
          mbar_arrive(&full[ist]);
          published(blk);
        };
        auto issue = [&]() {
          if constexpr (PROD) {  // (the producer warpgroup fills the stages)
          } else if constexpr (S::kRawSlots > 0) {
            const int32_t blk = rblk[0];
            if (!uniform(blk >= 0)) return;
            cp_async_wait<S::kRawSlots - 1>();  // the oldest slot's copies (this thread's own) have landed
            const uint32_t d = raw0 + static_cast<uint32_t>(rslot * S::kRawSlotBytes);
            constexpr uint32_t kStride = kG8Threads * S::kRawPiece;
            if constexpr (NVFP4) {
    #pragma unroll
              for (int k = 0; k < 4; ++k)
                asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];" : "=r"(rw[k].x), "=r"(rw[k].y) : "r"(d + k * kStride) : "memory");
              asm volatile("ld.shared.b64 %0, [%1];" : "=l"(rsc) : "r"(d + 4 * kStride) : "memory");
            } else {
    #pragma unroll
              for (int k = 0; k < 4; ++k)
                asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
                             : "=r"(rx[k].x), "=r"(rx[k].y), "=r"(rx[k].z), "=r"(rx[k].w)
                             : "r"(d + k * kStride)
                             : "memory");
            }
            fill_stage(blk);
            // the slot's bytes are in the stage now: refill it with the pair kRawSlots on
    #pragma unroll
            for (int i = 0; i + 1 < S::kRawSlots; ++i) rblk[i] = rblk[i + 1];
            rblk[S::kRawSlots - 1] = raw_fill(rslot);
            rslot = rslot + 1 == S::kRawSlots ? 0 : rslot + 1;
          } else if constexpr (NVFP4 || F16) {
            if (!uniform(raw_blk >= 0)) return;
            fill_stage(raw_blk);
            load_next();
          } else {
            int32_t blk, j0;
            const uint8_t* src;
            if (!walk(16 * warp, &blk, &src, &j0)) return;
            const uint32_t base = next_stage();
            uint32_t dst[8];
    #pragma unroll
            for (int i = 0; i < 8; ++i) dst[i] = base + lane_off[i];
            cp_async_run(dst, src + 4 * lane);
            cp_async_arrive(&full[ist]);
            published(blk);
          }
        };
        if constexpr (PROD) {
          if constexpr (producer) {  // the producer warpgroup: every scored pair of the request into a stage, then -1
            [[maybe_unused]] const int pt = static_cast<int>(threadIdx.x) - kG8Threads;  // 0 .. 127
            if constexpr (NVFP4) {
              // row pt of block blk, its codes x (piece c: bytes 16 c .. 16 c + 15) and scale bytes
              // sc, expanded (both halves) into the next stage, fenced for the async proxy, arrived
              const uint32_t lut_s = smem_u32(lut);
              auto expand_row = [&](const uint4 (&x)[4], uint64_t sc, int32_t blk) {
                const uint32_t base = next_stage() + static_cast<uint32_t>(pt * kHeadDim);
    #pragma unroll
                for (int h = 0; h < 2 && !(dbg & 2); ++h) {  // (benchmarking aid: no expansion)
                  // half h: code words 2 h + 4 k and 2 h + 1 + 4 k = piece k's words 2 h, 2 h + 1
                  uint2 hw[4];
    #pragma unroll
                  for (int k = 0; k < 4; ++k) hw[k] = h ? make_uint2(x[k].z, x[k].w) : make_uint2(x[k].x, x[k].y);
                  gemm8_expand_half(hw, sc, h, lut_s, base, static_cast<uint32_t>(pt & 7));
                }
                asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the stores, for wgmma (async proxy)
                mbar_arrive(&full[ist]);
                published(blk);
              };
              // the next scored pair's row, one pair ahead in registers (a ring of raw blocks in shared
              // memory, filled by cp.async 4 blocks ahead, was 12% slower: bench/NOTES.md v25; three
              // sets of registers, two pairs ahead, 1-2% slower: v26); two pairs per turn of the loop,
              // so that the two sets of registers take turns instead of being copied
              auto load_p = [&](uint4 (&x)[4], uint64_t& sc) -> int32_t {
                int32_t blk, j0;
                const uint8_t* pg;
                if (!walk(0, &blk, &pg, &j0)) return -1;
                const uint8_t* rowp = pg + static_cast<int64_t>(j0 + pt) * kNvfp4DataBytesPerKey;
    #pragma unroll
                for (int c = 0; c < 4; ++c) x[c] = *reinterpret_cast<const uint4*>(rowp + 16 * c);
                sc = *reinterpret_cast<const uint64_t*>(pg + G.scale0 + static_cast<int64_t>(j0 + pt) * kNvfp4ScalesPerKey);
                return blk;
              };
              uint4 xa[4] = {}, xb[4] = {};
              uint64_t sca = 0, scb = 0;
              int32_t ba = load_p(xa, sca);
    #pragma unroll 1
              while (uniform(ba) >= 0) {
                const int32_t bb = load_p(xb, scb);
                expand_row(xa, sca, ba);
                if (uniform(bb) < 0) break;
                ba = load_p(xa, sca);
                expand_row(xb, scb, bb);
              }
            } else {
              // the copies: producer warp pw copies rows 32 pw .. 32 pw + 31, 4 bytes per lane per row
              const int pw = warp - kG8Threads / 32;
              uint32_t poff[8];
    #pragma unroll
              for (int i = 0; i < 8; ++i)
                poff[i] = static_cast<uint32_t>((32 * pw + i) * kHeadDim) +
                          ((static_cast<uint32_t>(lane & 7) ^ static_cast<uint32_t>(i)) << 4) + (static_cast<uint32_t>(lane >> 3) << 2);
              for (;;) {
                int32_t blk, j0;
                const uint8_t *src, *src16;
                if (!walk(32 * pw, &blk, &src, &j0, &src16)) break;
                const uint32_t base = next_stage();
                uint32_t dst[8];
    #pragma unroll
                for (int i = 0; i < 8; ++i) dst[i] = base + poff[i];
                cp_async_run(dst, src + 4 * lane);
    #pragma unroll
                for (int i = 0; i < 8; ++i) dst[i] += 16 * kHeadDim;
                cp_async_run(dst, src16 + 4 * lane);
                cp_async_arrive(&full[ist]);
                published(blk);
              }
            }
            next_stage();  // the request's end: a stage with block -1, no keys
            mbar_arrive(&full[ist]);
            published(-1);
            continue;
          }
        } else if constexpr (S::kRawSlots > 0) {
    #pragma unroll
          for (int i = 0; i < S::kRawSlots; ++i) rblk[i] = raw_fill(i);
          rslot = 0;
        } else if constexpr (NVFP4 || F16) {
          load_next();
        }
        if constexpr (!producer) {  // the math warpgroups (all threads without PROD)
          if constexpr (F16 && S::kKeysFirst) f16_queries();  // the key loads above in flight meanwhile
          if constexpr (!PROD) {
      #pragma unroll 1
            for (int i = 0; i < S::kAhead; ++i) issue();
          }
          float acc[2][16][4];
          if constexpr (PROD && NVFP4 && kG8Rotated) {
            // The rotated loop (the producer form, INDEXCP_SCORE_G8_ROTATED; see the top): a block's
            // stage is taken (the `full` wait, the proxy fence, its block index) while the previous
            // block's tile 1 still runs, and that block's scores are stored after the next chains
            // are issued, so neither is between tile 1's maxima and the next issue.
            // stage st (phase ph) once full: fenced for wgmma (redundant: the producer threads fence
            // their own stores; taking it out of the block-order loop made it slower, v25) and its
            // block (-1: the request's end)
            auto take = [&](int st, uint32_t ph) -> int32_t {
              mbar_wait(&full[st], ph);
              asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
              int32_t blk;
              asm volatile("ld.shared.b32 %0, [%1];" : "=r"(blk) : "r"(smem_u32(smeta + st)) : "memory");
              return uniform(blk);
            };
            // both chains of the block in stage st, in this warpgroup's turn (as in the loop below)
            auto issue_block = [&](int st) {
              if (INDEXCP_SCORE_G8_TURNS) {
                if (wg == 0 && chains > 0) mbar_wait(&turn[1], (chains - 1) & 1u);  // warpgroup 1 issued block c - 1
                if (wg == 1) mbar_wait(&turn[0], chains & 1u);                     // warpgroup 0 issued block c
              }
              wg_fence();
              const uint32_t sa = ring0 + static_cast<uint32_t>(st * S::kStageBytes);
              const uint32_t kd = S::kUDesc ? static_cast<uint32_t>(uniform(static_cast<int32_t>(sw128_desc_lo(sa)))) : 0u;
              if (!(dbg & 1)) {
      #pragma unroll
                for (int m = 0; m < 2; ++m) {
      #pragma unroll
                  for (int s8 = 0; s8 < 4; ++s8)
                    wgmma8_tile<16>(acc[m], qa[m][s8], S::kUDesc ? sw128_desc_of(kd + 2 * s8) : sw128_desc(sa + 32 * s8), s8 > 0);
                  wg_commit();
                }
              }
              if (INDEXCP_SCORE_G8_TURNS) mbar_arrive(&turn[wg]);
              ++chains;
            };
            auto release = [&](int st) {  // the stage back to the producer
              mbar_arrive(&empty[st]);
            };
            int32_t blk = take(cst, cph);
            if (blk < 0) {  // a request of no scored block: its end stage only
              release(cst);
              if (++cst == kStages) {
                cst = 0;
                cph ^= 1u;
              }
            } else {
              issue_block(cst);
      #pragma unroll 1
              for (;;) {  // block blk in stage cst, its chains issued
                float v[4] = {};
                wg_wait<1>();  // tile 0 (tile 1's chain may still run)
                fence_acc<16>(acc[0]);
                if (!(dbg & 5)) gemm8_block_max(acc[0], &v[0], &v[1]);
                const int nst = cst + 1 == kStages ? 0 : cst + 1;
                const uint32_t nph = cst + 1 == kStages ? cph ^ 1u : cph;
                const int32_t nblk = take(nst, nph);  // the next stage, while tile 1 runs
                wg_wait<0>();
                fence_acc<16>(acc[0]);
                fence_acc<16>(acc[1]);
                release(cst);
                cst = nst;
                cph = nph;
                if (!(dbg & 5)) gemm8_block_max(acc[1], &v[2], &v[3]);
                if (nblk < 0) {  // the request's end: its stage holds no keys
                  release(cst);
                  if (++cst == kStages) {
                    cst = 0;
                    cph ^= 1u;
                  }
                  if (!(dbg & 5)) gemm8_store(v, t4, blk, a.scores, obase, olim);
                  break;
                }
                issue_block(cst);
                if (!(dbg & 5)) gemm8_store(v, t4, blk, a.scores, obase, olim);  // (after the issue: off its path)
                blk = nblk;
              }
            }
          } else {
      #pragma unroll 1
          for (int t = 0; PROD || t < uniform(head); ++t) {
            if (S::kEarly) issue();  // the refill before this block's chains (whose issue may wait for the tensor cores)
            mbar_wait(&full[cst], cph);
            // the copies, for wgmma (async proxy). Redundant for the producer's NVFP4 stages (its threads
            // fence their own stores before they arrive), but taking it out made them slower (v25)
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            int32_t blk;
            if constexpr (PROD) {  // (an LDS: the generic load of smeta[cst] is on this loop's critical path)
              asm volatile("ld.shared.b32 %0, [%1];" : "=r"(blk) : "r"(smem_u32(smeta + cst)) : "memory");
            } else {
              blk = smeta[cst];
            }
            if constexpr (PROD) {
              if (uniform(blk) < 0) {  // the request's end (the producer's stage with no keys)
                mbar_arrive(&empty[cst]);
                if (++cst == kStages) {
                  cst = 0;
                  cph ^= 1u;
                }
                break;
              }
            }
            const uint32_t sa = ring0 + static_cast<uint32_t>(cst * S::kStageBytes);
            if (wg == 0 && chains > 0) mbar_wait(&turn[1], (chains - 1) & 1u);  // warpgroup 1 issued block c - 1
            if (wg == 1) mbar_wait(&turn[0], chains & 1u);                     // warpgroup 0 issued block c
            wg_fence();
            if (dbg & 1) {  // benchmarking aid: no MMA (nor maxima)
            } else if constexpr (F16) {  // k-step s: 32 bytes at 32 (s & 3) of half s >> 2 of both tiles
              // (kUDesc: the descriptors as warp-uniform bases qd, kd plus the offset / 16)
              const uint32_t qw = q0 + static_cast<uint32_t>(128 * wg * 128);
              const uint32_t qd = S::kUDesc ? static_cast<uint32_t>(uniform(static_cast<int32_t>(sw128_desc_lo(qw)))) : 0u;
              const uint32_t kd = S::kUDesc ? static_cast<uint32_t>(uniform(static_cast<int32_t>(sw128_desc_lo(sa)))) : 0u;
      #pragma unroll
              for (int m = 0; m < 2; ++m)
      #pragma unroll
                for (int s = 0; s < 8; ++s) {
                  const uint32_t qo = static_cast<uint32_t>((s >> 2) * kG8Vectors * 128 + 64 * m * 128 + 32 * (s & 3));
                  const uint32_t ko = static_cast<uint32_t>((s >> 2) * S::kHalfBytes + 32 * (s & 3));
                  wgmma16_ss(acc[m], S::kUDesc ? sw128_desc_of(qd + (qo >> 4)) : sw128_desc(qw + qo),
                             S::kUDesc ? sw128_desc_of(kd + (ko >> 4)) : sw128_desc(sa + ko), s > 0);
                  if (kG8Split && s == 7) wg_commit();
                }
            } else {
              const uint32_t kd = S::kUDesc ? static_cast<uint32_t>(uniform(static_cast<int32_t>(sw128_desc_lo(sa)))) : 0u;
      #pragma unroll
              for (int m = 0; m < 2; ++m) {
      #pragma unroll
                for (int s8 = 0; s8 < 4; ++s8)
                  wgmma8_tile<16>(acc[m], qa[m][s8], S::kUDesc ? sw128_desc_of(kd + 2 * s8) : sw128_desc(sa + 32 * s8), s8 > 0);
                if (kG8Split) wg_commit();
              }
            }
            if (!kG8Split) wg_commit();
            mbar_arrive(&turn[wg]);
            ++chains;
            if (!S::kEarly) issue();  // the refill (a block-table load, then the copies or the expansion) while the chains run
            float v[4] = {};
            if (kG8Split) {  // tile 0's maxima while tile 1's chain runs
              wg_wait<1>();
              fence_acc<16>(acc[0]);
              if (!(dbg & 5)) gemm8_block_max(acc[0], &v[0], &v[1]);
            }
            wg_wait<0>();
            fence_acc<16>(acc[0]);
            fence_acc<16>(acc[1]);
            mbar_arrive(&empty[cst]);
            if (++cst == kStages) {
              cst = 0;
              cph ^= 1u;
            }
            if (!(dbg & 5)) {  // (4: no maxima)
              if (!kG8Split) gemm8_block_max(acc[0], &v[0], &v[1]);
              gemm8_block_max(acc[1], &v[2], &v[3]);
              gemm8_store(v, t4, blk, a.scores, obase, olim);
            }
          }
          }
        }
      }
      if (!persist) break;
      pre += total;
      ++y;
      if (!uniform(pre < hi && y < nslices)) break;
    }
  };
  if constexpr (PROD) {
    if (threadIdx.x >= kG8Threads) {
      asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kProdRegs));
      run(std::true_type{});
      asm volatile("cp.async.wait_all;" ::: "memory");  // (its last copies land before it exits)
    } else {
      asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kMathRegs));
      run(std::false_type{});
    }
  } else {
    run(std::false_type{});
  }
#else
  __trap();  // no wgmma in this code: the launcher never picks this kernel then (gemm8_enabled)
#endif
}

}  // namespace
}  // namespace indexcp::cuda::detail
