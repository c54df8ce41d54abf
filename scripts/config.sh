# Sourced by the other scripts: which PyTorch to build against, and where.
#   LOCKSTEP_TORCH=current (default): PyTorch 2.x from PyPI, CUDA build, in .venv/
#                                     (scripts/requirements-current.txt); build/
#   LOCKSTEP_TORCH=debian:            Debian 12's libtorch-dev 1.13, CPU only; build-debian/
LOCKSTEP_TORCH=${LOCKSTEP_TORCH:-current}
case "$LOCKSTEP_TORCH" in
  current)
    build_dir=build
    # torch.utils.cmake_prefix_path, without the 2 s it takes to import torch
    torch_prefix=$(echo "$PWD"/.venv/lib/python3*/site-packages/torch/share/cmake)
    torch_cmake_args=(-DCMAKE_PREFIX_PATH="$torch_prefix")
    ;;
  debian)
    build_dir=build-debian
    torch_prefix=/usr
    torch_cmake_args=()
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
    # What each leaves out of its build, and its run-time options: sanitizer_env.sh.
    torch_cmake_args+=(-DLOCKSTEP_SANITIZE="$LOCKSTEP_SANITIZE")
    source scripts/sanitizer_env.sh
    ;;
  *)
    echo "LOCKSTEP_SANITIZE=$LOCKSTEP_SANITIZE is not a sanitizer build; expected address, thread or nothing." >&2
    exit 2
    ;;
esac
# Test files four to a compile (Note [Unity test builds], tests/CMakeLists.txt),
# in every configuration these scripts build; a plain cmake builds each alone.
torch_cmake_args+=(-DLOCKSTEP_UNITY_TESTS=ON)
# The trainer and the benchmarks are built unless LOCKSTEP_CMAKE_ARGS, which
# comes after and so wins, turns them off (CI's ASan stage:
# -DLOCKSTEP_BUILD_EXAMPLES=OFF); scripts/build.sh configures the folder anew
# when these arguments change.
torch_cmake_args+=(-DLOCKSTEP_BUILD_EXAMPLES=ON -DLOCKSTEP_BUILD_BENCH=ON)
read -r -a extra_cmake_args <<< "${LOCKSTEP_CMAKE_ARGS:-}"
torch_cmake_args+=("${extra_cmake_args[@]}")
export LOCKSTEP_TORCH LOCKSTEP_SANITIZE
