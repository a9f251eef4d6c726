# strata_nccl_vars_table(<out_var>): the C++ of the NCCL variable table,
# generated in the current binary directory from
# src/comm/nccl_tuning/nccl_vars.tsv by gen_nccl_vars.py whenever either
# changes. A malformed row fails the build with the row's line number.
# Targets of other directories that compile the file must depend on the
# custom target strata_nccl_vars_table (CMake attaches the rule only to
# targets of this directory). Used by src/comm/nccl_tuning and by the fuzz
# project (tests/fuzz).
function(strata_nccl_vars_table out_var)
  if(NOT Python3_Interpreter_FOUND)
    find_package(Python3 REQUIRED COMPONENTS Interpreter)
  endif()
  get_filename_component(_dir ${CMAKE_CURRENT_FUNCTION_LIST_DIR}/../src/comm/nccl_tuning ABSOLUTE)
  set(_out ${CMAKE_CURRENT_BINARY_DIR}/nccl_vars_table.cc)
  add_custom_command(
    OUTPUT ${_out}
    COMMAND ${Python3_EXECUTABLE} ${_dir}/gen_nccl_vars.py --input ${_dir}/nccl_vars.tsv
            --output ${_out}
    DEPENDS ${_dir}/gen_nccl_vars.py ${_dir}/nccl_vars.tsv
    COMMENT "Generating the NCCL variable table from nccl_vars.tsv"
    VERBATIM)
  add_custom_target(strata_nccl_vars_table DEPENDS ${_out})
  set(${out_var} ${_out} PARENT_SCOPE)
endfunction()
