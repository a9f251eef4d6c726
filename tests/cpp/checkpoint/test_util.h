// Helpers shared by the checkpoint tests: scratch directories, byte
// patterns, and file surgery for corruption tests.
#pragma once

#include <stdlib.h>
#include <unistd.h>

#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "checkpoint/internal/file_util.h"
#include "strata/checkpoint/checkpointer.h"
#include "strata/checkpoint/loader.h"

namespace strata::testing_util {

// A fresh directory, removed with its contents on destruction.
class ScratchDir {
 public:
  ScratchDir() {
    const char* base = getenv("TEST_TMPDIR");
    std::string tmpl = std::string(base != nullptr ? base : "/tmp") + "/strata-ckpt-XXXXXX";
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    const char* p = mkdtemp(buf.data());
    path_ = p != nullptr ? p : "";
  }
  ~ScratchDir() { (void)checkpoint_internal::RemoveTree(path_); }
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// Deterministic bytes from a seed: every bit pattern occurs, including NaN
// payloads and negative zero for floating-point dtypes.
inline std::vector<uint8_t> RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<uint8_t> out(n);
  for (auto& b : out) b = static_cast<uint8_t>(gen());
  return out;
}

inline std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline void WriteAll(const std::string& path, const std::string& data) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(data.data(), static_cast<std::streamsize>(data.size()));
}

inline void FlipByte(const std::string& path, uint64_t offset) {
  std::string d = ReadAll(path);
  d[offset] = static_cast<char>(d[offset] ^ 0x5a);
  WriteAll(path, d);
}

inline void Truncate(const std::string& path, uint64_t size) {
  std::string d = ReadAll(path);
  d.resize(size);
  WriteAll(path, d);
}

inline absl::Time Soon() { return absl::Now() + absl::Seconds(60); }

// A one-shot event between threads (std::mutex based, so TSan sees it; the
// system abseil's synchronization is not TSan-instrumented).
class Event {
 public:
  void Notify() {
    std::lock_guard<std::mutex> l(mu_);
    set_ = true;
    cv_.notify_all();
  }
  bool IsSet() const {
    std::lock_guard<std::mutex> l(mu_);
    return set_;
  }
  // True if notified within `timeout`.
  bool WaitFor(absl::Duration timeout) {
    std::unique_lock<std::mutex> l(mu_);
    return cv_.wait_for(l, absl::ToChronoNanoseconds(timeout), [this] { return set_; });
  }

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool set_ = false;
};

}  // namespace strata::testing_util
