# Writes CTEST_FILE: one ctest test per gtest suite of TEST_EXECUTABLE, and
# one per case whose full name matches MAY_SKIP (Note [One test process per
# suite] in tests/CMakeLists.txt). Run after each build of the executable:
#   cmake -DTEST_EXECUTABLE=... -DCTEST_FILE=... -DLABEL=... -DMAY_SKIP=...
#         -DWORKING_DIR=... -P gtest_suites.cmake
execute_process(COMMAND "${TEST_EXECUTABLE}" --gtest_list_tests
  WORKING_DIRECTORY "${WORKING_DIR}" TIMEOUT 120
  OUTPUT_VARIABLE listing ERROR_VARIABLE listing_error RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${TEST_EXECUTABLE} --gtest_list_tests failed (${rc}): ${listing_error}")
endif()

# gtest's listing: "Suite." on a line of its own, then each case indented,
# with "  # GetParam() = ..." after a parameterized one.
string(REPLACE ";" "\\;" listing "${listing}")
string(REPLACE "\n" ";" lines "${listing}")
set(suites "")
foreach(line IN LISTS lines)
  string(REGEX REPLACE " *#.*" "" line "${line}")
  if(line MATCHES "^([^ ].*)\\.$")
    set(suite "${CMAKE_MATCH_1}")
    list(APPEND suites "${suite}")
    set(cases_${suite} "")
  elseif(line MATCHES "^  +([^ ]+)$")
    set(case "${CMAKE_MATCH_1}")
    if(NOT case MATCHES "^DISABLED_")
      list(APPEND cases_${suite} "${case}")
    endif()
  endif()
endforeach()
if(NOT suites)
  message(FATAL_ERROR "${TEST_EXECUTABLE} lists no tests")
endif()

set(script "")
macro(add_one name filter cost timeout extra)
  string(APPEND script
    "add_test([==[${name}]==] [==[${TEST_EXECUTABLE}]==] [==[--gtest_filter=${filter}]==])\n"
    "set_tests_properties([==[${name}]==] PROPERTIES WORKING_DIRECTORY [==[${WORKING_DIR}]==] "
    "LABELS [==[${LABEL}]==] TIMEOUT ${timeout} COST ${cost} ${extra})\n")
endmacro()
foreach(suite IN LISTS suites)
  set(alone "")
  set(together 0)
  foreach(case IN LISTS cases_${suite})
    if("${suite}.${case}" MATCHES "${MAY_SKIP}")
      list(APPEND alone "${suite}.${case}")
    else()
      math(EXPR together "${together} + 1")
    endif()
  endforeach()
  foreach(name IN LISTS alone)
    # gtest's "[  SKIPPED ]", with no bracket in the pattern (a bracket
    # argument with an unbalanced one loses the properties after it).
    add_one("${name}" "${name}" 1 300 "SKIP_REGULAR_EXPRESSION [==[.  SKIPPED .]==]")
  endforeach()
  if(together GREATER 0)
    string(REPLACE ";" ":" left_out "${alone}")
    set(filter "${suite}.*")
    if(left_out)
      string(APPEND filter "-${left_out}")
    endif()
    # A skip inside a suite would pass unseen: it fails the suite instead,
    # and the case belongs in MAY_SKIP.
    math(EXPR timeout "300 + 30 * ${together}")
    add_one("${suite}" "${filter}" ${together} ${timeout} "FAIL_REGULAR_EXPRESSION [==[.  SKIPPED .]==]")
  endif()
endforeach()
file(WRITE "${CTEST_FILE}" "${script}")
