// Links libnccl without calling it, like libtorch_cuda.so (nccl_locate_test:
// the report names the library that brought NCCL into the process).
extern "C" int strata_nccl_linker_fixture() { return 0; }
