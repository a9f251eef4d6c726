# Fuzz targets of the base layer.
strata_add_fuzzer(parse_dtype SOURCES ${CMAKE_CURRENT_LIST_DIR}/parse_dtype_fuzzer.cc
                  ${STRATA_ROOT}/src/base/dtype.cc ${STRATA_ROOT}/src/base/status.cc)
