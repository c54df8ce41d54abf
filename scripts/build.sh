#!/usr/bin/env bash
# Configures (once) and builds lockstep for LOCKSTEP_TORCH (scripts/config.sh)
# into its build folder. Two cores: -j2.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/config.sh
jobs=${LOCKSTEP_JOBS:-2}
if [ ! -f "$build_dir/CMakeCache.txt" ]; then
  cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release "${torch_cmake_args[@]}" >/dev/null
fi
# LOCKSTEP_BUILD_TARGETS: only these targets (CI's TSan stage builds the thread tests alone).
read -r -a targets <<< "${LOCKSTEP_BUILD_TARGETS:-}"
cmake --build "$build_dir" -j"$jobs" ${targets[@]+--target "${targets[@]}"}
