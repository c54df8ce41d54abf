#!/usr/bin/env bash
# Set up, build, and run the whole test suite under ctest, for LOCKSTEP_TORCH
# (scripts/config.sh). Arguments go to ctest (for example -L unit, or -L threads; see tests/CMakeLists.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/config.sh
bash scripts/setup.sh
bash scripts/build.sh
cd "$build_dir"
echo "test: PyTorch configuration '$LOCKSTEP_TORCH' in $build_dir/"
# --no-tests=error: a -L or -R that matches nothing fails instead of passing.
ctest --output-on-failure --no-tests=error -j2 "$@"
