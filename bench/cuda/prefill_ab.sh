#!/usr/bin/env bash
# An A/B of the prefill scorers in one build on one GPU: A runs `indexcp bench prefill` with the
# environment as it is, B with the assignments of B_ENV added (e.g. B_ENV="INDEXCP_SCORE_MAX_NT=8";
# docs/knobs.md lists the knobs). Per precision mode and round the two alternate (A B, then B A).
# Every step has its own time limit; $OUT/summary.txt grows as it goes and $OUT/prefill-ab.tar (the
# logs and records of this call only) is replaced after every step, so that a call cut off at the
# device's limit still brings back what ran (the device returns at most 8 files). The defaults
# assume a tree already built in the same lease when all three phases must fit in one 600 s call:
# a fresh build takes about 2 minutes, each bench prefill run a few seconds. bench/NOTES.md, v17.
#   OUT=/tmp/out B_ENV="NAME=VALUE ..." [PHASES="build test bench"] [ROUNDS=2] [TEST_FILTER=...] \
#     bash bench/cuda/prefill_ab.sh
# Also read: BUILD_DIR (build-dev), BUILD_TIMEOUT (300 s), TEST_TIMEOUT (120 s), BENCH_ARGS (extra
# bench arguments), INDEXCP_SHARED_DIR (tests/data), RES (scratch folder, emptied first; not under
# $OUT), INDEXCP_GIT_REV (the commit the records name: set it, the device copy's git HEAD is not
# the tree that was sent).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
OUT=${OUT:-$PWD/out}
RES=${RES:-/tmp/prefill-ab}
BUILD_DIR=${BUILD_DIR:-build-dev}
rm -rf "$RES"
mkdir -p "$OUT" "$RES"
export PATH=/usr/local/cuda/bin:$PATH INDEXCP_SHARED_DIR=${INDEXCP_SHARED_DIR:-$PWD/tests/data} BUILD_DIR
PHASES=${PHASES:-build test bench}
ROUNDS=${ROUNDS:-2}
B_ENV=${B_ENV:-}
BIN=$BUILD_DIR/bin/indexcp
log() {
  echo "[$(date +%T)] $*" | tee -a "$OUT/summary.txt"
  tar -C "$RES" -cf "$OUT/prefill-ab.tar.tmp" . && mv -f "$OUT/prefill-ab.tar.tmp" "$OUT/prefill-ab.tar"
}
bench_one() {  # bench_one NAME MODE [VAR=VALUE ...]
  local name=$1 prec=$2
  shift 2
  rm -f "$RES/$name.json"
  env "$@" timeout 120 "$BIN" bench prefill -q --replays 20 --repeats 1 --score-precision "$prec" \
    ${BENCH_ARGS:-} --out "$RES/$name.json" > "$RES/$name.txt" 2>&1
  local rc=$?
  if [ -f "$RES/$name.json" ]; then
    log "bench $name rc=$rc $(python3 bench/cuda/prefill_summary.py "$RES/$name.json" 2>&1 | tr '\n' ' ')"
  else
    log "bench $name rc=$rc, no record: $(tail -2 "$RES/$name.txt" | tr '\n' ' ')"
  fi
}
for ph in $PHASES; do
  case $ph in
    build)
      log "build (indexcp_cli test_gpu in $BUILD_DIR)"
      TARGETS="indexcp_cli test_gpu" OUT=$RES RES=$RES/device_check BUILD_TIMEOUT=${BUILD_TIMEOUT:-300} \
        bash bench/cuda/device_check.sh build > /dev/null
      rm -f "$RES/records.tar"
      # device_check.sh exits 0 after its phases; its summary has the build's status
      rc=$(grep -o 'build rc=[0-9]*' "$RES/summary.txt" | tail -1)
      log "${rc:-build rc=unknown}"
      [ "${rc:-}" = "build rc=0" ] || { log "the build failed: $RES/build.log in the tar"; exit 1; } ;;
    test)
      log "tests: ${TEST_FILTER:=GpuPrefill.*:*HeadWidth*:*Fp8Mma*}"
      timeout "${TEST_TIMEOUT:-120}" "$BUILD_DIR/tests/test_gpu" --gtest_filter="$TEST_FILTER" --gtest_color=no \
        > "$RES/test.log" 2>&1
      log "tests rc=$? $(grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]+ test' "$RES/test.log" | tr '\n' ' ')" ;;
    bench)
      [ -n "$B_ENV" ] || { log "B_ENV is empty: B would run as A"; exit 2; }
      set -f  # B_ENV's words are assignments, not patterns
      read -r -a b_env <<< "$B_ENV"
      set +f
      for r in $(seq 1 "$ROUNDS"); do
        for prec in fp32 fp8_mma; do
          if [ $((r % 2)) -eq 1 ]; then
            bench_one "prefill-A-$prec-$r" "$prec"
            bench_one "prefill-B-$prec-$r" "$prec" "${b_env[@]}"
          else
            bench_one "prefill-B-$prec-$r" "$prec" "${b_env[@]}"
            bench_one "prefill-A-$prec-$r" "$prec"
          fi
        done
      done ;;
    *)
      log "unknown phase '$ph' (build, test or bench)"
      exit 2 ;;
  esac
done
