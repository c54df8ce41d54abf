# The one place that knows where LibTorch comes from: Debian's CPU libtorch 1.13
# by default, or a PyTorch 2.x libtorch with CUDA when CMAKE_PREFIX_PATH points
# at $(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)').
# TorchConfig puts TORCH_CXX_FLAGS (the C++ ABI choice) on the torch target.
# ATen's intra-op threads are OpenMP in both; lockstep's worker pool sets
# per-thread OpenMP counts (Note [CPU replicas and threads]).
include_guard(GLOBAL)
find_package(Torch REQUIRED CONFIG)
find_package(OpenMP REQUIRED)
