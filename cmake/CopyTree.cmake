# cmake -DSRC=dir -DDST=dir -P CopyTree.cmake: copies *.py from SRC to DST,
# keeping timestamps so unchanged files are not rewritten.
file(GLOB_RECURSE _files RELATIVE ${SRC} ${SRC}/*.py)
foreach(f ${_files})
  get_filename_component(_dir ${DST}/${f} DIRECTORY)
  file(COPY ${SRC}/${f} DESTINATION ${_dir})
endforeach()
