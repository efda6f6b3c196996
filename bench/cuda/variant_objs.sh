#!/usr/bin/env bash
# Compile-time variants of the CUDA scorer, compiled here (a machine without a GPU is enough) so that
# the device only relinks them: `device_check.sh prefill-variants` with VARIANT_OBJS set (device
# time is scarce; a variant built on the device costs a build per variant).
#   PREFILL_VARIANTS="name=-DA=1,-DB=0 ..." BUILD_DIR=build bash bench/cuda/variant_objs.sh [OUT.tgz]
# BUILD_DIR: a configured build with the CUDA backend (-DINDEXCP_CUDA=ON, CMAKE_CUDA_ARCHITECTURES
# 90a, Release: the device's build flags); its command for src/cuda/score.cu (score.cu is the only
# translation unit that includes the GEMM-shaped scorer and the tile scorer) is run once per variant
# with the variant's flags added (comma-separated), JOBS at a time (2). Writes NAME.score.cu.o for
# each variant into OUT.tgz (default build-var/objs.tgz). Carry it to the device (its size counts
# against the carry limit: about 3.3 MB per variant) and run there, e.g.
#   VARIANT_OBJS=build-var/objs.tgz PREFILL_VARIANTS="<the same list>" TARGETS="indexcp_cli test_gpu" \
#     bash bench/cuda/device_check.sh build prefill-variants
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -n "${PREFILL_VARIANTS:-}" ] || { echo "PREFILL_VARIANTS is empty" >&2; exit 2; }
BUILD_DIR=${BUILD_DIR:-build}
OUTTGZ=${1:-build-var/objs.tgz}
target=src/cuda/CMakeFiles/indexcp_cuda.dir/score.cu.o
cmd="$(ninja -C "$BUILD_DIR" -t commands "$target" | tail -1)"
case "$cmd" in *score.cu*) ;; *) echo "$BUILD_DIR has no command for $target (configure it with -DINDEXCP_CUDA=ON)" >&2; exit 2 ;; esac
cmd="${cmd/-MD -MT $target -MF $target.d/}"  # no depfile: the output goes elsewhere
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
pids=()
for v in $PREFILL_VARIANTS; do
  n=${v%%=*}
  f=${v#*=}
  f=${f//,/ }
  c="${cmd/-o $target/-o $stage/$n.score.cu.o}"
  [ "$c" != "$cmd" ] || { echo "cannot place the output of $target in the build command" >&2; exit 2; }
  (cd "$BUILD_DIR" && eval "$c $f") > "$stage/$n.log" 2>&1 &
  pids+=($!)
  if [ ${#pids[@]} -ge "${JOBS:-2}" ]; then wait "${pids[0]}" || { cat "$stage"/*.log >&2; exit 1; }; pids=("${pids[@]:1}"); fi
done
for p in "${pids[@]}"; do wait "$p" || { cat "$stage"/*.log >&2; exit 1; }; done
mkdir -p "$(dirname "$OUTTGZ")"
tar -C "$stage" -czf "$OUTTGZ" $(cd "$stage" && ls *.score.cu.o)
ls -l "$OUTTGZ"
