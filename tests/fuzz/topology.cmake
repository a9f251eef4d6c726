# Fuzz targets of the topology and NCCL-settings parsers (issue 5): the
# `nvidia-smi topo -m` parser, the NCCL topology XML reader and the
# nccl.conf / env-script parsers together with the lint that reads their
# output. Long run: see docs/topology.md.
set(_topo ${STRATA_ROOT}/src/comm/topology)
set(_tune ${STRATA_ROOT}/src/comm/nccl_tuning)
include(${STRATA_ROOT}/cmake/StrataNcclVars.cmake)
strata_nccl_vars_table(_nccl_vars_table)
set(_topo_common ${_topo}/text_util.cc ${_topo}/topology_types.cc ${STRATA_ROOT}/src/base/status.cc)

strata_add_fuzzer(nvidia_smi_topo SOURCES ${CMAKE_CURRENT_LIST_DIR}/nvidia_smi_topo_fuzzer.cc
                  ${_topo}/nvidia_smi_parser.cc ${_topo_common})
strata_add_fuzzer(nccl_topo_xml SOURCES ${CMAKE_CURRENT_LIST_DIR}/nccl_topo_xml_fuzzer.cc
                  ${_topo}/nccl_xml_topology.cc ${_topo}/xml_reader.cc ${_topo}/pci_path.cc
                  ${_topo_common})
strata_add_fuzzer(nccl_conf SOURCES ${CMAKE_CURRENT_LIST_DIR}/nccl_conf_fuzzer.cc
                  ${_tune}/nccl_settings.cc ${_tune}/nccl_lint.cc ${_tune}/nccl_lint_values.cc
                  ${_tune}/nccl_vars.cc ${_nccl_vars_table} ${_topo_common})
