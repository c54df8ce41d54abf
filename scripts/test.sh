#!/usr/bin/env bash
# Set up, build, and run the whole test suite under ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
cd build
ctest --output-on-failure -j2 "$@"
