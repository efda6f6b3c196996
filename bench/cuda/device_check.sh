#!/usr/bin/env bash
# Build, test, sanitize and benchmark the CUDA backend on a machine with a GPU, in one go; logs
# and records under $OUT (records packed into $OUT/records.tar, since few files come back).
#   OUT=/tmp/out bash bench/cuda/device_check.sh [phases...]
# phases (default: build test bench): build | test | sanitize | sanitize-all | bench | quickbench
#   sanitize      memcheck of a subset (quick); sanitize-all: all four tools over the GPU suite
#   bench       the full suite: indexcp bench decode (+ --dump for the PyTorch baseline), topk,
#               insert, prefill, step, decode --tp 4; then bench/torch/baseline.py on the dump
#   quickbench  the same with few replays and small shapes (a smoke test of the commands)
#   nccl        the NCCL test binary (one and two GPUs) and the CLI's two-process tests
#   run-multi   `indexcp launch --tp W -- indexcp run` on the embedded data, W = 2 and 4 where the GPUs exist
#   bench-multi TP2 / TP4 across 2 / 4 processes (one GPU each, NCCL) where the GPUs exist
#   engine      compute-sanitizer over GpuEngine.* and `bench insert --tokens 512,8192` (sync vs async in a graph)
#   plan        compute-sanitizer (memcheck, initcheck, racecheck) over GpuPlan.* and GpuCollectives.*,
#               `bench decode` (DecodeStep is W decode plans) and the engine example's N-layer graph
#   prefill-ab  `bench prefill` in both precision modes, A as the environment is and B with the
#               assignments of B_ENV added (e.g. B_ENV="INDEXCP_SCORE_MAX_NT=8"), alternating, AB_ROUNDS
#               (2) times, in the precision modes of PRECS ("fp32 fp8_mma"); the bench's scorer lines
#               go into summary.txt as each run ends
#   prefill-variants  builds of compile-time variants, their tests, then `bench prefill` of each
#               against the default build: PREFILL_VARIANTS="name=-DA=1,-DB=0 ..." (flags
#               comma-separated), each built in build-<name> (indexcp_cli, test_gpu) with
#               CMAKE_CUDA_FLAGS set to its flags (in parallel, VJOBS jobs each); each variant's
#               test_gpu runs VARIANT_TESTS ("GpuFp8Mma.GemmScorer*") and a variant that fails is not
#               benchmarked; then AB_ROUNDS rounds over PRECS ("fp32") of the default build
#               ($BUILD_DIR) and every variant, all with VARIANT_ENV (empty by default), and
#               of the default build with B_ENV alone (if set); the scorer lines go to summary.txt.
#               VARIANT_OBJS=objs.tgz (bench/cuda/variant_objs.sh, built on another machine and carried):
#               each variant is $BUILD_DIR's library with NAME.score.cu.o from it, relinked (seconds,
#               instead of a build per variant)
# Environment: INDEXCP_SHARED_DIR (default ./shared), JOBS (16), BUILD_DIR (build-dev),
#              INDEXCP_GIT_REV (stored in the records), BENCH_ARGS (extra args for every bench).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export INDEXCP_SHARED_DIR=${INDEXCP_SHARED_DIR:-$PWD/shared}
# NVLink multicast stays off on shared hosts (the device notes): every rank inherits these
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export PATH=/usr/local/cuda/bin:$PATH
BUILD_DIR=${BUILD_DIR:-build-dev}
JOBS=${JOBS:-16}
PHASES=${*:-build test bench}
RES=${RES:-/tmp/indexcp-records}
mkdir -p "$RES"
log() { echo "[$(date +%T)] $*" | tee -a "$OUT/summary.txt"; }

