#!/usr/bin/env bash
# The Python package on a GPU machine without a package registry (docs/python.md): a virtual
# environment over the system's packages (torch, nanobind, scikit-build-core, pytest, numpy must
# be installed there), the package built with the CUDA backend (nvcc on PATH or in
# /usr/local/cuda/bin) by `pip install --no-build-isolation .`, then every pytest test (the gpu
# and torch markers included). Environment: PYTHON (default python3), VENV_DIR (build-pyenv-gpu).
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
PYTHON="${PYTHON:-python3}"
VENV_DIR="${VENV_DIR:-$REPO_ROOT/build-pyenv-gpu}"
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi
rm -rf "$VENV_DIR"
extra=()
if "$PYTHON" -m venv --system-site-packages "$VENV_DIR" >/dev/null 2>&1; then
  PY="$VENV_DIR/bin/python"
  # an interpreter that is itself a virtual environment (torch preinstalled in /opt/.../.venv):
  # --system-site-packages reaches the base interpreter's packages only, so the new environment
  # also sees the parent environment's through a .pth file
  parent_site=$("$PYTHON" -c 'import sys, sysconfig; print(sysconfig.get_paths()["purelib"] if sys.prefix != sys.base_prefix else "")')
  if [ -n "$parent_site" ]; then
    echo "$parent_site" > "$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_indexcp_parent_env.pth"
  fi
else
  # no venv module (or no ensurepip): install into the interpreter itself (a disposable machine)
  log "no virtual environment ($PYTHON -m venv failed): installing into $PYTHON itself"
  PY="$PYTHON"
  "$PY" -m pip install --help 2>/dev/null | grep -q -- --break-system-packages && extra+=(--break-system-packages)
fi
start=$(date +%s)
( cd "$REPO_ROOT" && CMAKE_ARGS="-DINDEXCP_CUDA=ON ${CMAKE_ARGS:-}" "$PY" -m pip install -q --no-build-isolation \
    --no-deps --no-index "${extra[@]}" -Cbuild-dir=build-pyenv-gpu/build . )
log "package built and installed in $(( $(date +%s) - start )) s"
( cd / && "$PY" -c 'import indexcp, torch; print("indexcp", indexcp.__version__, "cuda_available",
indexcp.cuda_available(), "torch", torch.__version__)' )
"$PY" -m pytest -q -p no:cacheprovider -rs "$REPO_ROOT/python/tests" "$@"
