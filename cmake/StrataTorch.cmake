# The LibTorch adapter's dependency, made safe to configure.
#
# The torch wheel's TorchConfig (through Caffe2Config) is not a quiet find
# module: with a CUDA wheel it looks for a CUDA toolkit and stops the whole
# configure with FATAL_ERROR when there is none, and its GPU-architecture
# detection (a try_run) fails when C++20 is the default standard. So:
#   1. TORCH_CUDA_ARCH_LIST is preset (STRATA_TORCH_CUDA_ARCH_LIST), which
#      skips the detection;
#   2. find_package(Torch) first runs in a throw-away probe project (a few
#      seconds, once per build directory, cached); only when the probe
#      succeeds does src/torch run it for real, in its own directory scope so
#      that TorchConfig's variables do not leak into the rest of the build.
# With STRATA_WITH_TORCH=AUTO a failed probe turns the adapter off with a
# message naming the probe's log; with ON it is an error.
#
# Sets STRATA_TORCH_ADAPTER (TRUE/FALSE) and STRATA_TORCH_CMAKE_DIR.
set(STRATA_TORCH_CUDA_ARCH_LIST "8.0;9.0" CACHE STRING
    "TORCH_CUDA_ARCH_LIST given to TorchConfig (skips its GPU detection)")

set(STRATA_TORCH_ADAPTER FALSE)
if(STRATA_HAVE_TORCH AND STRATA_SANITIZE)
  # The sanitizer runtimes cannot see into the uninstrumented LibTorch (its
  # thread pools and allocator give false reports); the adapter is tested
  # in the normal build.
  message(STATUS "LibTorch adapter off under STRATA_SANITIZE=${STRATA_SANITIZE}")
elseif(STRATA_HAVE_TORCH)
  set(STRATA_TORCH_CMAKE_DIR "${STRATA_TORCH_DIR}/share/cmake")
  set(_key "${STRATA_TORCH_CMAKE_DIR}|${STRATA_TORCH_CUDA_ARCH_LIST}|${CMAKE_CXX_COMPILER}")
  if(NOT "${STRATA_TORCH_PROBE_KEY}" STREQUAL "${_key}")
    set(_probe ${PROJECT_BINARY_DIR}/torch-probe)
    file(REMOVE_RECURSE ${_probe})
    file(WRITE ${_probe}/src/CMakeLists.txt
         "cmake_minimum_required(VERSION 3.25)\n"
         "project(strata_torch_probe LANGUAGES CXX)\n"
         "find_package(Torch REQUIRED CONFIG)\n"
         "if(NOT TARGET torch_cpu OR NOT TARGET c10)\n"
         "  message(FATAL_ERROR \"TorchConfig defined no torch_cpu/c10 targets\")\n"
         "endif()\n")
    message(STATUS "Probing LibTorch's CMake config in ${STRATA_TORCH_CMAKE_DIR}")
    execute_process(
      COMMAND ${CMAKE_COMMAND} -S ${_probe}/src -B ${_probe}/build
              -DCMAKE_PREFIX_PATH=${STRATA_TORCH_CMAKE_DIR}
              -DCMAKE_CXX_COMPILER=${CMAKE_CXX_COMPILER}
              "-DTORCH_CUDA_ARCH_LIST=${STRATA_TORCH_CUDA_ARCH_LIST}"
      RESULT_VARIABLE _rc OUTPUT_FILE ${_probe}/log.txt ERROR_FILE ${_probe}/log.txt
      TIMEOUT 300)
    if(_rc EQUAL 0)
      set(STRATA_TORCH_PROBE_OK TRUE CACHE INTERNAL "")
    else()
      set(STRATA_TORCH_PROBE_OK FALSE CACHE INTERNAL "")
    endif()
    set(STRATA_TORCH_PROBE_KEY "${_key}" CACHE INTERNAL "")
  endif()
  if(STRATA_TORCH_PROBE_OK)
    set(STRATA_TORCH_ADAPTER TRUE)
  elseif("${STRATA_WITH_TORCH}" STREQUAL "ON")
    message(FATAL_ERROR "STRATA_WITH_TORCH=ON but find_package(Torch) fails; see "
                        "${PROJECT_BINARY_DIR}/torch-probe/log.txt")
  else()
    message(STATUS "LibTorch adapter off: find_package(Torch) fails, see "
                   "${PROJECT_BINARY_DIR}/torch-probe/log.txt")
  endif()
endif()
