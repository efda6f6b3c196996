#!/usr/bin/env bash
# The Python package in CI (docs/python.md): builds the CPU-only package into a fresh virtual
# environment (build-pyenv/) with pip and runs its pytest suite: the numpy tests always, the
# PyTorch tests (marker `torch`) when INDEXCP_CI_TORCH=1 (the default; 0 skips installing torch).
# The GPU tests (marker `gpu`) skip without a GPU. Installs python3-venv / python3-dev with
# apt-get when they are missing (as root). Environment: PYTHON (default python3), VENV_DIR.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
PYTHON="${PYTHON:-python3}"
VENV_DIR="${VENV_DIR:-$REPO_ROOT/build-pyenv}"
INDEXCP_CI_TORCH="${INDEXCP_CI_TORCH:-1}"

# what the build of the package needs besides the C++ build's packages (install_missing)
need=()
command -v "$PYTHON" >/dev/null 2>&1 || need+=(python3)
if command -v "$PYTHON" >/dev/null 2>&1; then
  "$PYTHON" -c 'import ensurepip, venv' >/dev/null 2>&1 || need+=(python3-venv)
  "$PYTHON" -c 'import os, sysconfig; assert os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))' \
    >/dev/null 2>&1 || need+=(python3-dev)
fi
if [ "${#need[@]}" -gt 0 ]; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" -eq 0 ]; then
    log "installing: ${need[*]}"
    env DEBIAN_FRONTEND=noninteractive apt-get update -q
    env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${need[@]}"
  else
    log "missing: ${need[*]} (install them, or run as root on a Debian system)"
    exit 1
  fi
fi

log "python package: fresh virtual environment $VENV_DIR"
rm -rf "$VENV_DIR"
"$PYTHON" -m venv "$VENV_DIR"
PY="$VENV_DIR/bin/python"
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q nanobind scikit-build-core numpy pytest
if [ "$INDEXCP_CI_TORCH" = "1" ]; then
  log "installing PyTorch from PyPI (INDEXCP_CI_TORCH=1)"
  "$PY" -m pip install -q torch
fi
log "building the CPU-only package (CMAKE_ARGS=-DINDEXCP_CUDA=OFF pip install --no-build-isolation .)"
# its own build folder, so that a CUDA build of the package elsewhere is not reconfigured
( cd "$REPO_ROOT" && CMAKE_ARGS="-DINDEXCP_CUDA=OFF" "$PY" -m pip install -q --no-build-isolation \
    -Cbuild-dir=build-pyenv/build . )
# from outside the checkout: the tests import the installed package, not python/indexcp
( cd "$VENV_DIR" && "$PY" -c 'import indexcp; print("indexcp", indexcp.__version__, "cuda_available", indexcp.cuda_available())' )
markers="not gpu"
[ "$INDEXCP_CI_TORCH" = "1" ] || markers="not gpu and not torch"
"$PY" -m pytest -q -m "$markers" -p no:cacheprovider "$REPO_ROOT/python/tests" "$@"
