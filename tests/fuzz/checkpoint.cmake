# Fuzz targets of the checkpoint layer: the two parsers of stored, possibly
# hostile, input. Long run (documented in docs/checkpoint.md):
#   build-fuzz/safetensors_header_fuzzer -max_total_time=3600 -max_len=65536 \
#       -rss_limit_mb=2048 -malloc_limit_mb=512 tests/fuzz/corpus/safetensors_header
#   build-fuzz/manifest_fuzzer -max_total_time=3600 -max_len=65536 \
#       -rss_limit_mb=2048 -malloc_limit_mb=512 tests/fuzz/corpus/manifest
set(_ckpt ${STRATA_ROOT}/src/checkpoint)
set(_ckpt_common ${_ckpt}/internal/json_util.cc ${_ckpt}/internal/file_util.cc
    ${_ckpt}/safetensors.cc ${_ckpt}/sharded_tensor.cc ${STRATA_ROOT}/src/base/dtype.cc
    ${STRATA_ROOT}/src/base/status.cc)
strata_add_fuzzer(safetensors_header
                  SOURCES ${CMAKE_CURRENT_LIST_DIR}/safetensors_header_fuzzer.cc ${_ckpt_common})
strata_add_fuzzer(manifest
                  SOURCES ${CMAKE_CURRENT_LIST_DIR}/manifest_fuzzer.cc ${_ckpt_common}
                  ${_ckpt}/manifest.cc ${_ckpt}/checksum.cc ${_ckpt}/state.cc)
