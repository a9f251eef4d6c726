# Helpers to register tests with CTest. Every test has a timeout; multi-rank
# tests run under tests/tools/run_multirank.sh, which turns a hang into a
# failure with a message instead of a stalled CI.
include(GoogleTest)
find_package(GTest REQUIRED)

set(STRATA_TEST_PYTHONPATH ${PROJECT_BINARY_DIR}/python)
set(STRATA_MULTIRANK ${PROJECT_SOURCE_DIR}/tests/tools/run_multirank.sh)

# strata_add_gtest(<name> SOURCES a.cc ... [LIBS ...] [TIMEOUT s])
# A single-process GoogleTest binary; each TEST becomes a CTest test.
function(strata_add_gtest name)
  cmake_parse_arguments(A "" "TIMEOUT" "SOURCES;LIBS;LABELS" ${ARGN})
  if(NOT A_TIMEOUT)
    set(A_TIMEOUT 120)
  endif()
  add_executable(${name} ${A_SOURCES})
  target_link_libraries(${name} PRIVATE strata_testing GTest::gtest GTest::gmock GTest::gtest_main ${A_LIBS})
  gtest_discover_tests(${name} DISCOVERY_TIMEOUT 60 PROPERTIES TIMEOUT ${A_TIMEOUT} LABELS unit)
  if(A_LABELS)
    # gtest_discover_tests() cannot pass a list-valued property through to
    # the tests it discovers (every label after the first is lost), so the
    # extra labels are set by a file ctest reads after the discovered tests.
    set(_labels_file ${CMAKE_CURRENT_BINARY_DIR}/${name}_labels.cmake)
    file(WRITE ${_labels_file}
         "if(DEFINED ${name}_TESTS)\n"
         "  set_tests_properties(\${${name}_TESTS} PROPERTIES LABELS \"unit;${A_LABELS}\")\n"
         "endif()\n")
    set_property(DIRECTORY APPEND PROPERTY TEST_INCLUDE_FILES ${_labels_file})
  endif()
endfunction()

# strata_add_multirank_test(<name> NP <n> [TIMEOUT s] [FT] COMMAND cmd args...)
# Runs `cmd` on n ranks with mpirun; FT enables ULFM fault tolerance.
function(strata_add_multirank_test name)
  cmake_parse_arguments(A "FT" "NP;TIMEOUT" "COMMAND;LABELS" ${ARGN})
  if(NOT A_TIMEOUT)
    set(A_TIMEOUT 180)
  endif()
  set(_ft "")
  if(A_FT)
    set(_ft "--ft")
  endif()
  add_test(NAME ${name}
           COMMAND ${STRATA_MULTIRANK} --mpirun ${STRATA_MPIEXEC} --np ${A_NP}
                   --timeout ${A_TIMEOUT} ${_ft} -- ${A_COMMAND})
  # CTest's own limit is a backstop above the runner's.
  math(EXPR _backstop "${A_TIMEOUT} + 30")
  # One multi-rank job at a time: two oversubscribed jobs on a small machine
  # starve each other's ranks and turn deadline tests into flakes.
  set_tests_properties(${name} PROPERTIES TIMEOUT ${_backstop} LABELS "multirank;${A_LABELS}"
                       ENVIRONMENT "PYTHONPATH=${STRATA_TEST_PYTHONPATH}"
                       RESOURCE_LOCK mpirun)
endfunction()

# strata_add_pytest(<name> FILES f.py... [NP n] [TIMEOUT s])
# pytest in one process, or under mpirun on n ranks when NP is given.
function(strata_add_pytest name)
  cmake_parse_arguments(A "FT" "NP;TIMEOUT" "FILES;ARGS;LABELS" ${ARGN})
  if(NOT A_TIMEOUT)
    set(A_TIMEOUT 300)
  endif()
  set(_pytest ${Python3_EXECUTABLE} -m pytest -q -p no:cacheprovider -x ${A_ARGS} ${A_FILES})
  if(A_NP)
    set(_ft "")
    if(A_FT)
      set(_ft FT)
    endif()
    strata_add_multirank_test(${name} NP ${A_NP} TIMEOUT ${A_TIMEOUT} ${_ft}
                              COMMAND ${_pytest} LABELS "python;${A_LABELS}")
  else()
    add_test(NAME ${name} COMMAND ${_pytest} WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
    set_tests_properties(${name} PROPERTIES TIMEOUT ${A_TIMEOUT} LABELS "python;${A_LABELS}"
                         ENVIRONMENT "PYTHONPATH=${STRATA_TEST_PYTHONPATH}")
  endif()
endfunction()
