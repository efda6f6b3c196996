#!/usr/bin/env bash
# Installs what is missing (as root, via apt-get), builds, and runs the main job:
#   ./scripts/run.sh                 # `indexcp run` on the embedded real data
#   ./scripts/run.sh --json out.json # extra arguments go to `indexcp run`
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
install_missing
build
exec "$BUILD_DIR/bin/indexcp" run "$@"