do_build() {
  log "build: configure + ninja ($BUILD_DIR)"
  { cmake -S . -B "$BUILD_DIR" -G Ninja -DINDEXCP_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a -DCMAKE_BUILD_TYPE=Release \
      -DINDEXCP_SHARED_DIR="$INDEXCP_SHARED_DIR" &&
    timeout "${BUILD_TIMEOUT:-420}" nice -n 10 ninja -C "$BUILD_DIR" -j "$JOBS" -k 0 ${TARGETS:-}; } > "$OUT/build.log" 2>&1
  local rc=$?
  log "build rc=$rc"
  return $rc
}

do_test() {  # the whole ctest suite (GPU tests included), in parallel
  log "tests: ctest -LE slow"
  (cd "$BUILD_DIR" && timeout "${TEST_TIMEOUT:-420}" ctest -LE slow -j 8 --output-on-failure) > "$OUT/test.log" 2>&1
  local rc=$?
  grep -E "tests passed|tests failed|\(Failed\)|\(SEGFAULT\)|\(Timeout\)|Not Run" "$OUT/test.log" | tee -a "$OUT/summary.txt"
  log "tests rc=$rc"
  return $rc
}

do_sanitize() {
  local bin=$BUILD_DIR/tests/test_gpu
  local f='GpuCases.*:GpuGraph.*:GpuDecode.ExactData*:All/GpuIcp.*/4:All/GpuIcp.*/20:GpuInsert.Refusals*:GpuStage.*:GpuReliabilityBuffers.*:GpuReliabilityFaults.Refused*:-GpuCases.C07*'
  log "memcheck: $f"
  timeout "${MEMCHECK_TIMEOUT:-300}" compute-sanitizer --tool memcheck --error-exitcode 9 "$bin" --gtest_filter="$f" --gtest_color=no \
    > "$OUT/memcheck.log" 2>&1
  log "memcheck rc=$? $(grep -E 'ERROR SUMMARY|PASSED|FAILED' "$OUT/memcheck.log" | tr '\n' ' ')"
}

# Every compute-sanitizer tool over the whole GPU suite (test_gpu), each tool in 4 gtest shards,
# all 16 processes at once. Excluded: the tests that fault on purpose (death tests: an illegal
# address in a child; allocation faults: failing cudaMalloc calls), the determinism test (the same
# kernels at 13 grid sizes: slow instrumented) and C07 (131,073 pages, too slow
# instrumented; its code path is the staging kernel, which runs instrumented in GpuStage.*).
# synccheck excludes score_kernel (the tool overflows its barrier tracking on the scorer's
# mbarrier rings in long runs, docs/sanitizers.md); SYNC_SCORER=1 adds one small synccheck run
# of the scorer. SAN_TOOLS, SAN_SHARDS and SAN_FILTER_FILE (test names, one per line) narrow it.
do_sanitize_all() {
  local bin=$BUILD_DIR/tests/test_gpu pids=() tool i
  local f='*:-GpuReliabilityDeathTest.*:GpuReliabilityFaults.Allocation*:GpuReliabilityDeterminism.*:GpuCases.C07*'
  [ -n "${SAN_FILTER_FILE:-}" ] && f=$(tr '\n' ':' < "$SAN_FILTER_FILE")
  local tools=${SAN_TOOLS:-memcheck initcheck racecheck synccheck} shards=${SAN_SHARDS:-4}
  for tool in $tools; do
    local extra=""
    [ "$tool" = synccheck ] && extra="--kernel-name-exclude kns=score_kernel"
    for i in $(seq 0 $((shards - 1))); do
      GTEST_TOTAL_SHARDS=$shards GTEST_SHARD_INDEX=$i timeout "${SAN_TIMEOUT:-420}" compute-sanitizer --tool $tool $extra \
        --error-exitcode 9 "$bin" --gtest_filter="$f" --gtest_color=no > "$RES/san-$tool-$i.log" 2>&1 &
      pids+=($!)
    done
  done
  for p in "${pids[@]}"; do wait "$p"; done
  for tool in $tools; do
    local sum=""
    for i in $(seq 0 $((shards - 1))); do
      sum+="shard$i: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|^\[  (PASSED|FAILED) \]' "$RES/san-$tool-$i.log" | tr '\n' ' ') "
    done
    log "$tool: $sum"
  done
  if [ -n "${SYNC_SCORER:-}" ]; then
    timeout 200 compute-sanitizer --tool synccheck --error-exitcode 9 "$bin" --gtest_filter='GpuDecode.ExactData*' \
      --gtest_color=no > "$RES/san-synccheck-scorer.log" 2>&1
    log "synccheck scorer rc=$? $(grep -E 'ERROR SUMMARY|PASSED|FAILED|rror' "$RES/san-synccheck-scorer.log" | head -5 | tr '\n' ' ')"
  fi
}

