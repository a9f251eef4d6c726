# strata: the two commands are `make demo` and `make test` (see README.md).
# Both install what is missing, build, and run; a second run with everything
# in place only checks and rebuilds what changed.

SHELL := /bin/bash
PYTHON ?= python3
BUILD ?= build
JOBS ?= $(shell nproc)
NP ?= 8
LAUNCHER ?= mpirun
CMAKE_ARGS ?=
# The Open MPI 5 wheel (with ULFM) installs mpirun into the Python prefix.
MPI_PREFIX := $(shell $(PYTHON) -c "import sysconfig; print(sysconfig.get_paths()['data'])" 2>/dev/null)
MPIRUN ?= $(MPI_PREFIX)/bin/mpirun
MPIRUN_FLAGS ?= --allow-run-as-root --oversubscribe --bind-to none
export PYTHONPATH := $(CURDIR)/$(BUILD)/python$(if $(PYTHONPATH),:$(PYTHONPATH))

.PHONY: all deps configure build test demo bench gpu-check sanitize sanitize-thread fuzz-short format install clean help

all: build

help:
	@echo "make demo      install what is missing, build what the demo needs, train on $(NP) CPU ranks, then kill a rank of an elastic job (LAUNCHER=mpirun or torchrun)"
	@echo "make test      install what is missing, build, run every test"
	@echo "make bench     run every benchmark; results in benchmarks/results/, benchmarks/RESULTS.md"
	@echo "make gpu-check every GPU test and benchmark in one run (a dry run without a GPU): docs/development.md"
	@echo "make sanitize  build under ASan+UBSan (build-asan/) and TSan (build-tsan/), run the tests"
	@echo "make format    clang-format the C++ sources"

deps:
	@tools/install_deps.sh

$(BUILD)/build.ninja:
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo $(CMAKE_ARGS)

configure: deps $(BUILD)/build.ninja

build: configure
	@cmake --build $(BUILD) -j $(JOBS)

test: build
	cd $(BUILD) && ctest -j $(JOBS) --output-on-failure --timeout 900
	@$(MAKE) --no-print-directory fuzz-short

# libFuzzer targets (tests/fuzz, built with clang), each run briefly. For a
# long run: build-fuzz/<name>_fuzzer -max_total_time=3600 tests/fuzz/corpus/<name>
FUZZ_SECONDS ?= 15
fuzz-short: deps
	@cmake -S tests/fuzz -B build-fuzz -G Ninja -DCMAKE_CXX_COMPILER=clang++-14 \
	  -DSTRATA_FUZZ_SECONDS=$(FUZZ_SECONDS) >/dev/null
	@cmake --build build-fuzz -j $(JOBS)
	cd build-fuzz && ctest -j $(JOBS) --output-on-failure

# The demo builds only what it runs (the CMake target strata_demo: libstrata,
# the Python extension and package, the Gloo plugin), not the tests and
# benchmarks that `make build` / `make test` build. tools/quiet_build.py says
# what it builds and about how long it takes, shows one progress line and
# keeps the full log in $(BUILD)/strata_demo-build.log.
demo: deps
	@$(PYTHON) tools/quiet_build.py --build $(BUILD) --target strata_demo --jobs $(JOBS) \
	  --label demo --what "the library and the Python extension" -- $(CMAKE_ARGS)
	@tools/run_demo.sh --launcher $(LAUNCHER) --np $(NP) --mpirun "$(MPIRUN)"

bench: build
	@for d in benchmarks/run_*.py; do echo "== $$d"; $(PYTHON) $$d --build $(BUILD) || exit 1; done
	@echo "results: benchmarks/results/*.json, table: benchmarks/RESULTS.md"

# Every GPU check as one prepared run (tools/dev/gpu_checks.sh; on the device
# machine, see docs/development.md). It configures and builds what the checks
# need itself (with the dependencies carried by `gpu_checks.sh --pack` where
# the machine has no registry), so it does not depend on `deps`. Without a
# GPU it is the dry run that `make test` also runs (gpu_checks_dry_run).
GPU_CHECK_ARGS ?=
gpu-check:
	@tools/dev/gpu_checks.sh --build $(BUILD) $(GPU_CHECK_ARGS)

# ASan+UBSan over the C++ tests (the Python extension is left out: it would
# need the sanitizer runtime preloaded into the interpreter). Leaks are
# unwound fully (fast_unwind_on_malloc=0): Open MPI and PMIx are built
# without frame pointers, so the fast unwinder stops in libc and
# lsan.supp's library patterns could not match their allocations.
sanitize: deps
	cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DSTRATA_SANITIZE=address,undefined \
	  -DSTRATA_BUILD_PYTHON=OFF -DSTRATA_BUILD_BENCHMARKS=OFF $(CMAKE_ARGS)
	cmake --build build-asan -j $(JOBS)
	cd build-asan && ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:fast_unwind_on_malloc=0 \
	  LSAN_OPTIONS=suppressions=$(CURDIR)/tests/tools/lsan.supp \
	  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	  ctest -j $(JOBS) --output-on-failure --timeout 1200 -LE python
	$(MAKE) sanitize-thread

# TSan over the tests of threaded code (label "threads"). UCX_MEM_EVENTS=no:
# Open MPI loads UCX, whose madvise hook takes a lock in exiting threads
# after TSan has let go of them, which crashes. PMIX_MCA_gds=hash: PMIx's
# shmem2 store maps a segment at a fixed address inside TSan's shadow
# memory and MPI_Init fails.
sanitize-thread: deps
	cmake -S . -B build-tsan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DSTRATA_SANITIZE=thread \
	  -DSTRATA_BUILD_PYTHON=OFF -DSTRATA_BUILD_BENCHMARKS=OFF $(CMAKE_ARGS)
	UCX_MEM_EVENTS=no PMIX_MCA_gds=hash cmake --build build-tsan -j $(JOBS)
	cd build-tsan && TSAN_OPTIONS=suppressions=$(CURDIR)/tests/tools/tsan.supp:halt_on_error=1 UCX_MEM_EVENTS=no \
	  PMIX_MCA_gds=hash \
	  ctest -j $(JOBS) --output-on-failure --timeout 1200 -L threads --no-tests=error

format:
	@git ls-files '*.h' '*.cc' '*.cu' | xargs clang-format -i

install: build
	cmake --install $(BUILD) --prefix $(or $(PREFIX),/usr/local)

clean:
	rm -rf $(BUILD) build-asan build-tsan build-fuzz
