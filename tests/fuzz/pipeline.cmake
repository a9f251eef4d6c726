# Fuzz targets of the pipeline schedules: the schedule text form (and what
# the validator and simulator do with whatever parses) and the layout text.
set(_pipeline ${STRATA_ROOT}/src/parallel/pipeline)
strata_add_fuzzer(parse_schedule SOURCES ${CMAKE_CURRENT_LIST_DIR}/parse_schedule_fuzzer.cc
                  ${_pipeline}/schedule.cc ${_pipeline}/checks.cc ${_pipeline}/engine.cc
                  ${_pipeline}/validate.cc ${_pipeline}/simulate.cc ${_pipeline}/grid.cc
                  ${STRATA_ROOT}/src/base/status.cc)
strata_add_fuzzer(parse_layout SOURCES ${CMAKE_CURRENT_LIST_DIR}/parse_layout_fuzzer.cc
                  ${_pipeline}/layout.cc ${_pipeline}/schedule.cc ${STRATA_ROOT}/src/base/status.cc)