bench() {  # bench NAME ARGS...: one `indexcp bench` run, record into $RES
  local name=$1
  shift
  log "bench $name: indexcp bench $* ${BENCH_ARGS:-}"
  timeout "${BENCH_TIMEOUT:-300}" "$BUILD_DIR/bin/indexcp" bench "$@" --out "$RES/$name.json" ${BENCH_ARGS:-} \
    >> "$OUT/bench.log" 2>> "$OUT/bench-progress.log"
  log "bench $name rc=$?"
}

do_bench() {
  local d
  d=$(date +%Y-%m-%d)
  rm -rf /tmp/indexcp-dump  # baseline.py reads every cell under it: none may be left from another run
  bench "decode-h200-$d" decode --dump /tmp/indexcp-dump
  bench "topk-h200-$d" topk
  bench "insert-h200-$d" insert
  bench "prefill-h200-$d" prefill
  bench "step-h200-$d" step
  bench "decode-tp4-h200-$d" decode --tp 4 --pages 128,256
  log "torch baseline"
  PYTHONUNBUFFERED=1 timeout "${TORCH_TIMEOUT:-400}" python3 bench/torch/baseline.py --dump /tmp/indexcp-dump \
    --record "$RES/decode-h200-$d.json" >> "$OUT/bench.log" 2>> "$OUT/bench-progress.log"
  log "torch baseline rc=$?"
}

# Several GPUs (issues 5 and 6): TP W across W processes through NCCL, for W = 2 and 4 where that
# many GPUs are visible; NVFP4 and FP8; P128 and P256. Records carry "processes": W, "num_gpus": W.
do_bench_multi() {
  local d n w dt name
  d=$(date +%Y-%m-%d)
  n=$(nvidia-smi -L 2>/dev/null | wc -l)
  for w in 2 4; do
    [ "$n" -ge "$w" ] || { log "bench-multi: $n GPU(s), TP$w across processes skipped"; continue; }
    for dt in nvfp4 fp8; do
      name="decode-tp$w-${w}proc-$dt-h200-$d"
      log "bench $name: indexcp launch --tp $w -- indexcp bench decode --tp $w --pages 128,256 --kv-dtype $dt"
      timeout "${BENCH_TIMEOUT:-300}" "$BUILD_DIR/bin/indexcp" launch --tp "$w" --timeout 300 -- "$BUILD_DIR/bin/indexcp" \
        bench decode --tp "$w" --pages 128,256 --kv-dtype "$dt" --out "$RES/$name.json" ${BENCH_ARGS:-} \
        >> "$OUT/bench.log" 2>> "$OUT/bench-progress.log"
      log "bench $name rc=$?"
    done
  done
}

