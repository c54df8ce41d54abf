# Builds and runs tests/consumer against lockstep, one of two ways (MODE):
#   package: installs the lockstep build into a scratch prefix and finds it
#            with find_package(lockstep CONFIG);
#   source:  takes lockstep's source tree with FetchContent, against the
#            LibTorch the build was configured with (Torch_DIR).
file(REMOVE_RECURSE "${WORK_DIR}")
function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGN}")
  endif()
endfunction()
if(MODE STREQUAL "package")
  run(${CMAKE_COMMAND} --install "${LOCKSTEP_BUILD_DIR}" --prefix "${WORK_DIR}/prefix")
  # The installed package names targets its config finds again, never a
  # file of the machine it was built on.
  file(STRINGS "${WORK_DIR}/prefix/lib/cmake/lockstep/lockstepTargets.cmake" links REGEX "INTERFACE_LINK_LIBRARIES")
  if(links MATCHES "(^|[\";:])/") # :/ inside $<LINK_ONLY:...>
    message(FATAL_ERROR "the installed lockstepTargets.cmake links files by absolute path: ${links}")
  endif()
  set(how -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix -DCMAKE_BUILD_TYPE=Release)
elseif(MODE STREQUAL "source")
  get_filename_component(torch_prefix "${TORCH_DIR}/.." ABSOLUTE) # found as a prefix: see cmake/LockstepTorch.cmake
  # No build type: the library compiles again here without optimisation,
  # 355 s against Release's 511 on one of CI's 2-core machines, and this
  # checks that it builds and links as a subproject, not how fast it runs.
  set(how -DLOCKSTEP_SOURCE_DIR=${LOCKSTEP_SOURCE_DIR} -DCMAKE_PREFIX_PATH=${torch_prefix} -DCMAKE_BUILD_TYPE=)
else()
  message(FATAL_ERROR "MODE=${MODE}: expected package or source")
endif()
run(${CMAKE_COMMAND} -S "${CONSUMER_SOURCE_DIR}" -B "${WORK_DIR}/build" -G "${GENERATOR}" ${how})
run(${CMAKE_COMMAND} --build "${WORK_DIR}/build")
run("${WORK_DIR}/build/app")
if(MODE STREQUAL "package")
  run("${WORK_DIR}/build/app_second")
endif()
