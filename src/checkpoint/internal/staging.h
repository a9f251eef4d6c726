// Staging memory for async saves, and the copies into it.
//
// A StagingBuffer is one page-aligned host allocation that save() copies
// the tensors into, so the training loop can change them as soon as save()
// returns while a background thread writes the copy. It is reused across
// saves (grown when a save needs more) and, when tensors live on a GPU,
// page-locked with cudaHostRegister so device-to-host copies run at full
// speed. The owner guarantees that no write from the buffer is in flight
// while it is refilled or resized.
//
// Thread-safety: thread-compatible.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace strata::checkpoint_internal {

class StagingBuffer {
 public:
  StagingBuffer() = default;
  StagingBuffer(const StagingBuffer&) = delete;
  StagingBuffer& operator=(const StagingBuffer&) = delete;
  ~StagingBuffer();

  // Makes room for `bytes`; keeps the current allocation when it is large
  // enough. Returns true when it (re)allocated.
  absl::StatusOr<bool> Reserve(uint64_t bytes);
  // Page-locks the allocation for device-to-host copies (once per
  // allocation). FailedPrecondition when no GPU is usable.
  absl::Status PinForDevice();

  uint8_t* data() const { return data_; }
  uint64_t capacity() const { return capacity_; }
  bool pinned() const { return pinned_; }
  // How many allocations were made over the buffer's life.
  int allocations() const { return allocations_; }

 private:
  void Release();
  uint8_t* data_ = nullptr;
  uint64_t capacity_ = 0;
  bool pinned_ = false;
  int allocations_ = 0;
};

// One copy into staging.
struct StagingCopy {
  const void* src = nullptr;
  void* dst = nullptr;
  uint64_t bytes = 0;
  bool device = false;  // src is CUDA device memory
};

// Performs the copies: host ones split into pieces shared by `threads`
// threads (the caller's included; the others are joined before return),
// device ones with cudaMemcpyAsync on `cuda_stream` followed by a stream
// synchronize.
absl::Status RunStagingCopies(const std::vector<StagingCopy>& copies, int threads,
                              void* cuda_stream);

// True when the CUDA runtime is compiled in and sees at least one device.
bool CudaDeviceAvailable();

}  // namespace strata::checkpoint_internal
