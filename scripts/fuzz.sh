#!/usr/bin/env bash
# Builds the libFuzzer targets of fuzz/ with clang (ASan + UBSan + libFuzzer, CUDA off, in
# build-fuzz/) and runs each for a bounded time over its seed corpus (fuzz/corpus/<target>/) and
# its saved regressions (tests/regressions/<target>/). Exits non-zero when a target crashes,
# leaks, times out on one input or exceeds its memory limit; the input is saved under
# build-fuzz/artifacts/<target>/ (copy it to tests/regressions/<target>/ once the bug is fixed).
#
# Environment: BUILD_DIR (default build-fuzz), FUZZ_SECONDS (per target, default 11),
# FUZZ_SEED (default 1: a fixed seed, so a run explores the same way on every machine),
# FUZZ_TARGETS (default: all), JOBS.
set -euo pipefail
export BUILD_DIR="${BUILD_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/build-fuzz}"
export INDEXCP_CUDA=OFF
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
# clang, its sanitizer/libFuzzer runtimes and LLVM's OpenMP runtime (clang -fopenmp links libomp)
INDEXCP_PACKAGES+=(clang libclang-rt-14-dev libomp-dev)
install_missing

FUZZ_SECONDS="${FUZZ_SECONDS:-11}"
FUZZ_SEED="${FUZZ_SEED:-1}"
FUZZ_TARGETS="${FUZZ_TARGETS:-fuzz_config fuzz_model fuzz_npy fuzz_replay fuzz_batch}"
jobs="${JOBS:-$(nproc 2>/dev/null || echo 2)}"

log "configuring $BUILD_DIR (clang, libFuzzer + ASan + UBSan, CUDA off)"
CC=clang CXX=clang++ cmake -S "$REPO_ROOT" -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DINDEXCP_CUDA=OFF -DINDEXCP_FUZZ=ON -DINDEXCP_BUILD_TESTS=OFF -DINDEXCP_BUILD_CLI=OFF \
  -DINDEXCP_BUILD_BENCH=OFF >&2
log "building the fuzz targets"
# shellcheck disable=SC2086
cmake --build "$BUILD_DIR" -j "$jobs" --target $FUZZ_TARGETS >&2

export ASAN_OPTIONS="${ASAN_OPTIONS:-halt_on_error=1:abort_on_error=0:print_stacktrace=1:detect_leaks=1:allocator_may_return_null=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1:report_error_type=1}"
export LSAN_OPTIONS="${LSAN_OPTIONS:-suppressions=$REPO_ROOT/scripts/lsan.supp:print_suppressions=0}"
# the ranks of run_ranks are threads; keep OpenMP from spinning on 2 cores
export OMP_WAIT_POLICY=passive OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export TMPDIR="$BUILD_DIR/tmp"
mkdir -p "$TMPDIR"

failed=()
for t in $FUZZ_TARGETS; do
  bin="$BUILD_DIR/fuzz/$t"
  work="$BUILD_DIR/corpus-work/$t"
  art="$BUILD_DIR/artifacts/$t/"
  rm -rf "$work"
  mkdir -p "$work" "$art"
  dirs=("$REPO_ROOT/fuzz/corpus/$t")
  [ -d "$REPO_ROOT/tests/regressions/$t" ] && dirs+=("$REPO_ROOT/tests/regressions/$t")
  log "fuzzing $t for ${FUZZ_SECONDS}s (seed $FUZZ_SEED) over ${dirs[*]#$REPO_ROOT/}"
  # new inputs go to the scratch corpus (first directory); the committed seeds are read only
  if ! "$bin" -max_total_time="$FUZZ_SECONDS" -rss_limit_mb=2048 -timeout=30 -seed="$FUZZ_SEED" \
       -print_final_stats=1 -artifact_prefix="$art" "$work" "${dirs[@]}" >"$BUILD_DIR/$t.log" 2>&1; then
    tail -n 60 "$BUILD_DIR/$t.log" >&2
    log "FAILED: $t (log $BUILD_DIR/$t.log; input saved under $art)"
    failed+=("$t")
  else
    grep -E '^(#[0-9]+.*DONE|stat::number_of_executed_units|Done [0-9]+ runs)' "$BUILD_DIR/$t.log" | tail -n 2 >&2 || true
  fi
done
rm -rf "$TMPDIR"
if [ "${#failed[@]}" -ne 0 ]; then
  log "fuzzing failed: ${failed[*]}"
  exit 1
fi
log "fuzzing: no crash in ${FUZZ_TARGETS// /, } (${FUZZ_SECONDS}s each)"