# The multi-process NCCL tests (issue 5, 8): the whole test_nccl binary (NcclSingle, NcclMulti,
# NcclLaunch incl. the rank-death tests) and the CLI's two-process benchmark test.
do_nccl() {
  log "nccl tests: test_nccl + the CLI two-process and rank tests"
  timeout "${NCCL_TEST_TIMEOUT:-360}" "$BUILD_DIR/tests/test_nccl" --gtest_color=no > "$OUT/nccl-test.log" 2>&1
  log "test_nccl rc=$? $(grep -E '^\[  (PASSED|FAILED|SKIPPED) \]' "$OUT/nccl-test.log" | tr '\n' ' ')"
  (cd "$BUILD_DIR" && timeout 300 ctest -R 'Cli.*(AcrossTwoProcesses|AsARank)' --output-on-failure) > "$OUT/nccl-cli.log" 2>&1
  log "cli two-process rc=$? $(grep -E 'tests passed|tests failed' "$OUT/nccl-cli.log")"
  # W = 4 where 4 GPUs exist (test_nccl's own launcher tests use 2): the NcclMulti tests as 4 ranks
  if [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 4 ]; then
    timeout 300 "$BUILD_DIR/bin/indexcp" launch --tp 4 --timeout 120 --report "$RES/nccl-tp4-report.json" -- \
      "$BUILD_DIR/tests/test_nccl" --gtest_filter='NcclMulti.*' --gtest_color=no > "$OUT/nccl-tp4.log" 2>&1
    log "NcclMulti as 4 ranks rc=$? $(grep -cE '\[       OK \]' "$OUT/nccl-tp4.log") OK lines"
  fi
}

# The main job (`indexcp run` on the embedded data) with its TP ranks as processes, one GPU each.
do_run_multi() {
  local n d
  n=$(nvidia-smi -L 2>/dev/null | wc -l)
  d=$(date +%Y-%m-%d)
  local w
  for w in 2 4; do
    [ "$n" -ge "$w" ] || { log "run-multi: $n GPU(s), TP$w across processes skipped"; continue; }
    log "run-multi: indexcp launch --tp $w -- indexcp run --json"
    timeout 300 "$BUILD_DIR/bin/indexcp" launch --tp "$w" --timeout 120 --report "$RES/run-tp$w-${w}proc-report-$d.json" -- \
      "$BUILD_DIR/bin/indexcp" run --json "$RES/run-tp$w-${w}proc-h200-$d.json" > "$OUT/run-multi-tp$w.log" 2>&1
    log "run-multi TP$w rc=$?"
  done
}

do_quickbench() {
  BENCH_ARGS="--replays 5 --repeats 1 ${BENCH_ARGS:-}"
  rm -rf /tmp/indexcp-dump
  bench quick-decode decode --requests 2 --contexts 4096 --dump /tmp/indexcp-dump
  bench quick-topk topk --requests 2 --contexts 4096
  bench quick-insert insert --tokens 64,4096
  bench quick-prefill prefill --contexts 16384 --chunk 1024
  bench quick-step step --requests 2 --context 8192 --layers 4
  bench quick-tp4 decode --tp 4 --requests 2 --contexts 4096
  PYTHONUNBUFFERED=1 timeout 200 python3 bench/torch/baseline.py --dump /tmp/indexcp-dump --record "$RES/quick-decode.json" \
    --replays 5 --repeats 1 >> "$OUT/bench.log" 2>> "$OUT/bench-progress.log"
  log "torch baseline (quick) rc=$?"
}

# The engine API (issue 22): memcheck, initcheck and racecheck over the GpuEngine and GpuInsert tests (views,
# the asynchronous insert / Q cast and their status, graph capture, the caller's stream), then
# `bench insert` at one decode step's tokens (64 requests x 8 = 512) and a prefill-sized batch:
# the synchronous call against insert_keys_async in a CUDA graph.
do_engine() {
  local bin=$BUILD_DIR/tests/test_gpu tool d
  d=$(date +%Y-%m-%d)
  for tool in memcheck initcheck racecheck; do
    timeout "${SAN_TIMEOUT:-300}" compute-sanitizer --tool $tool --error-exitcode 9 "$bin" --gtest_filter="${ENGINE_FILTER:-GpuEngine.*:GpuInsert.*}" \
      --gtest_color=no > "$RES/san-engine-$tool.log" 2>&1
    log "$tool ${ENGINE_FILTER:-GpuEngine.*:GpuInsert.*} rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|^\[  (PASSED|FAILED) \]' "$RES/san-engine-$tool.log" | tr '\n' ' ')"
  done
  bench "insert-async-h200-$d" insert --tokens 512,8192
}

