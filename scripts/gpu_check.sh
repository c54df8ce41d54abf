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
    out=$(realpath -m "${2:?usage: scripts/gpu_check.sh run OUT [SECONDS]}")
    mkdir -p "$out"
    # Steps run most important first, each cut off at the deadline, so a
    # short loan still returns every log. A step that fails does not stop
    # the ones after it; the script ends non-zero, naming each failure.
    deadline=$((SECONDS + ${3:-3000}))
    left() { local n=$((deadline - SECONDS)); echo $((n > 5 ? n : 5)); }
    failures=()
    step() { # NAME LOG COMMAND...: COMMAND's output into LOG
      local name=$1 log=$2 rc=0
      shift 2
      timeout "$(left)" "$@" >"$log" 2>&1 || rc=$?
      [ "$rc" -eq 0 ] || failures+=("$name (exit $rc; $log)")
    }
    nvidia-smi -L
    python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())"
    source scripts/devcheck_build.sh
    devcheck_configure /tmp/lockstep "$out/configure.log" -DLOCKSTEP_BUILD_BENCH=OFF
    # -k 0: a file that fails to compile leaves the other targets to build and run.
    build_start=$SECONDS
    if ! cmake --build /tmp/lockstep -- -k 0 >"$out/build.log" 2>&1; then
      grep -E -A12 "error|FAILED" "$out/build.log" | head -60 || true
      failures+=("build ($out/build.log)")
    fi
    echo "gpu_check: built in $((SECONDS - build_start)) s"
    cd /tmp/lockstep
    # c10d's own flight recorder, which lockstep does not use, inserted into
    # a map shared by every process group before taking its lock until
    # pytorch/pytorch#179449 (April 2026; the 2.15 wheel takes it first): on
    # 2.11 the thread tests, whose ranks are threads of one process, crashed
    # in that insert in 3 runs of 5, and in none of 3 with it off.
    export TORCH_FR_BUFFER_SIZE=${TORCH_FR_BUFFER_SIZE:-0}
    step "the CUDA tests" "$out/cuda.log" ctest -R CUDA --timeout 240 --output-on-failure
    grep -E "Test +#|tests passed|tests failed" "$out/cuda.log" || true
    step "lockstep-train over every GPU" "$out/train.log" ./lockstep-train --synthetic --train-samples 6000 \
      --test-samples 1000 --epochs 2 --replicas 0 --out /tmp/gpu_train
    grep -E "^lockstep-train: (2 epoch|last epoch)|rror" "$out/train.log" || true
    step "lockstep-train under FullShard" "$out/train_fsdp.log" ./lockstep-run --nproc-per-node 1 ./lockstep-train \
      --synthetic --train-samples 6000 --test-samples 1000 --epochs 2 --sharding full --out /tmp/gpu_train_fsdp
    grep -E "lockstep-train: (2 epoch|last epoch)|rror" "$out/train_fsdp.log" || true
    step "the unit tests" "$out/unit.log" tests/lockstep_unit_tests
    tail -1 "$out/unit.log"
    step "the thread tests" "$out/threads.log" tests/lockstep_thread_tests
    tail -4 "$out/threads.log"
    step "the DDP and FSDP process tests" "$out/processes.log" tests/lockstep_process_tests \
      --gtest_filter='FsdpProcesses.*:DdpProcesses.*'
    tail -3 "$out/processes.log"
    if [ ${#failures[@]} -gt 0 ]; then
      printf 'gpu_check: FAILED: %s\n' "${failures[@]}"
      exit 1
    fi
    echo "gpu_check: every step passed"
    ;;
  *)
    echo "usage: scripts/gpu_check.sh prepare | run OUT [SECONDS]" >&2
    exit 2
    ;;
esac
