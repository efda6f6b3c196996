#!/usr/bin/env bash
# The prefill scorer's split kernel (issue 27) against the wgmma kernel with A from registers, in
# one build on one GPU: INDEXCP_SCORE_MAX_NT=16 caps the query vectors per CTA at 128 (the kernel
# before the split one), the default takes 256 (the split kernel). Alternates A (split) and B
# (capped) per precision mode, ROUNDS times; records and logs into $OUT/split-ab.tar.
#   OUT=/tmp/out [PHASES="build test bench"] [ROUNDS=2] bash bench/cuda/split_ab.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/out}
RES=/tmp/split-ab
mkdir -p "$OUT" "$RES"
export PATH=/usr/local/cuda/bin:$PATH INDEXCP_SHARED_DIR=${INDEXCP_SHARED_DIR:-$PWD/tests/data}
PHASES=${PHASES:-build test bench}
ROUNDS=${ROUNDS:-2}
BIN=build-dev/bin/indexcp
log() { echo "[$(date +%T)] $*" | tee -a "$RES/summary.txt"; }
for ph in $PHASES; do
  case $ph in
    build)
      log "build"
      TARGETS="indexcp_cli test_gpu" OUT=$RES bash bench/cuda/device_check.sh build > /dev/null
      log "build rc=$? $(grep -cE 'spill (stores|loads) [1-9]' "$RES/build.log") spill lines" ;;
    test)
      log "tests: ${TEST_FILTER:=*Prefill*:*HeadWidth*:*Fp8Mma*:*GpuPlan*:*GpuDecode*:*GpuIcp*}"
      timeout "${TEST_TIMEOUT:-400}" build-dev/tests/test_gpu --gtest_filter="$TEST_FILTER" --gtest_color=no > "$RES/test.log" 2>&1
      log "tests rc=$? $(grep -E '^\[  (PASSED|FAILED)|tests ran' "$RES/test.log" | tr '\n' ' ')"
      grep -E '^\[  FAILED' "$RES/test.log" | head -20 | tee -a "$RES/summary.txt" ;;
    bench)
      for r in $(seq 1 "$ROUNDS"); do
        for prec in fp32 fp8_mma; do
          for v in split nt16; do
            name=prefill-$v-$prec-$r
            log "bench $name"
            if [ $v = nt16 ]; then export INDEXCP_SCORE_MAX_NT=16; else unset INDEXCP_SCORE_MAX_NT; fi
            timeout 300 $BIN bench prefill -q --replays 20 --repeats 1 --score-precision $prec ${BENCH_ARGS:-} \
              --out "$RES/$name.json" > "$RES/$name.txt" 2>&1
            log "rc=$?"
            python3 bench/cuda/prefill_summary.py "$RES/$name.json" | tee -a "$RES/summary.txt"
          done
        done
      done
      unset INDEXCP_SCORE_MAX_NT ;;
  esac
done
tar -C "$RES" -cf "$OUT/split-ab.tar" .