do_plan() {
  local bin=$BUILD_DIR/tests/test_gpu tool d
  d=$(date +%Y-%m-%d)
  local f
  for tool in memcheck initcheck racecheck; do
    f=${PLAN_FILTER:-GpuPlan.*:GpuCollectives.*}
    # racecheck is slow: the large prefill equality test is left to the other tools
    [ $tool = racecheck ] && f=${RACE_FILTER:-GpuPlan.*:GpuCollectives.*:-GpuPlan.PrefillEqualsTheExisting*}
    timeout "${SAN_TIMEOUT:-300}" compute-sanitizer --tool $tool --error-exitcode 9 "$bin" --gtest_filter="$f" \
      --gtest_color=no > "$RES/san-plan-$tool.log" 2>&1
    log "$tool $f rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|^\[  (PASSED|FAILED) \]' "$RES/san-plan-$tool.log" | tr '\n' ' ')"
  done
  [ "${PLAN_BENCH:-1}" = 1 ] || return 0
  bench "decode-plan-h200-$d" decode
  log "example: engine_step"
  timeout 300 "$BUILD_DIR/example_engine_step" ${EXAMPLE_ARGS:-} > "$RES/example-engine-step.log" 2>&1
  log "example rc=$? $(tail -2 "$RES/example-engine-step.log" | tr '\n' ' ')"
}

# An A/B of the prefill scorers in this build (bench/NOTES.md, v17). summary.txt gets each run's
# scorer lines as it ends, so a call cut off at the device's limit still brings them back.
do_prefill_ab() {
  [ -n "${B_ENV:-}" ] || { log "prefill-ab: B_ENV is empty, so B would run as A"; return 2; }
  local r prec v
  for r in $(seq 1 "${AB_ROUNDS:-2}"); do
    for prec in ${PRECS:-fp32 fp8_mma}; do
      for v in $([ $((r % 2)) -eq 1 ] && echo A B || echo B A); do
        prefill_run "prefill-$v-$prec-$r" "$BUILD_DIR" "$([ $v = B ] && echo "$B_ENV")" "$prec"
      done
    done
  done
}

