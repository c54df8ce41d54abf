#!/usr/bin/env bash
# Builds lockstep on a GPU machine against the PyTorch installed there and
# runs what needs a GPU. Such a machine may lack the Debian packages the
# build uses, so this runs in two places:
#
#   scripts/gpu_check.sh prepare   # here: .devcheck/ = the committed tree (HEAD),
#                                  # GoogleTest's sources, and the headers and CMake
#                                  # files of CLI11, nlohmann-json, zlib and Gloo
#   scripts/gpu_check.sh run OUT [SECONDS]
#                                  # there, from the repository root, with .devcheck/
#                                  # carried along: build with every core, then the
#                                  # CUDA tests, lockstep-train on the GPUs (DataParallel,
#                                  # and FullShard over NCCL), the unit and thread
#                                  # tests, the DDP and FSDP process tests, all
#                                  # within SECONDS; logs in OUT
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
    out=${2:?usage: scripts/gpu_check.sh run OUT [SECONDS]}
    # Steps run most important first, each cut off at the deadline, so a
    # short loan still returns every log.
    deadline=$((SECONDS + ${3:-3000}))
    left() { local n=$((deadline - SECONDS)); echo $((n > 5 ? n : 5)); }
    nvidia-smi -L
    python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())"
    source scripts/devcheck_build.sh
    devcheck_configure /tmp/lockstep "$out/configure.log" -DLOCKSTEP_BUILD_BENCH=OFF
    # -k 0: a file that fails to compile leaves the other targets to build and run.
    build_start=$SECONDS
    cmake --build /tmp/lockstep -- -k 0 >"$out/build.log" 2>&1 || grep -E -A12 "error|FAILED" "$out/build.log" | head -60
    echo "gpu_check: built in $((SECONDS - build_start)) s"
    cd /tmp/lockstep
    # c10d's own flight recorder, which lockstep does not use, inserted into
    # a map shared by every process group before taking its lock until
    # pytorch/pytorch#179449 (April 2026; the 2.15 wheel takes it first): on
    # 2.11 the thread tests, whose ranks are threads of one process, crashed
    # in that insert in 3 runs of 5, and in none of 3 with it off.
    export TORCH_FR_BUFFER_SIZE=${TORCH_FR_BUFFER_SIZE:-0}
    # A failure must not stop the checks after it: every step reports, none exits.
    { timeout "$(left)" ctest -R CUDA --timeout 240 --output-on-failure 2>&1 || true; } | tee "$out/cuda.log" |
      grep -E "Test +#|tests passed|tests failed" || true
    { timeout "$(left)" ./lockstep-train --synthetic --train-samples 6000 --test-samples 1000 --epochs 2 --replicas 0 \
      --out /tmp/gpu_train 2>&1 || true; } | tee "$out/train.log" | grep -E "^lockstep-train: (2 epoch|last epoch)|rror" || true
    { timeout "$(left)" ./lockstep-run --nproc-per-node 1 ./lockstep-train --synthetic --train-samples 6000 --test-samples 1000 \
      --epochs 2 --sharding full --out /tmp/gpu_train_fsdp 2>&1 || true; } | tee "$out/train_fsdp.log" |
      grep -E "lockstep-train: (2 epoch|last epoch)|rror" || true
    { timeout "$(left)" tests/lockstep_unit_tests 2>&1 || true; } >"$out/unit.log"; tail -1 "$out/unit.log"
    { timeout "$(left)" tests/lockstep_thread_tests 2>&1 || true; } >"$out/threads.log"; tail -4 "$out/threads.log"
    { timeout "$(left)" tests/lockstep_process_tests --gtest_filter='FsdpProcesses.*:DdpProcesses.*' 2>&1 || true; } \
      >"$out/processes.log"; tail -3 "$out/processes.log"
    ;;
  *)
    echo "usage: scripts/gpu_check.sh prepare | run OUT [SECONDS]" >&2
    exit 2
    ;;
esac
