# Compiles through ccache when the machine has it, set up so that what CI
# compiles most is cached: the precompiled <torch/torch.h> and the files
# that include it (every source and unity test file), which ccache otherwise
# refuses ("could not use precompiled header"), and so that a clean clone in
# another folder hits what earlier builds on the machine stored.
#   - sloppiness pch_defines,time_macros: ccache's own condition for caching
#     a compile that uses a precompiled header (its manual, "Precompiled
#     headers"); include_file_mtime,include_file_ctime: a fresh clone's
#     headers are new files, which ccache would otherwise not trust yet.
#   - -fpch-preprocess (GCC): lets ccache see, and hash, which .gch a
#     compile reads.
#   - base_dir at the source tree and no hashed working directory: paths
#     inside it are hashed relative to it, the same in every clone.
# LOCKSTEP_CCACHE=OFF compiles without it.
option(LOCKSTEP_CCACHE "Compile through ccache when it is installed" ON)
find_program(CCACHE_PROGRAM ccache)
if(NOT LOCKSTEP_CCACHE OR NOT CCACHE_PROGRAM)
  return()
endif()
set(CMAKE_CXX_COMPILER_LAUNCHER
    ${CMAKE_COMMAND} -E env
    "CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime,locale"
    "CCACHE_BASEDIR=${PROJECT_SOURCE_DIR}"
    CCACHE_NOHASHDIR=1
    ${CCACHE_PROGRAM})
if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
  add_compile_options(-fpch-preprocess)
endif()
