# Finds strata's dependencies and sets STRATA_HAVE_<X> for the optional ones.
# Required: abseil, nlohmann-json, xxhash, OpenSSL (SHA-256), BLAS (OpenBLAS).
# Optional (AUTO/ON/OFF): CUDA + cuBLAS, NCCL, Open MPI, Gloo, LibTorch.

find_package(Threads REQUIRED)
find_package(absl REQUIRED CONFIG)
find_package(nlohmann_json 3.9 REQUIRED CONFIG)
find_package(OpenSSL REQUIRED COMPONENTS Crypto)

find_path(XXHASH_INCLUDE_DIR xxhash.h REQUIRED)
find_library(XXHASH_LIBRARY xxhash REQUIRED)
if(NOT TARGET strata_xxhash)
  add_library(strata_xxhash INTERFACE IMPORTED)
  set_target_properties(strata_xxhash PROPERTIES
    INTERFACE_INCLUDE_DIRECTORIES ${XXHASH_INCLUDE_DIR}
    INTERFACE_LINK_LIBRARIES ${XXHASH_LIBRARY})
endif()

# OpenBLAS: Debian's package ships a CMake config; prefer the pthread flavour
# through the generic libopenblas symlink.
find_path(OPENBLAS_INCLUDE_DIR cblas.h PATH_SUFFIXES openblas openblas-pthread REQUIRED)
find_library(OPENBLAS_LIBRARY NAMES openblas REQUIRED)
if(NOT TARGET strata_blas)
  add_library(strata_blas INTERFACE IMPORTED)
  set_target_properties(strata_blas PROPERTIES
    INTERFACE_INCLUDE_DIRECTORIES ${OPENBLAS_INCLUDE_DIR}
    INTERFACE_LINK_LIBRARIES ${OPENBLAS_LIBRARY})
endif()

# Resolves an AUTO/ON/OFF option: sets OUT to TRUE when FOUND, errors when the
# option is ON and the dependency is missing.
function(strata_resolve_option option found out)
  if("${${option}}" STREQUAL "OFF")
    set(${out} FALSE PARENT_SCOPE)
  elseif(${found})
    set(${out} TRUE PARENT_SCOPE)
  elseif("${${option}}" STREQUAL "ON")
    message(FATAL_ERROR "${option}=ON but the dependency was not found")
  else()
    set(${out} FALSE PARENT_SCOPE)
  endif()
endfunction()

find_package(Python3 COMPONENTS Interpreter Development.Module)

# ---- CUDA, cuBLAS, NCCL ------------------------------------------------------
if(NOT "${STRATA_WITH_CUDA}" STREQUAL "OFF")
  if(NOT CUDAToolkit_ROOT AND EXISTS /usr/local/cuda)
    set(CUDAToolkit_ROOT /usr/local/cuda)
  endif()
  find_package(CUDAToolkit QUIET)
  include(CheckLanguage)
  if(CUDAToolkit_FOUND)
    if(NOT CMAKE_CUDA_COMPILER AND EXISTS ${CUDAToolkit_BIN_DIR}/nvcc)
      set(CMAKE_CUDA_COMPILER ${CUDAToolkit_BIN_DIR}/nvcc)
    endif()
    check_language(CUDA)
  endif()
endif()
set(_cuda_found FALSE)
if(CUDAToolkit_FOUND AND CMAKE_CUDA_COMPILER AND TARGET CUDA::cublasLt)
  set(_cuda_found TRUE)
endif()
strata_resolve_option(STRATA_WITH_CUDA _cuda_found STRATA_HAVE_CUDA)
if(STRATA_HAVE_CUDA)
  if(NOT CMAKE_CUDA_ARCHITECTURES)
    # Hopper (H100/H200, the device machine) and Ampere; PTX for newer parts.
    set(CMAKE_CUDA_ARCHITECTURES 80-real 90)
  endif()
  enable_language(CUDA)
  set(CMAKE_CUDA_STANDARD 17)
endif()

set(_nccl_found FALSE)
if(STRATA_HAVE_CUDA)
  find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} $ENV{NCCL_HOME}/include)
  find_library(NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR} $ENV{NCCL_HOME}/lib)
  if(NCCL_INCLUDE_DIR AND NCCL_LIBRARY)
    set(_nccl_found TRUE)
    file(STRINGS ${NCCL_INCLUDE_DIR}/nccl.h _nccl_ver REGEX "define NCCL_(MAJOR|MINOR|PATCH) ")
    string(REGEX REPLACE ".*NCCL_MAJOR ([0-9]+).*NCCL_MINOR ([0-9]+).*NCCL_PATCH ([0-9]+).*"
           "\\1.\\2.\\3" NCCL_HEADER_VERSION "${_nccl_ver}")
  endif()
