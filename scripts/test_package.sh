#!/usr/bin/env bash
# The CMake package tests (tests/package/CMakeLists.txt registers them with ctest, label package).
#
#   test_package.sh install    --build-dir DIR --work DIR [--config CFG] [--version X.Y.Z] [common]
#     cmake --install of the build tree DIR into a scratch prefix, moved elsewhere afterwards (the
#     package must be relocatable); checks the installed files; checks the version rule
#     (tests/package/version_check); configures, builds and runs tests/package/consumer against it
#     (find_package(indexcp 0.2 REQUIRED), indexcp::indexcp).
#   test_package.sh subproject --work DIR [--config CFG] [common]
#     configures tests/package/subproject (add_subdirectory of this checkout, INDEXCP_CUDA=OFF),
#     which fails when indexcp defines more than its library; builds it and runs its consumer.
#     The build directory is kept between runs (configured afresh each time, objects reused).
#   common: --source DIR (the checkout; default: this script's), --cmake PATH, --generator NAME
#           (default Ninja when ninja is found), --make-program PATH, --cxx COMPILER.
# Environment: INDEXCP_PACKAGE_JOBS (parallel build jobs, default 2).
# Exit status 0 when every step passed; 1 with a line "test_package: FAILED: ..." naming the step
# (and the tail of its log) otherwise; 2 for a usage error.
set -euo pipefail

usage() { sed -n '2,20p' "$0" >&2; exit 2; }

mode="${1:-}"
[ -n "$mode" ] || usage
shift
source_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cmake_bin=cmake
generator=""
make_program=""
cxx=""
build_dir=""
work=""
config=Release
version=""
while [ $# -gt 0 ]; do
  [ $# -ge 2 ] || { echo "test_package: $1 needs a value" >&2; usage; }
  case "$1" in
    --source) source_dir="$2" ;;
    --cmake) cmake_bin="$2" ;;
    --generator) generator="$2" ;;
    --make-program) make_program="$2" ;;
    --cxx) cxx="$2" ;;
    --build-dir) build_dir="$2" ;;
    --work) work="$2" ;;
    --config) config="$2" ;;
    --version) version="$2" ;;
    *) echo "test_package: unknown option $1" >&2; usage ;;
  esac
  shift 2
done
[ -n "$work" ] || { echo "test_package: --work DIR is required" >&2; usage; }
jobs="${INDEXCP_PACKAGE_JOBS:-2}"
if [ -z "$generator" ]; then
  if command -v ninja >/dev/null 2>&1; then generator=Ninja; else generator="Unix Makefiles"; fi
fi
configure_args=(-G "$generator" -DCMAKE_BUILD_TYPE="$config")
[ -n "$make_program" ] && configure_args+=(-DCMAKE_MAKE_PROGRAM="$make_program")
[ -n "$cxx" ] && configure_args+=(-DCMAKE_CXX_COMPILER="$cxx")

t_start=$(date +%s)
say() { echo "test_package ($mode): $*"; }
# fail STEP LOG: the step's name, the tail of its log, exit 1
fail() {
  local step="$1" log="${2:-}"
  if [ -n "$log" ] && [ -f "$log" ]; then
    echo "---- last 60 lines of $log ----"
    tail -n 60 "$log"
    echo "----"
  fi
  echo "test_package: FAILED ($mode): $step${log:+ (log: $log)}"
  exit 1
}
# step NAME LOG COMMAND...: runs the command with its output in LOG; fails naming NAME
step() {
  local name="$1" log="$2" t0
  shift 2
  t0=$(date +%s)
  if ! "$@" >"$log" 2>&1; then
    fail "$name" "$log"
  fi
  say "$name: ok ($(( $(date +%s) - t0 )) s)"
}

