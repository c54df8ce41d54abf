# Sourced by scripts/gpu_check.sh and scripts/gpu_bench.sh on a GPU machine,
# from the repository root: configures a build of .devcheck/src (the
# committed tree that `scripts/gpu_check.sh prepare` staged) against that
# machine's PyTorch and the staged headers and libraries.

# devcheck_configure BUILD_DIR LOG [CMAKE_ARGS...]
devcheck_configure() {
  local dir=$PWD/.devcheck build=$1 log=$2
  shift 2
  local stage=$dir/stage
  if [ ! -f "$stage/lib/cmake/GTest/GTestConfig.cmake" ]; then
    { cmake -S "$dir/googletest" -B /tmp/gtest -G Ninja -DCMAKE_INSTALL_PREFIX="$stage" -DCMAKE_BUILD_TYPE=Release &&
      cmake --build /tmp/gtest && cmake --install /tmp/gtest; } >>"$log" 2>&1
  fi
  local torch_prefix
  torch_prefix=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')
  if ! cmake -S "$dir/src" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$torch_prefix;$stage" \
      -DZLIB_ROOT="$stage" "$@" >>"$log" 2>&1; then
    tail -n 30 "$log"
    echo "devcheck: configuring $build failed (above; all of it in $log)"
    return 1
  fi
}
