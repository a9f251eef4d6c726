// The checkpointer's GPU-to-host staging against a plain cudaMemcpy into
// pinned memory (the ceiling a device-to-host copy can reach), on one GPU.
// Run by benchmarks/run_staging_gpu.py.
//
// strata: checkpoint_internal::StagingBuffer (mmap'd, huge-page advised,
// page-locked with cudaHostRegister once per allocation) filled by
// RunStagingCopies (a cudaMemcpyAsync per tensor on one stream, then a
// synchronize), exactly what Checkpointer::Save does for tensors in CUDA
// memory. Peers, in the same process on the same device buffers:
//   - cudaMemcpyAsync of the same tensors into a cudaMallocHost buffer
//     (pinned by the CUDA allocator), then a synchronize;
//   - the same into pageable memory (what staging would cost unpinned).
// Also the one-off costs: cudaHostRegister of the staging buffer against
// cudaMallocHost of the same size.
//
//   staging_gpu_bench [--mib 2048] [--tensors 16] [--iters 7]
//
// Prints one JSON object on its last line: {"gpu": false, "reason"} without
// a usable GPU (exit 0), else {"gpu": true, "device", "bytes", ...} with
// the median seconds of each copy and the one-off costs. The staged bytes
// are compared with the source after the first copy (exit 1 if they
// differ).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "checkpoint/internal/staging.h"

#if STRATA_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace strata {
namespace {

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

#if STRATA_HAVE_CUDA
#define CHECK_CUDA(call)                                                                      \
  do {                                                                                        \
    const cudaError_t e_ = (call);                                                            \
    if (e_ != cudaSuccess) {                                                                  \
      std::printf("{\"gpu\": true, \"error\": \"%s: %s\"}\n", #call, cudaGetErrorString(e_)); \
      return 1;                                                                               \
    }                                                                                         \
  } while (0)

int Run(size_t bytes, int tensors, int iters) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("{\"gpu\": false, \"reason\": \"no CUDA device visible\"}\n");
    return 0;
  }
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  CHECK_CUDA(cudaSetDevice(0));
  bytes = bytes / tensors / 4096 * 4096 * tensors;  // whole pages per tensor
  const size_t each = bytes / tensors;

  // Source: random bytes (never zeros), on the device in `tensors` pieces.
  std::vector<uint8_t> pattern(bytes);
  std::mt19937_64 rng(12345);
  for (size_t i = 0; i + 8 <= bytes; i += 8) {
    const uint64_t r = rng();
    std::memcpy(&pattern[i], &r, 8);
  }
  std::vector<void*> src(tensors, nullptr);
  for (int t = 0; t < tensors; ++t) {
    CHECK_CUDA(cudaMalloc(&src[t], each));
    CHECK_CUDA(cudaMemcpy(src[t], pattern.data() + t * each, each, cudaMemcpyHostToDevice));
  }
  cudaStream_t stream = nullptr;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  // strata's staging buffer: reserve (mmap) and pin, timed once.
  checkpoint_internal::StagingBuffer staging;
  double t0 = Now();
  absl::StatusOr<bool> reserved = staging.Reserve(bytes);
  const double reserve_s = Now() - t0;
  t0 = Now();
  absl::Status pinned = reserved.ok() ? staging.PinForDevice() : reserved.status();
  const double pin_s = Now() - t0;
  if (!pinned.ok()) {
    std::printf("{\"gpu\": true, \"error\": \"staging: %s\"}\n", pinned.ToString().c_str());
    return 1;
  }
  std::vector<checkpoint_internal::StagingCopy> copies;
  for (int t = 0; t < tensors; ++t) {
    copies.push_back({src[t], staging.data() + t * each, each, /*device=*/true});
  }

  // Peers' destinations.
  void* pinned_peer = nullptr;
  t0 = Now();
  CHECK_CUDA(cudaMallocHost(&pinned_peer, bytes));
  const double malloc_host_s = Now() - t0;
  std::vector<uint8_t> pageable(bytes);
  std::memset(pageable.data(), 1, bytes);  // touched: no page faults in the copies

  auto copy_to = [&](uint8_t* dst) -> bool {
    for (int t = 0; t < tensors; ++t) {
      if (cudaMemcpyAsync(dst + t * each, src[t], each, cudaMemcpyDeviceToHost, stream) !=
          cudaSuccess) {
        return false;
      }
    }
    return cudaStreamSynchronize(stream) == cudaSuccess;
  };

  // Correctness first: poison, stage, compare.
  std::memset(staging.data(), 0xA5, bytes);
  absl::Status s = checkpoint_internal::RunStagingCopies(copies, 1, stream);
  if (!s.ok() || std::memcmp(staging.data(), pattern.data(), bytes) != 0) {
    std::printf("{\"gpu\": true, \"error\": \"the staged bytes differ from the source (%s)\"}\n",
                s.ToString().c_str());
    return 1;
  }

  // Timed, alternating the three so that drift affects all alike.
  std::vector<double> strata_s, pinned_s, pageable_s;
  for (int i = 0; i < iters; ++i) {
    t0 = Now();
    s = checkpoint_internal::RunStagingCopies(copies, 1, stream);
    strata_s.push_back(Now() - t0);
    if (!s.ok()) {
      std::printf("{\"gpu\": true, \"error\": \"%s\"}\n", s.ToString().c_str());
      return 1;
    }
    t0 = Now();
    if (!copy_to(static_cast<uint8_t*>(pinned_peer))) return 1;
    pinned_s.push_back(Now() - t0);
    t0 = Now();
    if (!copy_to(pageable.data())) return 1;
    pageable_s.push_back(Now() - t0);
  }
  std::printf(
      "{\"gpu\": true, \"device\": \"%s\", \"bytes\": %zu, \"tensors\": %d, \"iters\": %d, "
      "\"strata_s\": %.6f, \"pinned_memcpy_s\": %.6f, \"pageable_memcpy_s\": %.6f, "
      "\"reserve_s\": %.6f, \"pin_s\": %.6f, \"malloc_host_s\": %.6f}\n",
      prop.name, bytes, tensors, iters, Median(strata_s), Median(pinned_s), Median(pageable_s),
      reserve_s, pin_s, malloc_host_s);
  cudaFreeHost(pinned_peer);
  for (void* p : src) cudaFree(p);
  cudaStreamDestroy(stream);
  return 0;
}
#endif

}  // namespace
}  // namespace strata

int main(int argc, char** argv) {
  size_t mib = 2048;
  int tensors = 16, iters = 7;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    const long v = std::atol(argv[i + 1]);
    if (k == "--mib") {
      mib = static_cast<size_t>(v);
    } else if (k == "--tensors") {
      tensors = static_cast<int>(v);
    } else if (k == "--iters") {
      iters = static_cast<int>(v);
    } else {
      std::fprintf(stderr, "staging_gpu_bench: unknown option %s\n", k.c_str());
      return 2;
    }
  }
  if (mib == 0 || tensors < 1 || iters < 1) {
    std::fprintf(stderr, "staging_gpu_bench: want --mib > 0, --tensors >= 1, --iters >= 1\n");
    return 2;
  }
#if STRATA_HAVE_CUDA
  return strata::Run(mib << 20, tensors, iters);
#else
  std::printf("{\"gpu\": false, \"reason\": \"strata was built without CUDA\"}\n");
  return 0;
#endif
}
