#!/usr/bin/env bash
# Configures (once) and builds lockstep into build/. Two cores: -j2.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=${LOCKSTEP_JOBS:-2}
if [ ! -f build/CMakeCache.txt ]; then
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
fi
cmake --build build -j"$jobs"
