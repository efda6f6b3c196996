#!/usr/bin/env bash
# An A/B of the prefill scorers in one build on one GPU: A runs `indexcp bench prefill` with the
# environment as it is, B with the assignments of B_ENV added (e.g. B_ENV="INDEXCP_SCORE_MAX_NT=8";
# docs/knobs.md lists the knobs). A and B alternate per precision mode, ROUNDS times. Every step
# has its own time limit; $OUT/summary.txt grows as it goes and $OUT/prefill-ab.tar (the logs and
# records) is rewritten after every step, so that a call cut off at the device's limit still
# brings back what ran (the device returns at most 8 files). bench/NOTES.md, v17.
#   OUT=/tmp/out B_ENV="NAME=VALUE ..." [PHASES="build test bench"] [ROUNDS=2] [TEST_FILTER=...] \
#     bash bench/cuda/prefill_ab.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/out}
RES=${RES:-/tmp/prefill-ab}
mkdir -p "$OUT" "$RES"
export PATH=/usr/local/cuda/bin:$PATH INDEXCP_SHARED_DIR=${INDEXCP_SHARED_DIR:-$PWD/tests/data}
PHASES=${PHASES:-build test bench}
ROUNDS=${ROUNDS:-2}
B_ENV=${B_ENV:-}
BIN=build-dev/bin/indexcp
log() {
  echo "[$(date +%T)] $*" | tee -a "$OUT/summary.txt"
  tar -C "$RES" -cf "$OUT/prefill-ab.tar" .
}
for ph in $PHASES; do
  case $ph in
    build)
      log "build (indexcp_cli test_gpu)"
      TARGETS="indexcp_cli test_gpu" OUT=$RES BUILD_TIMEOUT=${BUILD_TIMEOUT:-300} bash bench/cuda/device_check.sh build > /dev/null
      log "build rc=$?" ;;
    test)
      log "tests: ${TEST_FILTER:=GpuPrefill.*:*HeadWidth*:*Fp8Mma*}"
      timeout "${TEST_TIMEOUT:-120}" build-dev/tests/test_gpu --gtest_filter="$TEST_FILTER" --gtest_color=no > "$RES/test.log" 2>&1
      log "tests rc=$? $(grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]+ test' "$RES/test.log" | tr '\n' ' ')" ;;
    bench)
      for r in $(seq 1 "$ROUNDS"); do
        for prec in fp32 fp8_mma; do
          for v in A B; do
            name=prefill-$v-$prec-$r
            log "bench $name ($v: ${B_ENV:+B_ENV=$B_ENV})"
            if [ $v = B ]; then
              env $B_ENV timeout 120 $BIN bench prefill -q --replays 20 --repeats 1 --score-precision $prec \
                ${BENCH_ARGS:-} --out "$RES/$name.json" > "$RES/$name.txt" 2>&1
            else
              timeout 120 $BIN bench prefill -q --replays 20 --repeats 1 --score-precision $prec \
                ${BENCH_ARGS:-} --out "$RES/$name.json" > "$RES/$name.txt" 2>&1
            fi
            log "rc=$? $(python3 bench/cuda/prefill_summary.py "$RES/$name.json" 2>&1 | tr '\n' ' ')"
          done
        done
      done ;;
  esac
done
