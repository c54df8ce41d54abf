#!/usr/bin/env bash
# The main job: set up, build, and train the example CNN with DataParallel.
# Arguments go to lockstep-train (see build/lockstep-train --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
exec build/lockstep-train "$@"
