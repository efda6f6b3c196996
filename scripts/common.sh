# Shared by scripts/run.sh and scripts/test.sh: install what is missing, configure and build.
# Environment: BUILD_DIR (default build), BUILD_TYPE (default Release), INDEXCP_CUDA (AUTO, ON, OFF),
# JOBS (parallel build jobs, default: all cores), INDEXCP_SHARED_DIR (the shared/ folder the tests
# read, default ../shared beside the checkout).

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${BUILD_DIR:-$REPO_ROOT/build}"
BUILD_TYPE="${BUILD_TYPE:-Release}"
INDEXCP_CUDA="${INDEXCP_CUDA:-AUTO}"

# Debian packages the build needs (compiler, CMake >= 3.24, Ninja, GoogleTest, CLI11, nlohmann-json,
# Google Benchmark).
INDEXCP_PACKAGES=(cmake ninja-build g++ libgtest-dev libcli11-dev nlohmann-json3-dev libbenchmark-dev)

log() { echo "[indexcp] $*" >&2; }

install_missing() {
  local missing=() p
  if ! command -v dpkg-query >/dev/null 2>&1; then
    log "not a Debian system (no dpkg-query): not installing packages; the build needs: ${INDEXCP_PACKAGES[*]}"
    return 0
  fi
  for p in "${INDEXCP_PACKAGES[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
      missing+=("$p")
    fi
  done
  if [ "${#missing[@]}" -eq 0 ]; then
    return 0
  fi
  if ! command -v apt-get >/dev/null 2>&1; then
    log "missing packages: ${missing[*]} (no apt-get here: install them by hand)"
    return 1
  fi
  local sudo=()
  if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
      sudo=(sudo)
    else
      log "missing packages: ${missing[*]}; run as root (or install them) first"
      return 1
    fi
  fi
  log "installing: ${missing[*]}"
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -q
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
}

build() {
  # the CUDA toolkit installs nvcc outside PATH on Debian/NVIDIA repositories
  if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
    export PATH="/usr/local/cuda/bin:$PATH"
  fi
  local jobs="${JOBS:-$(nproc 2>/dev/null || echo 2)}"
  log "configuring $BUILD_DIR ($BUILD_TYPE, INDEXCP_CUDA=$INDEXCP_CUDA)"
  local extra=()
  # the shared/ folder of the acceptance vectors, when it is not ../shared (the tests read it)
  [ -n "${INDEXCP_SHARED_DIR:-}" ] && extra+=(-DINDEXCP_SHARED_DIR="$INDEXCP_SHARED_DIR")
  cmake -S "$REPO_ROOT" -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE="$BUILD_TYPE" -DINDEXCP_CUDA="$INDEXCP_CUDA" \
    "${extra[@]}" >&2
  log "building"
  cmake --build "$BUILD_DIR" -j "$jobs" >&2
}
