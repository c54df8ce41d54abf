#!/usr/bin/env bash
# The main job: set up, build, and train the example CNN with DataParallel.
# Arguments go to lockstep-train (see lockstep-train --help). LOCKSTEP_TORCH
# picks the PyTorch it is built against (scripts/config.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/config.sh
bash scripts/setup.sh
bash scripts/build.sh
exec "$build_dir/lockstep-train" "$@"
