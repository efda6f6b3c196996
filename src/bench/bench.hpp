// indexcp bench: the benchmarks of spec/bench.md on the CUDA backend (one GPU, TP ranks simulated
// on it). Each function prints a human-readable table on stdout, progress on stderr, and writes a
// JSON record (bench.md section 3) to options.out (nothing written when out is empty). They
// return false when a sharded selection differed from the replicated one (the CLI exits 3).
//
// Method common to every benchmark (bench.md section 1): each timed kernel sequence is captured
// as its own CUDA graph (insert, prefill_select and the whole gather prefill, which synchronize
// with the host, are timed with CUDA events or the wall clock around the call; their records
// say so); L2 is flushed before every
// replay by a memset of max(256 MB, 4 x L2) outside the timed region; median of `replays`
// replays; the whole table is run `repeats` times and the medians averaged when they agree
// within 2% (otherwise both are reported). The device's copy bandwidth (device-to-device
// cudaMemcpy, bytes read + written) and FP8 matrix rate (cuBLASLt E4M3 GEMM 8192^3) are measured
// in the same run. Errors: indexcp::Error (kInvalidArgument naming the option, kRuntime for CUDA
// failures, kUnsupported when the build has no CUDA backend).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace indexcp::bench {

/// Options every benchmark has.
struct RunOptions {
  int replays = 200;        ///< timed replays per cell (median reported), >= 1
  int repeats = 2;          ///< whole-table repetitions, 1..4
  std::string out = "auto"; ///< JSON record path; "auto": <benchmark>-<device>-<date>.json; empty: none
  std::string command;      ///< the command line, stored in the record
  std::string git_rev;      ///< stored in the record ("unknown" when empty)
  bool progress = true;     ///< progress lines on stderr
};

/// `indexcp bench decode` / `topk`: the decode indexer table of bench.md section 1.
/// Per cell (page size x requests x context): replicated_stock (rank 0 scores its H/W heads over
/// all pages + exact top-k), icp_general (all H heads over rank 0's rows + publish + merge),
/// icp_stock (P = 256, W = 2 only), the scorers alone, and (topk) the selection / publish /
/// merge kernels alone. Selections of every ICP variant are compared with the replicated ones.
/// Under `indexcp launch --tp W` (INDEXCP_WORLD = W > 1, `tp` must equal W) decode runs as one
/// rank of a real group instead: icp_nccl (ICP through the NCCL communicator), icp_nccl_exchange
/// (the candidates' all-gather alone) and replicated_stock of the rank's heads on its own GPU;
/// rank 0 writes the record ("processes": W, "num_gpus": W) with every rank's medians.
struct DecodeOptions {
  RunOptions run;
  std::vector<int> requests{16, 64};
  std::vector<int> contexts{131072, 172032};
  std::vector<int> pages{256, 128};
  int tp = 2;             ///< simulated TP size W (2, 4 or 8)
  int heads = 4;          ///< index heads H
  int query_len = 8;      ///< Q
  std::string kv_dtype = "nvfp4";   ///< nvfp4 | fp8
  std::string k_rounding = "e4m3";  ///< e4m3 | exact (NVFP4 only)
  std::string score_precision = "fp32";  ///< fp32 | fp8_mma (indexer_score_precision; not with exact)
  std::string dump;       ///< directory: write pages, block table, q and selections for bench/torch
  bool topk_only = false; ///< `bench topk`: time only the selection kernels
};
bool decode(const DecodeOptions& o);
/// Throws Error(kInvalidArgument) naming the option when o is out of range (also done by decode).
void validate(const DecodeOptions& o);

/// `indexcp bench insert`: quantize + write of `tokens` keys per call (fp32 keys, shuffled slots),
/// replicated and sharded (rank 0 of W writes its rows), NVFP4 and FP8; tokens/s and GB/s
/// (keys + slot mapping read, cache bytes written). Timed with events around the synchronous
/// call (validation included).
struct InsertOptions {
  RunOptions run;
  std::vector<int> tokens{64, 8192, 1048576};
  std::vector<std::string> kv_dtypes{"nvfp4", "fp8"};
  int tp = 2;
};
bool insert(const InsertOptions& o);
void validate(const InsertOptions& o);

/// `indexcp bench prefill`: the gather prefill of one rank (indexer.md section 5): FP8 staging
/// (graph), the all-gather (simulated: device-to-device copies), the prefill scorer alone (graph
/// of cuda::prefill_scores: TFLOP/s against the FP8 matrix rate), prefill_select end to end
/// (events around the synchronous call) and the whole budgeted prefill_gather (wall clock, all
/// ranks) with its reserved transient bytes.
struct PrefillOptions {
  RunOptions run;
  int requests = 1;
  std::vector<int> contexts{32768, 131072};
  int chunk = 8192;       ///< new tokens per request (rows)
  int page_size = 128;
  int tp = 2;
  int heads = 4;
  int budget_mib = 256;   ///< indexer_prefill_gather_budget_mib
  std::string score_precision = "fp32";  ///< fp32 | fp8_mma (indexer_score_precision)
  int layers = 57;        ///< sparse layers of the computed prompt line (MiniMax-M3: 57)
};
/// With --contexts T, 2T, .., nT (T = --chunk, n >= 2) the record also holds the computed prompt
/// line: an nT-token prompt in n chunks, the sum of the n chunk positions' medians times --layers.
bool prefill(const PrefillOptions& o);
void validate(const PrefillOptions& o);

/// `indexcp bench step`: the per-rank decode step across `layers` sparse layers, one CUDA graph,
/// sharding off (replicated stock + top-k per layer) against on (ICP per layer).
struct StepOptions {
  RunOptions run;
  std::vector<int> requests{16, 64};
  int context = 131072;
  int page_size = 128;
  int layers = 57;
  int tp = 2;
  int heads = 4;
  int query_len = 8;
};
bool step(const StepOptions& o);
void validate(const StepOptions& o);

}  // namespace indexcp::bench
