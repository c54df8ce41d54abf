# The one place that knows where LibTorch comes from and how its builds differ.
# Two configurations are built and tested (scripts/config.sh):
#  - current: PyTorch 2.x's libtorch from the pip wheel, a CUDA build, found
#    through CMAKE_PREFIX_PATH=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)');
#    a libtorch archive works the same way. Its CMake config needs the CUDA
#    toolkit (nvcc) even though lockstep has no .cu files.
#  - oldest: Debian 12's CPU libtorch 1.13 (libtorch-dev), found by default.
# API differences between them are in src/util/torch_compat.h.
# TorchConfig puts TORCH_CXX_FLAGS (the C++ ABI choice) on the torch target.
# Once per directory: a consumer may find_package(lockstep) in two sibling
# directories, and imported targets (torch, OpenMP::OpenMP_CXX) exist only in
# the directory whose find_package made them.
include_guard(DIRECTORY)

# An installed lockstep also looks where it was built against, so that a
# consumer links the same libtorch; the consumer's own CMAKE_PREFIX_PATH or
# Torch_DIR win. A prefix and not a hint: TorchConfig finds its Caffe2 through
# the prefix path too, and would otherwise take Debian's from /usr.
set(_lockstep_saved_prefix_path "${CMAKE_PREFIX_PATH}")
if(LOCKSTEP_BUILT_WITH_TORCH_PREFIX)
  list(APPEND CMAKE_PREFIX_PATH "${LOCKSTEP_BUILT_WITH_TORCH_PREFIX}")
endif()
find_package(Torch REQUIRED CONFIG)
set(CMAKE_PREFIX_PATH "${_lockstep_saved_prefix_path}")

# TorchConfig finds c10 (and the rest of TORCH_LIBRARIES' files) with
# find_library(... PATHS <torch>/lib), which searches the system's folders
# first: beside Debian's libtorch-dev, the wheel's TORCH_LIBRARIES would name
# /usr's libc10 of 1.13, and a program linking them aborts at start. Each
# such file is replaced by its namesake in the LibTorch found, where it has
# one. (lockstep itself links the torch target, which names no file.)
set(_lockstep_torch_libraries)
foreach(_lib IN LISTS TORCH_LIBRARIES)
  get_filename_component(_name "${_lib}" NAME)
  string(FIND "${_lib}" "${TORCH_INSTALL_PREFIX}/" _at)
  if(IS_ABSOLUTE "${_lib}" AND NOT _at EQUAL 0 AND EXISTS "${TORCH_INSTALL_PREFIX}/lib/${_name}")
    set(_lib "${TORCH_INSTALL_PREFIX}/lib/${_name}")
  endif()
  list(APPEND _lockstep_torch_libraries "${_lib}")
endforeach()
set(TORCH_LIBRARIES "${_lockstep_torch_libraries}")

# ATen's intra-op threads are OpenMP in both; while CPU replicas run, the
# caller's OpenMP threads yield to them (Note [CPU replicas and threads],
# src/dp/cpu_threads.cpp). A LibTorch without OpenMP gets src/dp/no_openmp.cpp.
find_package(OpenMP)
# The pip wheel carries its own libgomp.so.1 beside libtorch, and that is the
# one its libtorch loads. Link that same file: one OpenMP runtime per process,
# and no second libgomp.so.1 on the run path for CMake to warn about.
if(OpenMP_CXX_FOUND AND EXISTS "${TORCH_INSTALL_PREFIX}/lib/libgomp.so.1")
  get_target_property(_lockstep_omp_libs OpenMP::OpenMP_CXX INTERFACE_LINK_LIBRARIES)
  list(TRANSFORM _lockstep_omp_libs REPLACE ".*/libgomp\\.so$" "${TORCH_INSTALL_PREFIX}/lib/libgomp.so.1")
  set_target_properties(OpenMP::OpenMP_CXX PROPERTIES INTERFACE_LINK_LIBRARIES "${_lockstep_omp_libs}")
endif()

# The pip wheel's CUDA libraries (nvidia/*/lib beside torch/) are the ones its
# libtorch was built against and loads. The CUDA toolkit's copies, which
# Torch's CMake config links programs against, can be older: /usr/local/cuda's
# NCCL lacks symbols libtorch_cuda needs, and cudart loaded from there first
# would be the toolkit's. So programs search the wheel's copies first, at link
# time and at run time.
file(GLOB _lockstep_wheel_cuda_dirs "${TORCH_INSTALL_PREFIX}/../nvidia/*/lib")
foreach(_dir IN LISTS _lockstep_wheel_cuda_dirs)
  get_filename_component(_dir "${_dir}" REALPATH)
  set_property(TARGET torch APPEND PROPERTY INTERFACE_LINK_OPTIONS "LINKER:-rpath,${_dir}")
endforeach()
