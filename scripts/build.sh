#!/usr/bin/env bash
# Configures (once) and builds lockstep for LOCKSTEP_TORCH (scripts/config.sh)
# into its build folder. Two cores: -j2.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/config.sh
jobs=${LOCKSTEP_JOBS:-2}
# CMake finds Debian's LibTorch by default: without these checks, a .venv/
# with no complete torch, or a folder configured for the other configuration,
# would build the current one against 1.13 without a word.
if [ "$LOCKSTEP_TORCH" = current ] && [ ! -f "$torch_prefix/Torch/TorchConfig.cmake" ]; then
  echo "build: no PyTorch in .venv/ ($torch_prefix/Torch/TorchConfig.cmake is missing). Run scripts/setup.sh," \
       "which installs it (scripts/test.sh and scripts/main.sh run it first)." >&2
  exit 1
fi
if [ ! -f "$build_dir/CMakeCache.txt" ]; then
  cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release "${torch_cmake_args[@]}" >/dev/null
fi
found=$(sed -n 's/^Torch_DIR:PATH=//p' "$build_dir/CMakeCache.txt")
case "$found" in
  "$torch_prefix"/*) ;;
  *)
    echo "build: $build_dir/ was configured against the LibTorch in '$found', not LOCKSTEP_TORCH=$LOCKSTEP_TORCH's" \
         "(under $torch_prefix). Remove $build_dir/ and build again." >&2
    exit 1
    ;;
esac
# LOCKSTEP_BUILD_TARGETS: only these targets (CI's TSan stage builds the thread tests alone).
read -r -a targets <<< "${LOCKSTEP_BUILD_TARGETS:-}"
cmake --build "$build_dir" -j"$jobs" ${targets[@]+--target "${targets[@]}"}
