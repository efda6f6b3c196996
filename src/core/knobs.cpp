#include "core/knobs.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "indexcp/error.hpp"

namespace indexcp::detail {

const char* to_string(KnobKind k) {
  switch (k) {
    case KnobKind::kEnv: return "environment";
    case KnobKind::kCmake: return "cmake -D";
    case KnobKind::kMacro: return "CUDA -D";
  }
  return "?";
}

const std::vector<Knob>& knob_table() {
  using K = KnobKind;
  static const std::vector<Knob> t = {
      // ---- the library (product behaviour)
      {"INDEXCP_P256_STOCK_DECODE", K::kEnv, "1", "library",
       "0 or 1. With sharding at P256 / TP2 a rank's shard page is a whole 128-row page: 1 scores it with the "
       "whole-page (stock) decode scorer, 0 with the general one. Read by resolve_config (ResolvedConfig."
       "p256_stock_decode); any other value is refused."},
      // ---- the library's experiment and test switches (CUDA backend)
      {"INDEXCP_SELECT", K::kEnv, "", "library (CUDA)",
       "warp or cta forces the selection / publish kernel (the GPU tests run both); unset: the CTA kernel up to "
       "4 problems per multiprocessor, the warp kernel above."},
      {"INDEXCP_SELECT_STAGED", K::kEnv, "", "library (CUDA)",
       "512, 1024 or 1536 forces the select / publish warp kernel's instance (the keys of a row it stages in shared "
       "memory; longer rows are read from L2) for every launch (the GPU tests run each; 1024 is select only, a "
       "publish takes 1536); unset: the smallest that holds max_blocks, so the most warps per multiprocessor. Any "
       "other value is refused."},
      {"INDEXCP_SELECT_REGS", K::kEnv, "1", "library (CUDA)",
       "0, 1 or 512. 1: the select warp kernel's 512 and 1,024 instances keep a row's candidates in registers "
       "(rows of up to 256 / 1,024 of them; bench/NOTES.md v29-v30); 512: the 512 instance only; 0: every row "
       "takes the staged path (the GPU tests run both). Any other value is refused."},
      {"INDEXCP_SCORE_PLAN", K::kEnv, "", "library (CUDA)",
       "kernel forces the scorer's separate work-plan kernel (the tests compare it with the in-CTA plan); unset: "
       "the plan is computed by each CTA up to 2,048 requests."},
      {"INDEXCP_SCORE_CTAS", K::kEnv, "", "library (CUDA)",
       "CTAs along x of the scorer's grid, or all CTAs of the GEMM-shaped scorer's persistent grid (an experiment "
       "knob, bench/NOTES.md); unset: two to four waves over the query slices (persistent: one CTA per "
       "multiprocessor)."},
      {"INDEXCP_SCORE_MAX_NT", K::kEnv, "16", "library (CUDA)",
       "1, 2, 4, 8 or 16: the most query vectors per scorer CTA, in units of 8 (an experiment knob, bench/NOTES.md; "
       "4 is the prefill scorer before its 128-vector tiles; other values round down to one of these, a "
       "non-number is ignored); unset: 16."},
      {"INDEXCP_SCORE_GEMM8", K::kEnv, "1", "library (CUDA)",
       "0 or 1. indexer_score_precision fp8_mma on compute capability 9.0, requests with more than 128 query "
       "vectors (rows x heads): 1 scores E4M3 keys (the prefill gather's FP8 rows; FP8 and NVFP4 caches of at least 128 "
       "rows per page) with the GEMM-shaped kernel (256 vectors per CTA, keys copied or expanded into the wgmma "
       "operand, src/cuda/score/gemm8.cuh), 0 keeps the tile scorer (the same bits); unset or another value: 1 (an "
       "experiment knob, bench/NOTES.md)."},
      {"INDEXCP_SCORE_GEMM16", K::kEnv, "1", "library (CUDA)",
       "0 or 1. indexer_score_precision fp32 on compute capability 9.0, requests with more than 128 query vectors "
       "(rows x heads): 1 scores E4M3 keys (the prefill gather's FP8 rows; FP8 caches and NVFP4 caches with "
       "indexer_k_rounding e4m3, of at least 128 rows per page) with the GEMM-shaped kernel's fp32 form (256 vectors "
       "per CTA, keys and queries converted to fp16 in shared memory, src/cuda/score/gemm8.cuh; the tile scorer's "
       "bits), 0 keeps the tile scorer; unset or another value: 1 (a benchmarking aid, bench/NOTES.md v20, v21)."},
      {"INDEXCP_SCORE_G8_PRODUCER", K::kEnv, "1", "library (CUDA)",
       "0 or 1. 1: the fp8_mma form of the GEMM-shaped scorer runs with a third warpgroup that fills every key stage "
       "(the copies of FP8 keys, the expansion of NVFP4 keys) while the two math warpgroups only multiply and take "
       "the block maxima; 0: the two math warpgroups fill the stages themselves (a GPU test run covers it this way); "
       "unset or another value: 1. The same bits either way (an experiment knob, bench/NOTES.md v25)."},
      {"INDEXCP_SCORE_G8_PERSISTENT", K::kEnv, "1", "library (CUDA)",
       "0 or 1. 1: the GEMM-shaped scorer (both modes) runs one CTA per multiprocessor, each taking an equal share of all "
       "query slices' pairs (where every CTA computes the plan, up to 65,536 slices x requests); 0: a grid of CTAs per "
       "slice (INDEXCP_SCORE_CTAS of them, or enough for whole waves); unset or another value: 1 (an experiment knob, "
       "bench/NOTES.md)."},
      {"INDEXCP_SCORE_G8_PLAN_AHEAD", K::kEnv, "1", "library (CUDA)",
       "0 or 1. 1: each CTA of the persistent GEMM-shaped scorer's producer form (fp8_mma; batches of up to 1,024 "
       "requests) whose share crosses into a second query slice plans that slice in its prologue, so that at the "
       "switch its producer warpgroup fills that slice's stages while the math warpgroups finish the first; 0: that "
       "plan waits at a CTA barrier, where the ring drains (as every later slice's does); unset or another value: 1. "
       "The same bits either way (an experiment knob, bench/NOTES.md v31)."},
      {"INDEXCP_SCORE_DEBUG", K::kEnv, "0", "library (CUDA)", "debug bits of the scorer kernel (development only)."},
      // ---- a rank of a multi-process group (set by indexcp launch; docs/multi-process.md)
      {"INDEXCP_WORLD", K::kEnv, "", "launcher -> rank",
       "ranks of the group, 1..64; unset: the process is not a rank of a launched group."},
      {"INDEXCP_RANK", K::kEnv, "", "launcher -> rank", "this process's rank, 0..INDEXCP_WORLD-1 (required with INDEXCP_WORLD)."},
      {"INDEXCP_DEVICE", K::kEnv, "", "launcher -> rank",
       "the CUDA device of this rank, 0..1023; unset: LOCAL_RANK, else the rank."},
      {"INDEXCP_RENDEZVOUS", K::kEnv, "", "launcher -> rank",
       "the rendezvous directory where rank 0 publishes the NCCL id (required when INDEXCP_WORLD > 1)."},
      {"INDEXCP_RUN_ID", K::kEnv, "", "launcher -> rank",
       "the run's id, at most 64 characters of [A-Za-z0-9._-]: ranks of another run are not joined."},
      {"INDEXCP_NCCL_TIMEOUT_S", K::kEnv, "60", "launcher -> rank",
       "seconds every blocking wait of the group may take, (0, 604800]; `indexcp launch --timeout` sets it."},
      {"INDEXCP_REPORT_DIR", K::kEnv, "", "launcher -> rank",
       "where a rank writes its report (rank<r>.json) for the launcher to merge; set by indexcp launch."},
      // ---- the command and the benchmarks
      {"INDEXCP_GIT_REV", K::kEnv, "", "command, benchmarks, tests",
       "the commit stored in the JSON records of indexcp run and indexcp bench (and compared by the CLI test); "
       "unset: the records say \"unknown\" unless --git-rev is given."},
      {"BENCH_NO_SHUFFLE", K::kEnv, "", "benchmarks",
       "set to a non-empty value: the benchmarks' page pool is laid out in order instead of shuffled (an "
       "experiment knob)."},
      {"BENCH_ARGS", K::kEnv, "", "scripts",
       "extra arguments bench/cuda/device_check.sh passes to every indexcp bench command."},
      {"BENCH_TIMEOUT", K::kEnv, "300", "scripts", "seconds bench/cuda/device_check.sh allows each benchmark command."},
      // ---- tests and scripts
      {"INDEXCP_SHARED_DIR", K::kEnv, "the build's INDEXCP_SHARED_DIR", "tests, scripts",
       "the folder holding vectors/nvfp4_blocks.json that the tests read; scripts/common.sh passes it to CMake."},
      {"INDEXCP_CUDA", K::kEnv, "AUTO", "scripts",
       "ON, OFF or AUTO: scripts/common.sh passes it to CMake as -DINDEXCP_CUDA."},
      {"INDEXCP_CI_TORCH", K::kEnv, "1", "scripts",
       "1: scripts/python_test.sh installs PyTorch from PyPI and runs the Python package's torch tests too; 0 "
       "skips them (docs/python.md)."},
      {"INDEXCP_PACKAGE_JOBS", K::kEnv, "2", "tests", "parallel build jobs of the CMake package tests (scripts/test_package.sh)."},
      {"INDEXCP_WRITE_BAD_INPUTS", K::kEnv, "", "tests",
       "set: test_bad_inputs rewrites docs/bad-inputs.md from the real runs instead of comparing with it."},
      {"INDEXCP_SOAK_STEPS", K::kEnv, "", "tests",
       "steps of every soak (test_soak, test_gpu_soak); unset: each soak's own (200-400). docs/testing.md."},
      // ---- CMake
      {"INDEXCP_CUDA", K::kCmake, "AUTO", "build", "build the CUDA backend: ON, OFF or AUTO (on when nvcc is found)."},
      {"INDEXCP_NCCL", K::kCmake, "AUTO", "build",
       "build the NCCL communicator: ON, OFF or AUTO (on with the CUDA backend when NCCL is found)."},
      {"INDEXCP_BUILD_TESTS", K::kCmake, "ON at top level", "build", "build the GoogleTest suite."},
      {"INDEXCP_BUILD_CLI", K::kCmake, "ON at top level", "build", "build the indexcp command."},
      {"INDEXCP_BUILD_BENCH", K::kCmake, "ON at top level", "build", "build the benchmarks (Google Benchmark)."},
      {"INDEXCP_INSTALL", K::kCmake, "ON at top level", "build",
       "generate the install rules (headers, library, CMake package, the command and its data)."},
      {"INDEXCP_PYTHON", K::kCmake, "OFF", "build",
       "build the Python extension module (python/; pyproject.toml turns it on for pip install .)."},
      {"INDEXCP_INSTALL_CMAKEDIR", K::kCmake, "lib/cmake/indexcp", "build", "where the CMake package is installed."},
      {"INDEXCP_SANITIZE", K::kCmake, "", "build", "sanitizers of a CPU build, e.g. address,undefined (scripts/sanitize.sh)."},
      {"INDEXCP_FUZZ", K::kCmake, "OFF", "build", "build the libFuzzer targets of fuzz/ (clang only)."},
      {"INDEXCP_SHARED_DIR", K::kCmake, "tests/data", "build", "the folder of vectors/nvfp4_blocks.json compiled into the tests."},
      {"INDEXCP_CONTRACT_DIR", K::kCmake, "../shared", "build",
       "the project's shared/ folder, compared with the repository's copy of the vectors when present."},
      {"INDEXCP_EXPECT_VERSION", K::kCmake, "", "tests (package)",
       "the version tests/package/version_check expects of the installed package (scripts/test_package.sh sets it)."},
      {"INDEXCP_SOURCE_DIR", K::kCmake, "", "tests (package)",
       "the checkout tests/package/subproject adds with add_subdirectory (scripts/test_package.sh sets it)."},
      // ---- CUDA preprocessor switches (experiments; bench/NOTES.md)
      {"INDEXCP_SCORE_WARPS", K::kMacro, "8", "build", "warps per CTA of the NVFP4 scorer (a multiple of 4)."},
      {"INDEXCP_SCORE_MINB", K::kMacro, "2", "build", "minimum CTAs per multiprocessor of the NVFP4 scorer (__launch_bounds__)."},
      {"INDEXCP_SCORE_WIDE_MINB", K::kMacro, "1", "build",
       "minimum CTAs per multiprocessor of the scorer at 64 query vectors per CTA (NT = 8; 2 caps it at 128 registers)."},
      {"INDEXCP_BUILD_SM90A", K::kMacro, "set by CMake", "build",
       "1 when CMAKE_CUDA_ARCHITECTURES holds 90a (the default): the build has the sm_90a code of the GEMM-shaped "
       "scorer (both precision modes), which the launcher may then pick (INDEXCP_HAVE_SM90A_CODE in the top-level CMakeLists.txt; set for indexcp_cuda and test_gpu)."},
      {"INDEXCP_SCORE_G8_STAGES", K::kMacro, "12", "build",
       "16 KiB key stages of the GEMM-shaped fp8_mma scorer's ring, which both math warpgroups read (at least 4; "
       "stages - 2 blocks in flight in the two-warpgroup form, up to all of them with the producer warpgroup)."},
      {"INDEXCP_SCORE_G8P_PREGS", K::kMacro, "120", "build",
       "registers per thread of the fp8_mma GEMM-shaped scorer's producer warpgroup (setmaxnreg; a multiple of 8, "
       "24 <= PREGS <= 168 <= MREGS <= 256 and 128 x PREGS + 256 x MREGS <= 384 x 168, the registers the launch "
       "allocates: a larger split would block in setmaxnreg)."},
      {"INDEXCP_SCORE_G8P_MREGS", K::kMacro, "192", "build",
       "registers per thread of its two math warpgroups beside the producer warpgroup (setmaxnreg; 128 accumulators "
       "and 32 query registers each)."},
      {"INDEXCP_SCORE_G16_STAGES", K::kMacro, "0", "build",
       "32 KiB fp16 key stages of the GEMM-shaped scorer's ring in its fp32 form (at least 3; stages - 2 blocks in "
       "flight; at most 3 where a raw ring is built, since one value serves every instance); 0: 3 with the raw ring (the "
       "most that fits beside the 64 KiB query tile and the ring), 4 without."},
      {"INDEXCP_SCORE_G16_RAW4", K::kMacro, "0", "build",
       "The GEMM-shaped scorer's fp32 form on NVFP4 keys: 1 copies each thread's raw key bytes 5 blocks ahead into a "
       "ring in shared memory (cp.async); 0: one block ahead in registers (an experiment knob, bench/NOTES.md v21)."},
      {"INDEXCP_SCORE_G16_RAW8", K::kMacro, "1", "build",
       "The GEMM-shaped scorer's fp32 form on E4M3 rows (the gather's FP8 rows, FP8 caches): 1 copies each thread's "
       "raw key bytes 3 blocks ahead into a ring in shared memory (cp.async); 0: one block ahead in registers (an "
       "experiment knob, bench/NOTES.md v21)."},
      {"INDEXCP_SCORE_G16_EARLY", K::kMacro, "0", "build",
       "0: the GEMM-shaped scorer's fp32 form expands the next block after it issues a block's wgmma chains; 1: "
       "before (an experiment knob, slower: bench/NOTES.md v21)."},
      {"INDEXCP_SCORE_G16_KEYS_FIRST", K::kMacro, "1", "build",
       "1: the GEMM-shaped scorer's fp32 form issues a request's first key loads before it converts the request's "
       "query tile; 0: after (an experiment knob, slower: bench/NOTES.md v22)."},
      {"INDEXCP_SCORE_G8_UDESC", K::kMacro, "2", "build",
       "1: the GEMM-shaped scorer (both forms) builds its wgmma descriptors from one warp-uniform base per operand "
       "plus a constant per k-step; 0: each from its shared-memory address; 2: 1 for NVFP4 keys and in fp8_mma, 0 "
       "for the fp32 form's E4M3 rows (the fastest of each: bench/NOTES.md v23)."},
      {"INDEXCP_SCORE_G8_PAIRLANES", K::kMacro, "1", "build",
       "Keys that pass through the threads of the GEMM-shaped scorer (NVFP4; E4M3 rows in the fp32 form): 1: a warp "
       "expands both halves of 16 rows (8 rows per 16 lanes), so its loads cover whole rows; 0: thread t takes half "
       "t / 128 of row t % 128 (slower: bench/NOTES.md v23). Not read by the producer warpgroup (fp8_mma's default), "
       "whose thread t expands both halves of row t."},
      {"INDEXCP_SCORE_G8_DEBUG", K::kMacro, "0", "build",
       "1: the GEMM-shaped scorer honours INDEXCP_SCORE_DEBUG (1 no MMA, 2 no key loads or expansion where keys pass "
       "through the threads, 4 no block maxima; the producer warpgroup still loads its NVFP4 codes under 2, and skips "
       "only the expansion); 0: it ignores it (the checks cost registers)."},
      {"INDEXCP_SCORE_G8_SPLIT", K::kMacro, "1", "build",
       "1: the GEMM-shaped scorer commits each block's two m64 chains as two wgmma groups and takes the first tile's "
       "block maxima while the second runs; 0: one group (both forms)."},
      {"INDEXCP_SCORE_G8_ROTATED", K::kMacro, "1", "build",
       "1: the fp8_mma GEMM-shaped scorer's math warpgroups, with the producer warpgroup and NVFP4 keys, take the "
       "next key stage while a block's second chain runs and store the block's scores after the next issue; 0: the "
       "block-order loop (slower: bench/NOTES.md v27)."},
      {"INDEXCP_SCORE_G8_TURNS", K::kMacro, "1", "build",
       "0 drops the turn barriers between the two math warpgroups in the rotated loop of INDEXCP_SCORE_G8_ROTATED "
       "(an experiment knob, 1-2% slower: bench/NOTES.md v27)."},
      {"INDEXCP_SCORE_WGMMA", K::kMacro, "1", "build", "0 builds the scorer without wgmma (mma.sync only)."},
      {"INDEXCP_SCORE_WGMMA_MIN_NT", K::kMacro, "2", "build",
       "the smallest tile width NT (8-vector groups) that uses wgmma, except on NVFP4 stock pages "
       "(INDEXCP_SCORE_WGMMA_MIN_NT_STOCK)."},
      {"INDEXCP_SCORE_WGMMA_MIN_NT_STOCK", K::kMacro, "4", "build",
       "the same for the fp32 mode's tiles of NVFP4 stock pages (the replicated decode among them): 4 multiplies 16 "
       "query vectors by mma.sync (the same bits; on an H100 4% less arithmetic time, the exact rounding's decode 4-5% "
       "faster; FP8 keys keep INDEXCP_SCORE_WGMMA_MIN_NT: bench/NOTES.md v32)."},
      {"INDEXCP_SCORE_WGMMA_NT1", K::kMacro, "0", "build", "1 lets NT = 1 tiles use wgmma too (this and INDEXCP_SCORE_WGMMA_MIN_NT(_STOCK) do not apply to "
                                                              "indexer_score_precision \"fp8_mma\", which uses wgmma at every width)."},
      {"INDEXCP_AB_NO_STEP_SIGNATURE", K::kMacro, "undefined", "build",
       "defined: the decode plans exchange no step signature (an A/B build of bench/NOTES.md only; ranks that "
       "disagree are then not detected)."},
  };
  return t;
}

const char* knob_env(const char* name) {
  const char* v = knob_env_raw(name);
  return (v && *v) ? v : nullptr;
}

const char* knob_env_raw(const char* name) {
  const auto& t = knob_table();
  const bool known = std::any_of(t.begin(), t.end(), [&](const Knob& k) {
    return k.kind == KnobKind::kEnv && std::strcmp(k.name, name) == 0;
  });
  if (!known)
    throw Error(ErrorCode::kRuntime, std::string("environment variable ") + name +
                                         " is read but not declared in the knob table (src/core/knobs.cpp)");
  return std::getenv(name);
}

std::string knob_markdown() {
  std::string s = "| name | set by | default | read by | what it does |\n|---|---|---|---|---|\n";
  for (const Knob& k : knob_table()) {
    s += std::string("| `") + k.name + "` | " + to_string(k.kind) + " | " +
         (*k.default_value ? std::string("`") + k.default_value + "`" : std::string("unset")) + " | " + k.read_by +
         " | " + k.doc + " |\n";
  }
  return s;
}

std::string knob_text() {
  std::string s;
  for (const Knob& k : knob_table()) {
    s += std::string(k.name) + "  (" + to_string(k.kind) + "; default " +
         (*k.default_value ? k.default_value : "unset") + "; read by " + k.read_by + ")\n    " + k.doc + "\n";
  }
  return s;
}

}  // namespace indexcp::detail
