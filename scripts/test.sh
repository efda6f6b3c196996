#!/usr/bin/env bash
# Installs what is missing (as root, via apt-get), builds, and runs the test suite (without the
# `slow` label). Exits non-zero when a test fails. Extra arguments go to ctest.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
install_missing
build
ctest --test-dir "$BUILD_DIR" --output-on-failure -LE slow -j "${CTEST_JOBS:-2}" "$@"
