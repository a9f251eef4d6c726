# STRATA_SANITIZE="address,undefined" or "thread" instruments everything built
# here (library, tests, extension). `make sanitize` configures build-asan/ and
# build-tsan/ with it.
if(STRATA_SANITIZE)
  set(_san_flags -fsanitize=${STRATA_SANITIZE} -fno-omit-frame-pointer -fno-sanitize-recover=undefined)
  add_compile_options("$<$<COMPILE_LANGUAGE:C,CXX>:${_san_flags}>")
  add_link_options(-fsanitize=${STRATA_SANITIZE})
endif()
