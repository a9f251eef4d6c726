# Helpers to register tests with CTest. Every test has a timeout; multi-rank
# tests run under tests/tools/run_multirank.sh, which turns a hang into a
# failure with a message instead of a stalled CI.
include(GoogleTest)
find_package(GTest REQUIRED)

set(STRATA_TEST_PYTHONPATH ${PROJECT_BINARY_DIR}/python)
set(STRATA_MULTIRANK ${PROJECT_SOURCE_DIR}/tests/tools/run_multirank.sh)
set(STRATA_TORCHRUN ${PROJECT_SOURCE_DIR}/tests/tools/run_torchrun.sh)
# torchrun comes with torch; the store-bootstrapped suites need it and Gloo.
set(STRATA_CAN_TORCHRUN FALSE)
if(STRATA_HAVE_GLOO AND STRATA_TORCH_DIR)
  set(STRATA_CAN_TORCHRUN TRUE)
endif()

# strata_discover_gtests(<target> [TIMEOUT s] [LABELS ...])
# Makes each TEST of GoogleTest binary <target> a CTest test, labelled
# "unit" plus LABELS.
function(strata_discover_gtests target)
  cmake_parse_arguments(A "" "TIMEOUT" "LABELS" ${ARGN})
  if(NOT A_TIMEOUT)
    set(A_TIMEOUT 120)
  endif()
  gtest_discover_tests(${target} DISCOVERY_TIMEOUT 120 PROPERTIES TIMEOUT ${A_TIMEOUT} LABELS unit)
  if(A_LABELS)
    # gtest_discover_tests() cannot pass a list-valued property through to
    # the tests it discovers (every label after the first is lost), so the
    # extra labels are set by a file ctest reads after the discovered tests.
    set(_labels_file ${CMAKE_CURRENT_BINARY_DIR}/${target}_labels.cmake)
    file(WRITE ${_labels_file}
         "if(DEFINED ${target}_TESTS)\n"
         "  set_tests_properties(\${${target}_TESTS} PROPERTIES LABELS \"unit;${A_LABELS}\")\n"
         "endif()\n")
    set_property(DIRECTORY APPEND PROPERTY TEST_INCLUDE_FILES ${_labels_file})
  endif()
endfunction()

# strata_add_gtest(<name> SOURCES a.cc ... [LIBS ...] [TIMEOUT s] [LABELS ...])
# A single-process GoogleTest binary; each TEST becomes a CTest test.
function(strata_add_gtest name)
  cmake_parse_arguments(A "" "TIMEOUT" "SOURCES;LIBS;LABELS" ${ARGN})
  add_executable(${name} ${A_SOURCES})
  target_link_libraries(${name} PRIVATE strata_testing GTest::gtest GTest::gmock GTest::gtest_main ${A_LIBS})
  strata_discover_gtests(${name} TIMEOUT ${A_TIMEOUT} LABELS ${A_LABELS})
endfunction()

# strata_add_multirank_test(<name> NP <n> [TIMEOUT s] [FT] [LAUNCHER_DEFAULTS] COMMAND cmd args...)
# Runs `cmd` on n ranks with mpirun; FT enables ULFM fault tolerance.
# LAUNCHER_DEFAULTS runs plain `mpirun --oversubscribe -np n` (what users
# type; --allow-run-as-root as root) instead of the suite's binding and
# yield settings, and labels the test "launcher-defaults".
function(strata_add_multirank_test name)
  cmake_parse_arguments(A "FT;LAUNCHER_DEFAULTS" "NP;TIMEOUT" "COMMAND;LABELS" ${ARGN})
  if(NOT A_TIMEOUT)
    set(A_TIMEOUT 180)
  endif()
  set(_ft "")
  if(A_FT)
    set(_ft "--ft")
  endif()
  set(_defaults "")
  if(A_LAUNCHER_DEFAULTS)
    set(_defaults "--launcher-defaults")
    list(APPEND A_LABELS launcher-defaults)
  endif()
  add_test(NAME ${name}
           COMMAND ${STRATA_MULTIRANK} --mpirun ${STRATA_MPIEXEC} --np ${A_NP}
                   --timeout ${A_TIMEOUT} ${_ft} ${_defaults} -- ${A_COMMAND})
  # CTest's own limit is a backstop above the runner's.
  math(EXPR _backstop "${A_TIMEOUT} + 30")
  # One multi-rank job at a time: two oversubscribed jobs on a small machine
  # starve each other's ranks and turn deadline tests into flakes.
  set_tests_properties(${name} PROPERTIES TIMEOUT ${_backstop} LABELS "multirank;${A_LABELS}"
                       ENVIRONMENT "PYTHONPATH=${STRATA_TEST_PYTHONPATH}"
                       RESOURCE_LOCK mpirun)