case "$mode" in
  install)
    [ -n "$build_dir" ] || { echo "test_package: install needs --build-dir" >&2; usage; }
    [ -f "$build_dir/CMakeCache.txt" ] || fail "no CMake build tree at $build_dir"
    [ -n "$version" ] || version="$(sed -n 's/^CMAKE_PROJECT_VERSION:STATIC=//p' "$build_dir/CMakeCache.txt")"
    rm -rf "$work"
    mkdir -p "$work"
    staged="$work/staged"
    prefix="$work/prefix"
    step "cmake --install $build_dir (config $config)" "$work/install.log" \
      "$cmake_bin" --install "$build_dir" --prefix "$staged" --config "$config"
    [ -d "$staged" ] || fail "cmake --install installed nothing into $staged (a build without install rules: INDEXCP_INSTALL=OFF?)" "$work/install.log"
    # relocatable: the consumer uses the install from another place than the one it was installed to
    mv "$staged" "$prefix"

    # the installed files
    [ -f "$prefix/include/indexcp/version.hpp" ] || fail "include/indexcp/version.hpp not installed"
    for h in "$source_dir"/include/indexcp/*.hpp; do
      cmp -s "$h" "$prefix/include/indexcp/$(basename "$h")" ||
        fail "include/indexcp/$(basename "$h") not installed (or differs from the source)"
    done
    extra=$(cd "$prefix/include/indexcp" && for f in *; do
              [ -f "$source_dir/include/indexcp/$f" ] || [ "$f" = version.hpp ] || echo "$f"; done)
    [ -z "$extra" ] || fail "unexpected files installed in include/indexcp: $extra"
    pkg_dir=$(find "$prefix" -path '*/cmake/indexcp/indexcpConfig.cmake' -printf '%h\n' | head -n 1)
    [ -n "$pkg_dir" ] || fail "no lib*/cmake/indexcp/indexcpConfig.cmake under $prefix"
    for f in indexcpConfigVersion.cmake indexcpTargets.cmake; do
      [ -f "$pkg_dir/$f" ] || fail "$f not installed beside indexcpConfig.cmake ($pkg_dir)"
    done
    ls "$prefix"/lib*/libindexcp.* >/dev/null 2>&1 || fail "no lib*/libindexcp.* under $prefix"
    # the exported files name neither the build tree nor the checkout, and do not demand
    # nlohmann_json (used inside the library only)
    if grep -n -F -e "$(cd "$build_dir" && pwd)" -e "$source_dir" "$pkg_dir"/*.cmake >"$work/paths.txt"; then
      fail "the installed package names the build tree or the checkout: $(head -n 3 "$work/paths.txt")"
    fi
    if grep -n nlohmann "$pkg_dir"/indexcpTargets*.cmake >"$work/json.txt"; then
      fail "the exported target demands nlohmann_json: $(head -n 3 "$work/json.txt")"
    fi
    say "installed files: ok ($pkg_dir)"

    # the installed command runs the main job on the installed data, found from its own path
    # (src/cli/data_search.hpp), with the prefix moved away from where it was installed
    if [ -x "$prefix/bin/indexcp" ]; then
      data_dir="$prefix/share/indexcp/data/minilm_stdlib"
      for f in keys.npy queries.npy meta.json; do
        cmp -s "$source_dir/data/minilm_stdlib/$f" "$data_dir/$f" || fail "share/indexcp/data/minilm_stdlib/$f not installed (or differs)"
      done
      step "the installed indexcp run on the installed data" "$work/run.log" \
        "$prefix/bin/indexcp" run --backend cpu --requests 1 --tokens 2048 --steps 1 --kv-dtype fp8 --page-size 128 \
        --tp 2 --sharding on
      # the command names the data by its own resolved path (/proc/self/exe): compare resolved paths
      grep -q -F "loaded $(realpath "$data_dir")/keys.npy" "$work/run.log" ||
        fail "the installed indexcp did not load the installed data ($data_dir)" "$work/run.log"
    else
      say "no bin/indexcp installed (INDEXCP_BUILD_CLI=OFF): the command's install not checked"
    fi

    step "version rule (tests/package/version_check, version $version)" "$work/version_check.log" \
      "$cmake_bin" -S "$source_dir/tests/package/version_check" -B "$work/version_check" "${configure_args[@]}" \
      -DCMAKE_PREFIX_PATH="$prefix" -DINDEXCP_EXPECT_VERSION="$version"
    step "configure tests/package/consumer (find_package(indexcp 0.2 REQUIRED))" "$work/consumer_configure.log" \
      "$cmake_bin" -S "$source_dir/tests/package/consumer" -B "$work/consumer" "${configure_args[@]}" \
      -DCMAKE_PREFIX_PATH="$prefix"
    step "build the consumer" "$work/consumer_build.log" "$cmake_bin" --build "$work/consumer" -j "$jobs"
    step "run the consumer" "$work/consumer_run.log" "$work/consumer/consumer"
    sed 's/^/  /' "$work/consumer_run.log"
    ;;
  subproject)
    mkdir -p "$work"
    # a fresh configure each time (--fresh: no cache of an earlier run), the objects are reused
    step "configure tests/package/subproject (add_subdirectory, INDEXCP_CUDA=OFF)" "$work/configure.log" \
      "$cmake_bin" --fresh -S "$source_dir/tests/package/subproject" -B "$work/build" "${configure_args[@]}" \
      -DINDEXCP_SOURCE_DIR="$source_dir" -DINDEXCP_CUDA=OFF
    step "build (the library and the consumer, -j $jobs)" "$work/build.log" \
      "$cmake_bin" --build "$work/build" -j "$jobs"
    step "run the consumer" "$work/run.log" "$work/build/consumer"
    sed 's/^/  /' "$work/run.log"
    ;;
  *)
    echo "test_package: unknown mode '$mode' (install or subproject)" >&2
    usage
    ;;
esac
say "passed in $(( $(date +%s) - t_start )) s"