do_prefill_variants() {
  [ -n "${PREFILL_VARIANTS:-}" ] || { log "prefill-variants: PREFILL_VARIANTS is empty"; return 2; }
  local v n f r prec ok=""
  local venv=${VARIANT_ENV-}
  if [ -n "${VARIANT_OBJS:-}" ]; then  # objects built elsewhere (bench/cuda/variant_objs.sh): relink only
    local objs=/tmp/indexcp-variant-objs
    rm -rf "$objs" && mkdir -p "$objs" && tar -C "$objs" -xzf "$VARIANT_OBJS" || { log "VARIANT_OBJS: cannot unpack $VARIANT_OBJS"; return 2; }
    for v in $PREFILL_VARIANTS; do relink_variant "${v%%=*}" "$objs" & done
  else
    for v in $PREFILL_VARIANTS; do
      n=${v%%=*}
      f=${v#*=}
      f=${f//,/ }
      ( { cmake -S . -B "build-$n" -G Ninja -DINDEXCP_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a -DCMAKE_BUILD_TYPE=Release \
            -DINDEXCP_SHARED_DIR="$INDEXCP_SHARED_DIR" "-DCMAKE_CUDA_FLAGS=$f" &&
          timeout "${BUILD_TIMEOUT:-420}" ninja -C "build-$n" -j "${VJOBS:-5}" indexcp_cli test_gpu; } > "$OUT/build-$n.log" 2>&1
        log "build-$n ($f) rc=$?" ) &
    done
  fi
  wait
  for v in $PREFILL_VARIANTS; do
    n=${v%%=*}
    (set -f; [ -n "$venv" ] && export $venv
     timeout "${TEST_TIMEOUT:-300}" "build-$n/tests/test_gpu" --gtest_filter="${VARIANT_TESTS:-GpuFp8Mma.GemmScorer*}") \
      > "$OUT/test-$n.log" 2>&1
    local rc=$?
    log "variant $n tests rc=$rc: $(grep -E '^\[  (PASSED|FAILED)  \]' "$OUT/test-$n.log" | tr '\n' ' ')"
    [ $rc -eq 0 ] && ok="$ok $n"
  done
  for r in $(seq 1 "${AB_ROUNDS:-2}"); do
    for prec in ${PRECS:-fp32}; do
      prefill_run "prefill-default-$prec-$r" "$BUILD_DIR" "$venv" "$prec"
      [ -n "${B_ENV:-}" ] && prefill_run "prefill-benv-$prec-$r" "$BUILD_DIR" "$B_ENV" "$prec"
      for n in $ok; do prefill_run "prefill-$n-$prec-$r" "build-$n" "$venv" "$prec"; done
    done
  done
}
# Variant NAME from $BUILD_DIR's library with its score.cu object replaced by DIR/NAME.score.cu.o
# (compiled elsewhere with the variant's flags: score.cu is the only translation unit that includes
# the GEMM-shaped scorer), test_gpu and indexcp relinked by $BUILD_DIR's own link commands into
# build-NAME, so the rest of the phase runs them as if built there
relink_variant() {
  local n=$1 t c
  local d=$PWD/build-$n
  mkdir -p "$d/tests" "$d/bin" && cp "$BUILD_DIR/libindexcp.a" "$d/" && cp "$2/$n.score.cu.o" "$d/score.cu.o" &&
    (cd "$d" && ar r libindexcp.a score.cu.o) > "$OUT/build-$n.log" 2>&1 || { log "build-$n: no object $2/$n.score.cu.o"; return 1; }
  t="$(ninja -C "$BUILD_DIR" -t commands tests/test_gpu | tail -1)"
  c="$(ninja -C "$BUILD_DIR" -t commands bin/indexcp | tail -1)"
  t="${t//libindexcp.a/$d/libindexcp.a}"; t="${t//-o tests\/test_gpu/-o $d/tests/test_gpu}"
  c="${c//libindexcp.a/$d/libindexcp.a}"; c="${c//-o bin\/indexcp/-o $d/bin/indexcp}"
  (cd "$BUILD_DIR" && eval "$t" && eval "$c") >> "$OUT/build-$n.log" 2>&1
  log "build-$n (relinked with $2/$n.score.cu.o) rc=$?"
}
prefill_run() {  # NAME BUILD_DIR ENV PRECISION: one `bench prefill` run of that build with those assignments
  local n
  n=$(cat "$OUT/bench.log" 2>/dev/null | wc -l)
  (set -f; [ -n "$3" ] && export $3; BUILD_DIR=$2 bench "$1" prefill -q --replays 20 --repeats 1 --score-precision "$4")
  tail -n +$((n + 1)) "$OUT/bench.log" | grep -E '(prefill|gather) scorer' | tee -a "$OUT/summary.txt"
}

nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
for ph in $PHASES; do
  case $ph in
    build) do_build ;;
    test) do_test ;;
    sanitize) do_sanitize ;;
    sanitize-all) do_sanitize_all ;;
    bench) do_bench ;;
    quickbench) do_quickbench ;;
    bench-multi) do_bench_multi ;;
    nccl) do_nccl ;;
    run-multi) do_run_multi ;;
    engine) do_engine ;;
    plan) do_plan ;;
    prefill-ab) do_prefill_ab ;;
    prefill-variants) do_prefill_variants ;;
  esac
done
tar -C "$RES" -cf "$OUT/records.tar" . 2>/dev/null
log "done"
