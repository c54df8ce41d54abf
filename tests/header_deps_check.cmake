# Builds OBJECT (an object file of BUILD_DIR's TARGET) and fails if any header
# it read has FORBIDDEN in its path. The headers come from Ninja's record of
# the compile (`ninja -t deps`), which it keeps whether or not the object
# was compiled anew.
execute_process(COMMAND ${CMAKE_COMMAND} --build ${BUILD_DIR} --target ${TARGET} RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "building ${TARGET} failed (${rc})")
endif()
file(RELATIVE_PATH object ${BUILD_DIR} ${OBJECT})
execute_process(COMMAND ${MAKE_PROGRAM} -C ${BUILD_DIR} -t deps ${object} OUTPUT_VARIABLE deps RESULT_VARIABLE rc)
if(NOT rc EQUAL 0 OR NOT deps MATCHES "lockstep/lockstep\\.h")
  message(FATAL_ERROR "no record of the headers ${object} read (rc ${rc}): ${deps}")
endif()
string(REGEX MATCHALL "[^\n]*${FORBIDDEN}[^\n]*" found "${deps}")
if(found)
  message(FATAL_ERROR "${object} reads ${FORBIDDEN} headers:\n${found}")
endif()
message(STATUS "${object} reads no ${FORBIDDEN} header")
