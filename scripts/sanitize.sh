#!/usr/bin/env bash
# Builds the CPU code a second time with AddressSanitizer + UndefinedBehaviorSanitizer (CUDA off,
# build-asan/) and runs the test suite without the `slow` label under them. Any sanitizer report
# is fatal (the process exits non-zero, the test fails). Extra arguments go to ctest.
#
# Environment: BUILD_DIR (default build-asan), JOBS, CTEST_JOBS (default 2), and the usual
# ASAN_OPTIONS / UBSAN_OPTIONS / LSAN_OPTIONS, which override the defaults below.
#
# Why these options (docs/sanitizers.md):
#   halt_on_error=1, abort_on_error=0: the first report ends the process with exitcode 1 (ctest
#     sees a failure); -fno-sanitize-recover=all (CMakeLists.txt) makes UBSan reports fatal too.
#   detect_leaks=1 with suppressions (scripts/lsan.supp): libgomp keeps its thread pool and
#     thread-local team state until exit; those allocations are reachable from libgomp only.
#   allocator_may_return_null=1: the library reports an allocation that does not fit as an
#     Error (kRuntime); tests asking for huge caches expect that Error, not an ASan abort.
set -euo pipefail
export BUILD_DIR="${BUILD_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/build-asan}"
export BUILD_TYPE=RelWithDebInfo
export INDEXCP_CUDA=OFF
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
install_missing

supp="$REPO_ROOT/scripts/lsan.supp"
export ASAN_OPTIONS="${ASAN_OPTIONS:-halt_on_error=1:abort_on_error=0:print_stacktrace=1:detect_leaks=1:allocator_may_return_null=1:detect_stack_use_after_return=0:strict_string_checks=1:check_initialization_order=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1:report_error_type=1}"
export LSAN_OPTIONS="${LSAN_OPTIONS:-suppressions=$supp:print_suppressions=0}"
log "ASAN_OPTIONS=$ASAN_OPTIONS"
log "UBSAN_OPTIONS=$UBSAN_OPTIONS"
log "LSAN_OPTIONS=$LSAN_OPTIONS"
jobs="${JOBS:-$(nproc 2>/dev/null || echo 2)}"
log "configuring $BUILD_DIR (RelWithDebInfo, ASan + UBSan, CUDA off)"
cmake -S "$REPO_ROOT" -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DINDEXCP_CUDA=OFF \
  -DINDEXCP_SANITIZE=address,undefined -DINDEXCP_BUILD_BENCH=OFF >&2
log "building (sanitized)"
cmake --build "$BUILD_DIR" -j "$jobs" >&2

ctest --test-dir "$BUILD_DIR" --output-on-failure -LE slow -j "${CTEST_JOBS:-2}" "$@"
