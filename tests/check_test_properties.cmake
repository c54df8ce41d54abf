# Fails unless every test ctest lists in BUILD_DIR has a label and a timeout:
# `ctest -L threads` (CI's TSan step) and the per-test timeouts depend on
# them, and a pattern CMake cannot quote in gtest_discover_tests' PROPERTIES
# drops them silently (see tests/CMakeLists.txt). Fails too where two tests
# share a name: a gtest suite in two test programs (Note [One test process
# per suite]) would run under one name.
#   cmake -DCTEST=... -DBUILD_DIR=... -P check_test_properties.cmake
cmake_minimum_required(VERSION 3.19)
# ctest lists the tests of a copy of the folders' CTestTestfile.cmake files
# (they include the test lists by absolute path): a ctest run in BUILD_DIR
# itself writes its Testing/Temporary/LastTest.log over the log of the ctest
# that runs this check.
set(copy "${BUILD_DIR}/tests/test_properties_check")
file(REMOVE_RECURSE "${copy}")
function(copy_test_files dir) # and those of the folders its subdirs() name
  file(COPY "${BUILD_DIR}/${dir}/CTestTestfile.cmake" DESTINATION "${copy}/${dir}")
  file(STRINGS "${BUILD_DIR}/${dir}/CTestTestfile.cmake" subdirs REGEX "^subdirs\\(")
  foreach(line IN LISTS subdirs)
    string(REGEX REPLACE "^subdirs\\(\"?([^\")]*)\"?\\)$" "\\1" sub "${line}")
    copy_test_files("${dir}/${sub}")
  endforeach()
endfunction()
copy_test_files(".")
execute_process(COMMAND ${CTEST} --test-dir ${copy} --show-only=json-v1
  OUTPUT_VARIABLE json RESULT_VARIABLE rc)
file(REMOVE_RECURSE "${copy}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "ctest --show-only=json-v1 failed in ${BUILD_DIR} (exit ${rc})")
endif()
string(JSON count LENGTH "${json}" tests)
if(count EQUAL 0)
  message(FATAL_ERROR "ctest lists no tests in ${BUILD_DIR}")
endif()
set(missing "")
set(names "")
set(repeated "")
math(EXPR last "${count} - 1")
foreach(i RANGE ${last})
  string(JSON name GET "${json}" tests ${i} name)
  if(name IN_LIST names)
    list(APPEND repeated "${name}")
  endif()
  list(APPEND names "${name}")
  string(JSON properties ERROR_VARIABLE no_properties GET "${json}" tests ${i} properties)
  set(has_labels FALSE)
  set(has_timeout FALSE)
  if(NOT no_properties)
    string(JSON n LENGTH "${properties}")
    math(EXPR n_last "${n} - 1")
    foreach(j RANGE ${n_last})
      string(JSON property GET "${properties}" ${j} name)
      if(property STREQUAL "LABELS")
        set(has_labels TRUE)
      elseif(property STREQUAL "TIMEOUT")
        set(has_timeout TRUE)
      endif()
    endforeach()
  endif()
  if(NOT has_labels OR NOT has_timeout)
    list(APPEND missing "${name}")
  endif()
endforeach()
list(LENGTH missing n_missing)
if(n_missing GREATER 0)
  list(SUBLIST missing 0 5 first)
  message(FATAL_ERROR "${n_missing} of ${count} tests have no label or no timeout, among them: ${first}. "
    "Check the PROPERTIES of gtest_discover_tests and set_tests_properties in tests/CMakeLists.txt.")
endif()
if(repeated)
  message(FATAL_ERROR "more than one test is named ${repeated}: give the gtest suite in the thread tests "
    "another name (the convention: SuiteThreads).")
endif()
message(STATUS "all ${count} tests have a label, a timeout and a name of their own")
