#!/usr/bin/env bash
# Configures and builds lockstep for LOCKSTEP_TORCH (scripts/config.sh)
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
# The folder's LibTorch must be the configuration's: checked before a
# configure (CMake keeps the Torch_DIR it cached) and after one.
check_torch() {
  [ -f "$build_dir/CMakeCache.txt" ] || return 0
  local found
  found=$(sed -n 's/^Torch_DIR:PATH=//p' "$build_dir/CMakeCache.txt")
  case "$found" in
    "$torch_prefix"/* | "") ;;
    *)
      echo "build: $build_dir/ was configured against the LibTorch in '$found', not LOCKSTEP_TORCH=$LOCKSTEP_TORCH's" \
           "(under $torch_prefix). Remove $build_dir/ and build again." >&2
      exit 1
      ;;
  esac
}
check_torch
# Configured when the folder has no build.ninja (a first configure that
# failed leaves a CMakeCache.txt and no build.ninja) or was configured with
# other arguments (LOCKSTEP_CMAKE_ARGS, a sanitizer): each run builds what its
# own arguments ask for, whatever ran in the folder before.
stamp=$build_dir/.lockstep-configure-args
wanted=$(printf '%s\n' -DCMAKE_BUILD_TYPE=Release "${torch_cmake_args[@]}")
if [ ! -f "$build_dir/build.ninja" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$wanted" ]; then
  mkdir -p "$build_dir"
  # --fresh: no value of an earlier configure's arguments stays in the cache.
  if ! cmake --fresh -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release "${torch_cmake_args[@]}" \
      >"$build_dir/configure.log" 2>&1; then
    tail -n 30 "$build_dir/configure.log" >&2
    echo "build: configuring $build_dir/ failed (the end of its output is above; all of it in" \
         "$build_dir/configure.log). Fix the cause and run this again; it configures the folder anew." >&2
    exit 1
  fi
  echo "$wanted" >"$stamp"
  check_torch
fi
# LOCKSTEP_BUILD_TARGETS: only these targets (CI's TSan stage builds the thread tests alone).
read -r -a targets <<< "${LOCKSTEP_BUILD_TARGETS:-}"
cmake --build "$build_dir" -j"$jobs" ${targets[@]+--target "${targets[@]}"}
