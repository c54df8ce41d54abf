#!/usr/bin/env bash
# Builds lockstep on a GPU machine against the PyTorch installed there and
# runs what needs a GPU. Such a machine may lack the Debian packages the
# build uses, so this runs in two places:
#
#   scripts/gpu_check.sh prepare   # here: .devcheck/ = the committed tree (HEAD),
#                                  # GoogleTest's sources, and the headers and CMake
#                                  # files of CLI11, nlohmann-json, zlib and Gloo
#   scripts/gpu_check.sh run OUT   # there, from the repository root, with .devcheck/
#                                  # carried along: build with every core, then the
#                                  # CUDA tests, the unit and thread tests, the DDP
#                                  # process tests, and lockstep-train on the GPUs;
#                                  # logs in OUT
set -euo pipefail
cd "$(dirname "$0")/.."
dir=$PWD/.devcheck
case "${1:-}" in
  prepare)
    grep -qx '/.devcheck/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo '/.devcheck/' >>.git/info/exclude; }
    rm -rf "$dir"
    mkdir -p "$dir/src" "$dir/stage/include" "$dir/stage/share/cmake" "$dir/stage/lib"
    git archive HEAD | tar -x -C "$dir/src"
    cp -r /usr/src/googletest "$dir/googletest"
    cp -r /usr/include/CLI /usr/include/nlohmann /usr/include/gloo /usr/include/zlib.h /usr/include/zconf.h "$dir/stage/include/"
    cp -r /usr/share/cmake/CLI11 /usr/share/cmake/nlohmann_json "$dir/stage/share/cmake/"
    cp /usr/lib/x86_64-linux-gnu/libz.a "$dir/stage/lib/"
    echo "gpu_check: $(du -sh "$dir" | cut -f1) in .devcheck/, of commit $(git rev-parse --short HEAD)"
    ;;
  run)
    out=${2:?usage: scripts/gpu_check.sh run OUT}
    stage=$dir/stage
    nvidia-smi -L
    python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())"
    { cmake -S "$dir/googletest" -B /tmp/gtest -G Ninja -DCMAKE_INSTALL_PREFIX="$stage" -DCMAKE_BUILD_TYPE=Release &&
      cmake --build /tmp/gtest && cmake --install /tmp/gtest; } >"$out/gtest.log" 2>&1
    torch_prefix=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')
    cmake -S "$dir/src" -B /tmp/lockstep -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$torch_prefix;$stage" \
      -DZLIB_ROOT="$stage" -DLOCKSTEP_BUILD_BENCH=OFF >"$out/configure.log" 2>&1
    cmake --build /tmp/lockstep >"$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }
    cd /tmp/lockstep
    # A failure must not stop the checks after it: every step reports, none exits.
    { ctest -R CUDA --output-on-failure 2>&1 || true; } | tee "$out/cuda.log" | grep -E "Test +#|tests passed|tests failed" || true
    tests/lockstep_unit_tests >"$out/unit.log" 2>&1; tail -1 "$out/unit.log"
    tests/lockstep_thread_tests >"$out/threads.log" 2>&1; tail -4 "$out/threads.log"
    tests/lockstep_process_tests --gtest_filter='DdpProcesses.*' >"$out/processes.log" 2>&1; tail -3 "$out/processes.log"
    { ./lockstep-train --synthetic --train-samples 6000 --test-samples 1000 --epochs 2 --replicas 0 --out /tmp/gpu_train \
      2>&1 || true; } | tee "$out/train.log" | grep -E "^lockstep-train: (2 epoch|last epoch)|rror" || true
    ;;
  *)
    echo "usage: scripts/gpu_check.sh prepare | run OUT" >&2
    exit 2
    ;;
esac
