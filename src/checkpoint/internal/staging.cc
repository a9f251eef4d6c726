#include "checkpoint/internal/staging.h"

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "strata/base/status.h"

#ifdef STRATA_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace strata::checkpoint_internal {

namespace {

constexpr uint64_t kHugePage = uint64_t{2} << 20;
// Host copies are cut into pieces of this size so threads share the work.
constexpr uint64_t kCopyPiece = uint64_t{32} << 20;

#ifdef STRATA_HAVE_CUDA
absl::Status CudaError(cudaError_t e, absl::string_view what) {
  return absl::InternalError(
      absl::StrCat(what, ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")"));
}
#endif

}  // namespace

bool CudaDeviceAvailable() {
#ifdef STRATA_HAVE_CUDA
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no device" error
    return false;
  }
  return n > 0;
#else
  return false;
#endif
}

StagingBuffer::~StagingBuffer() { Release(); }

void StagingBuffer::Release() {
  if (data_ == nullptr) return;
#ifdef STRATA_HAVE_CUDA
  if (pinned_) (void)cudaHostUnregister(data_);
#endif
  ::munmap(data_, capacity_);
  data_ = nullptr;
  capacity_ = 0;
  pinned_ = false;
}

absl::StatusOr<bool> StagingBuffer::Reserve(uint64_t bytes) {
  if (bytes <= capacity_) return false;
  const bool was_pinned = pinned_;
  Release();
  const uint64_t size = std::max(kHugePage, (bytes + kHugePage - 1) / kHugePage * kHugePage);
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "cannot allocate ", size, " bytes of checkpoint staging memory: ", strerror(errno)));
  }
  // Huge pages make the big copies cheaper; not an error if unavailable.
  (void)::madvise(p, size, MADV_HUGEPAGE);
  data_ = static_cast<uint8_t*>(p);
  capacity_ = size;
  ++allocations_;
  if (was_pinned) STRATA_RETURN_IF_ERROR(PinForDevice());
  return true;
}

absl::Status StagingBuffer::PinForDevice() {
  if (pinned_ || data_ == nullptr) return absl::OkStatus();
#ifdef STRATA_HAVE_CUDA
  if (!CudaDeviceAvailable()) {
    return absl::FailedPreconditionError("tensors are in CUDA memory but no GPU is usable");
  }
  const cudaError_t e = cudaHostRegister(data_, capacity_, cudaHostRegisterDefault);
  if (e != cudaSuccess)
    return CudaError(e, absl::StrCat("cudaHostRegister(", capacity_, " bytes)"));
  pinned_ = true;
  return absl::OkStatus();
#else
  return absl::UnimplementedError(
      "tensors are in CUDA memory but this build of strata has no CUDA support");
#endif
}

absl::Status RunStagingCopies(const std::vector<StagingCopy>& copies, int threads,
                              void* cuda_stream) {
  std::vector<StagingCopy> pieces;
  bool any_device = false;
  for (const StagingCopy& c : copies) {
    if (c.bytes == 0) continue;
    if (c.device) {
      any_device = true;
      continue;
    }
    for (uint64_t off = 0; off < c.bytes; off += kCopyPiece) {
      const uint64_t n = std::min(kCopyPiece, c.bytes - off);
      pieces.push_back(
          {static_cast<const char*>(c.src) + off, static_cast<char*>(c.dst) + off, n, false});
    }
  }
#ifdef STRATA_HAVE_CUDA
  if (any_device) {
    auto stream = static_cast<cudaStream_t>(cuda_stream);
    for (const StagingCopy& c : copies) {
      if (!c.device || c.bytes == 0) continue;
      const cudaError_t e = cudaMemcpyAsync(c.dst, c.src, c.bytes, cudaMemcpyDeviceToHost, stream);
      if (e != cudaSuccess) return CudaError(e, "cudaMemcpyAsync(device to staging)");
    }
  }
#else
  if (any_device) {
    return absl::UnimplementedError(
        "tensors are in CUDA memory but this build of strata has no CUDA support");
  }
#endif
  // Host copies overlap with the device ones.
  std::atomic<size_t> next{0};
  auto worker = [&] {
    for (size_t i = next.fetch_add(1); i < pieces.size(); i = next.fetch_add(1)) {
      std::memcpy(pieces[i].dst, pieces[i].src, pieces[i].bytes);
    }
  };
  const int n =
      static_cast<int>(std::min<size_t>(std::max(threads, 1), std::max<size_t>(pieces.size(), 1)));
  std::vector<std::thread> helpers;
  helpers.reserve(static_cast<size_t>(n - 1));
  for (int i = 1; i < n; ++i) helpers.emplace_back(worker);
  worker();
  for (std::thread& t : helpers) t.join();
#ifdef STRATA_HAVE_CUDA
  if (any_device) {
    const cudaError_t e = cudaStreamSynchronize(static_cast<cudaStream_t>(cuda_stream));
    if (e != cudaSuccess) return CudaError(e, "cudaStreamSynchronize(staging copies)");
  }
#endif
  return absl::OkStatus();
}

}  // namespace strata::checkpoint_internal
