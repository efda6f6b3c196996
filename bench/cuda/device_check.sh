#!/usr/bin/env bash
# Build, test and benchmark the CUDA backend on a machine with a GPU, in one go, logs under $OUT.
#   OUT=/tmp/out bash bench/cuda/device_check.sh [phases...]
# phases (default: build test bench): build | test | sanitize | bench | prebuilt
#   prebuilt  run the GPU tests with binaries in build-carry/ (built elsewhere) while `build` runs
# Environment: INDEXCP_SHARED_DIR (default ./shared), JOBS (16), BUILD_DIR (build-dev).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export INDEXCP_SHARED_DIR=${INDEXCP_SHARED_DIR:-$PWD/shared}
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
BUILD_DIR=${BUILD_DIR:-build-dev}
JOBS=${JOBS:-16}
PHASES=${*:-build test bench}
log() { echo "[$(date +%T)] $*" | tee -a "$OUT/summary.txt"; }

do_build() {
  log "build: configure + ninja ($BUILD_DIR)"
  { cmake -S . -B "$BUILD_DIR" -G Ninja -DINDEXCP_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a -DCMAKE_BUILD_TYPE=Release \
      -DINDEXCP_BUILD_CLI=OFF -DINDEXCP_SHARED_DIR="$INDEXCP_SHARED_DIR" &&
    timeout "${BUILD_TIMEOUT:-420}" nice -n 10 ninja -C "$BUILD_DIR" -j "$JOBS" test_gpu indexcp_bench_decode; } > "$OUT/build.log" 2>&1
  local rc=$?
  log "build rc=$rc"
  return $rc
}

run_tests() {  # $1 = directory holding test_gpu
  local bin=$1/test_gpu shards=4 pids=()
  log "tests: $bin in $shards shards"
  for i in $(seq 0 $((shards - 1))); do
    GTEST_TOTAL_SHARDS=$shards GTEST_SHARD_INDEX=$i timeout "${TEST_TIMEOUT:-400}" "$bin" --gtest_color=no > "$OUT/test_shard$i.log" 2>&1 &
    pids+=($!)
  done
  local rc=0
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  cat "$OUT"/test_shard*.log > "$OUT/test.log"
  rm -f "$OUT"/test_shard*.log
  grep -E "^\[  (PASSED|FAILED|SKIPPED) \]|tests? ran|FAILED TEST" "$OUT/test.log" | tee -a "$OUT/summary.txt"
  log "tests rc=$rc"
  return $rc
}

do_sanitize() {
  local bin=$BUILD_DIR/tests/test_gpu
  [ -x "$bin" ] || bin=build-carry/test_gpu
  [ -n "${PREBUILT:-}" ] && bin=build-carry/test_gpu
  local f='GpuCases.*:GpuGraph.*:GpuDecode.ExactData*:GpuDecode.SelectionIsExact*:All/GpuIcp.*/4:All/GpuIcp.*/20:All/GpuIcp.*/14:GpuInsert.Refusals*:GpuQCast.*:GpuPrefill.PrefillEquals*:GpuStage.*:-GpuCases.C07*'
  log "memcheck: $f"
  timeout "${MEMCHECK_TIMEOUT:-420}" compute-sanitizer --tool memcheck --error-exitcode 9 "$bin" --gtest_filter="$f" --gtest_color=no \
    > "$OUT/memcheck.log" 2>&1
  log "memcheck rc=$? $(grep -E 'ERROR SUMMARY|PASSED|FAILED' "$OUT/memcheck.log" | tr '\n' ' ')"
  local r='GpuDecode.ExactData*:All/GpuIcp.*/4:GpuGraph.*:GpuPrefill.PrefillEquals*:GpuInsert.Refusals*'
  log "racecheck: $r"
  timeout "${RACECHECK_TIMEOUT:-420}" compute-sanitizer --tool racecheck --error-exitcode 9 "$bin" --gtest_filter="$r" --gtest_color=no \
    > "$OUT/racecheck.log" 2>&1
  log "racecheck rc=$? $(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY|PASSED|FAILED' "$OUT/racecheck.log" | tr '\n' ' ')"
}

do_bench() {
  local bin=$BUILD_DIR/bench/cuda/indexcp_bench_decode
  [ -x "$bin" ] || bin=build-carry/indexcp_bench_decode
  [ -n "${PREBUILT:-}" ] && bin=build-carry/indexcp_bench_decode
  local drv
  drv=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1)
  log "bench: $bin ${BENCH_ARGS:-}"
  timeout "${BENCH_TIMEOUT:-120}" "$bin" --out "$OUT/decode-h200-$(date +%Y-%m-%d).json" --git-rev "${GIT_REV:-unknown}" --driver "${drv:-unknown}" \
    ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
  log "bench rc=$?"
  tail -60 "$OUT/bench.log"
}

nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
for ph in $PHASES; do
  case $ph in
    prebuilt)
      do_build &
      BPID=$!
      if LD_LIBRARY_PATH=$LD_LIBRARY_PATH build-carry/test_gpu --gtest_list_tests > /dev/null 2>&1; then
        run_tests build-carry
      else
        log "prebuilt binary does not run here; waiting for the build"
        wait $BPID
        run_tests "$BUILD_DIR/tests"
      fi
      wait $BPID 2>/dev/null
      ;;
    ptest) run_tests build-carry ;;
    build) do_build ;;
    test) run_tests "$BUILD_DIR/tests" ;;
    sanitize) do_sanitize ;;
    bench) do_bench ;;
  esac
done
log "done"