endif()
strata_resolve_option(STRATA_WITH_NCCL _nccl_found STRATA_HAVE_NCCL)
if(STRATA_HAVE_NCCL AND NOT TARGET strata_nccl)
  # Headers only: libstrata loads libnccl at run time (one NCCL per process,
  # torch's when it is there; see src/comm/nccl/nccl_library.h).
  add_library(strata_nccl INTERFACE IMPORTED)
  set_target_properties(strata_nccl PROPERTIES
    INTERFACE_INCLUDE_DIRECTORIES ${NCCL_INCLUDE_DIR})
endif()

# ---- Open MPI ----------------------------------------------------------------
# Prefer the Open MPI 5 wheel from PyPI (installed into the machine's Python by
# tools/install_deps.sh): it carries ULFM (MPIX_Comm_revoke/shrink/agree).
# STRATA_MPI_HOME overrides; otherwise fall back to FindMPI (e.g. Debian's 4.1).
# In a virtual environment the wheel may be in the environment or, with
# --system-site-packages, in the base interpreter's prefix: look in both.
if(NOT STRATA_MPI_HOME AND Python3_Interpreter_FOUND)
  execute_process(
    COMMAND ${Python3_EXECUTABLE} -c
            "import sys, sysconfig; print(sysconfig.get_paths()['data'] + ';' + sys.base_prefix)"
    OUTPUT_VARIABLE _py_prefixes OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  foreach(_py_data IN LISTS _py_prefixes)
    if(EXISTS "${_py_data}/include/mpi.h" AND EXISTS "${_py_data}/lib/libmpi.so")
      set(STRATA_MPI_HOME "${_py_data}" CACHE PATH "Open MPI installation prefix")
      break()
    endif()
  endforeach()
endif()
set(_mpi_found FALSE)
if(NOT "${STRATA_WITH_MPI}" STREQUAL "OFF")
  if(STRATA_MPI_HOME AND EXISTS "${STRATA_MPI_HOME}/include/mpi.h")
    set(_mpi_found TRUE)
    set(STRATA_MPI_INCLUDE_DIR "${STRATA_MPI_HOME}/include")
    set(STRATA_MPI_LIBRARY "${STRATA_MPI_HOME}/lib/libmpi.so")
    set(STRATA_MPIEXEC "${STRATA_MPI_HOME}/bin/mpirun")
  else()
    find_package(MPI COMPONENTS C QUIET)
    if(MPI_C_FOUND)
      set(_mpi_found TRUE)
      set(STRATA_MPI_INCLUDE_DIR "${MPI_C_INCLUDE_DIRS}")
      set(STRATA_MPI_LIBRARY "${MPI_C_LIBRARIES}")
      set(STRATA_MPIEXEC "${MPIEXEC_EXECUTABLE}")
      set(STRATA_MPI_HOME "(FindMPI)")
    endif()
  endif()
endif()
strata_resolve_option(STRATA_WITH_MPI _mpi_found STRATA_HAVE_MPI)
if(STRATA_HAVE_MPI)
  set(STRATA_HAVE_ULFM FALSE)
  if(EXISTS "${STRATA_MPI_INCLUDE_DIR}/mpi-ext.h")
    file(READ "${STRATA_MPI_INCLUDE_DIR}/mpi-ext.h" _mpiext)
    if(_mpiext MATCHES "ftmpi")
      set(STRATA_HAVE_ULFM TRUE)
    endif()
  endif()
  if(NOT TARGET strata_mpi)
    add_library(strata_mpi INTERFACE IMPORTED)
    set_target_properties(strata_mpi PROPERTIES
      INTERFACE_INCLUDE_DIRECTORIES "${STRATA_MPI_INCLUDE_DIR}"
      INTERFACE_LINK_LIBRARIES "${STRATA_MPI_LIBRARY}")
  endif()
endif()

# ---- Gloo ----------------------------------------------------------------------
set(_gloo_found FALSE)
if(NOT "${STRATA_WITH_GLOO}" STREQUAL "OFF")
  find_path(GLOO_INCLUDE_DIR gloo/context.h)
  find_library(GLOO_LIBRARY gloo)
  if(GLOO_INCLUDE_DIR AND GLOO_LIBRARY)
    set(_gloo_found TRUE)
  endif()
endif()
strata_resolve_option(STRATA_WITH_GLOO _gloo_found STRATA_HAVE_GLOO)

# ---- LibTorch (from the torch wheel) -------------------------------------------
set(_torch_found FALSE)
if(NOT "${STRATA_WITH_TORCH}" STREQUAL "OFF" AND Python3_Interpreter_FOUND)
  execute_process(
    COMMAND ${Python3_EXECUTABLE} -c
            "import importlib.util as u, os; s = u.find_spec('torch'); print(os.path.dirname(s.origin) if s else '')"
    OUTPUT_VARIABLE STRATA_TORCH_DIR OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  if(STRATA_TORCH_DIR AND EXISTS "${STRATA_TORCH_DIR}/share/cmake/Torch")
    set(_torch_found TRUE)
  endif()
endif()
strata_resolve_option(STRATA_WITH_TORCH _torch_found STRATA_HAVE_TORCH)