endfunction()

# strata_add_torchrun_test(<name> NP <n> [TIMEOUT s] [LAUNCHER_DEFAULTS] COMMAND torchrun-program-args...)
# Runs under `torchrun --standalone --nproc-per-node n` (tests/tools/run_torchrun.sh),
# on the Gloo backend: e.g. COMMAND --no-python $<TARGET_FILE:t>, or -m pytest ...
# LAUNCHER_DEFAULTS adds nothing to the environment (no OMP_NUM_THREADS) and
# labels the test "launcher-defaults".
function(strata_add_torchrun_test name)
  cmake_parse_arguments(A "LAUNCHER_DEFAULTS" "NP;TIMEOUT" "COMMAND;LABELS" ${ARGN})
  if(NOT A_TIMEOUT)
    set(A_TIMEOUT 180)
  endif()
  set(_defaults "")
  if(A_LAUNCHER_DEFAULTS)
    set(_defaults "--launcher-defaults")
    list(APPEND A_LABELS launcher-defaults)
  endif()
  add_test(NAME ${name}
           COMMAND ${STRATA_TORCHRUN} --python ${Python3_EXECUTABLE} --np ${A_NP}
                   --timeout ${A_TIMEOUT} ${_defaults} -- ${A_COMMAND}
           WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
  math(EXPR _backstop "${A_TIMEOUT} + 30")
  set_tests_properties(${name} PROPERTIES TIMEOUT ${_backstop} LABELS "multirank;torchrun;${A_LABELS}"
                       RESOURCE_LOCK mpirun
                       ENVIRONMENT "PYTHONPATH=${STRATA_TEST_PYTHONPATH}")
endfunction()

# strata_add_pytest(<name> FILES f.py... [NP n] [TIMEOUT s] [FT] [LAUNCHER_DEFAULTS])
# pytest in one process, or under mpirun on n ranks when NP is given
# (LAUNCHER_DEFAULTS: plain mpirun, see strata_add_multirank_test).
function(strata_add_pytest name)
  cmake_parse_arguments(A "FT;LAUNCHER_DEFAULTS" "NP;TIMEOUT" "FILES;ARGS;LABELS" ${ARGN})
  if(NOT A_TIMEOUT)
    set(A_TIMEOUT 300)
  endif()
  set(_pytest ${Python3_EXECUTABLE} -m pytest -q -p no:cacheprovider -x ${A_ARGS} ${A_FILES})
  if(A_NP)
    set(_ft "")
    if(A_FT)
      set(_ft FT)
    endif()
    set(_defaults "")
    if(A_LAUNCHER_DEFAULTS)
      set(_defaults LAUNCHER_DEFAULTS)
    endif()
    strata_add_multirank_test(${name} NP ${A_NP} TIMEOUT ${A_TIMEOUT} ${_ft} ${_defaults}
                              COMMAND ${_pytest} LABELS "python;${A_LABELS}")
  else()
    add_test(NAME ${name} COMMAND ${_pytest} WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
    set_tests_properties(${name} PROPERTIES TIMEOUT ${A_TIMEOUT} LABELS "python;${A_LABELS}"
                         ENVIRONMENT "PYTHONPATH=${STRATA_TEST_PYTHONPATH}")
  endif()
endfunction()

# strata_add_torchrun_pytest(<name> FILES f.py... NP n [TIMEOUT s] [LAUNCHER_DEFAULTS])
# pytest on n processes under torchrun; strata.init bootstraps through
# torchrun's TCPStore.
function(strata_add_torchrun_pytest name)
  cmake_parse_arguments(A "LAUNCHER_DEFAULTS" "NP;TIMEOUT" "FILES;ARGS;LABELS" ${ARGN})
  if(NOT STRATA_CAN_TORCHRUN)
    return()
  endif()
  set(_defaults "")
  if(A_LAUNCHER_DEFAULTS)
    set(_defaults LAUNCHER_DEFAULTS)
  endif()
  strata_add_torchrun_test(${name} NP ${A_NP} TIMEOUT ${A_TIMEOUT} ${_defaults}
                           COMMAND -m pytest -q -p no:cacheprovider -x ${A_ARGS} ${A_FILES}
                           LABELS "python;${A_LABELS}")
endfunction()
