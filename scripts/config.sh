# Sourced by the other scripts: which PyTorch to build against, and where.
#   LOCKSTEP_TORCH=current (default): PyTorch 2.x from PyPI, CUDA build, in .venv/
#                                     (scripts/requirements-current.txt); build/
#   LOCKSTEP_TORCH=debian:            Debian 12's libtorch-dev 1.13, CPU only; build-debian/
LOCKSTEP_TORCH=${LOCKSTEP_TORCH:-current}
case "$LOCKSTEP_TORCH" in
  current)
    build_dir=build
    # torch.utils.cmake_prefix_path, without the 2 s it takes to import torch
    torch_cmake_args=(-DCMAKE_PREFIX_PATH="$(echo "$PWD"/.venv/lib/python3*/site-packages/torch/share/cmake)")
    ;;
  debian)
    build_dir=build-debian
    # Test files four to a compile (Note [Unity test builds], tests/CMakeLists.txt);
    # current builds each alone, which keeps every file compiling on its own.
    torch_cmake_args=(-DLOCKSTEP_UNITY_TESTS=ON)
    ;;
  *)
    echo "LOCKSTEP_TORCH=$LOCKSTEP_TORCH is not a configuration; expected current or debian." >&2
    exit 2
    ;;
esac
# LOCKSTEP_SANITIZE=address (ASan+UBSan) or thread (TSan): an instrumented build
# in its own folder (build-debian-address, ...), and the sanitizers' options
# and suppressions (tests/sanitizers/) for every process the tests start.
LOCKSTEP_SANITIZE=${LOCKSTEP_SANITIZE:-}
case "$LOCKSTEP_SANITIZE" in
  "") ;;
  address|thread)
    build_dir=$build_dir-$LOCKSTEP_SANITIZE
    # Benchmarks mean nothing instrumented; CI runs ASan without the
    # trainer's own tests (.ci/run), and TSan on the thread tests only, so
    # their builds leave those out too.
    torch_cmake_args+=(-DLOCKSTEP_SANITIZE="$LOCKSTEP_SANITIZE" -DLOCKSTEP_BUILD_BENCH=OFF)
    if [ "$LOCKSTEP_SANITIZE" = address ]; then
      torch_cmake_args+=(-DLOCKSTEP_BUILD_TRAINER_TESTS=OFF)
    else
      torch_cmake_args+=(-DLOCKSTEP_BUILD_EXAMPLES=OFF)
    fi
    source scripts/sanitizer_env.sh
    ;;
  *)
    echo "LOCKSTEP_SANITIZE=$LOCKSTEP_SANITIZE is not a sanitizer build; expected address, thread or nothing." >&2
    exit 2
    ;;
esac
export LOCKSTEP_TORCH LOCKSTEP_SANITIZE
