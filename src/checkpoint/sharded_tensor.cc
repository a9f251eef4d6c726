#include "strata/checkpoint/sharded_tensor.h"

#include <algorithm>
#include <limits>
#include <numeric>
#include <tuple>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "strata/base/status.h"

namespace strata {

namespace {

// Product of dims; -1 on int64 overflow.
int64_t CheckedProduct(const std::vector<int64_t>& dims) {
  int64_t n = 1;
  for (int64_t d : dims) {
    if (d < 0) return -1;
    if (d != 0 && n > std::numeric_limits<int64_t>::max() / d) return -1;
    n *= d;
  }
  return n;
}

bool IsValidUtf8(absl::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    size_t n;
    uint32_t cp;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      n = 1;
      cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      n = 2;
      cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      n = 3;
      cp = c & 0x07;
    } else {
      return false;
    }
    for (size_t k = 1; k <= n; ++k) {
      if (i + k >= s.size()) return false;
      const unsigned char cc = static_cast<unsigned char>(s[i + k]);
      if ((cc & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (cc & 0x3F);
    }
    // Overlong forms, surrogates and values past U+10FFFF are invalid.
    if ((n == 1 && cp < 0x80) || (n == 2 && cp < 0x800) || (n == 3 && cp < 0x10000) ||
        (cp >= 0xD800 && cp <= 0xDFFF) || cp > 0x10FFFF) {
      return false;
    }
    i += n + 1;
  }
  return true;
}

std::string Dims(const std::vector<int64_t>& d) {
  return absl::StrCat("[", absl::StrJoin(d, ", "), "]");
}

}  // namespace

ShardedTensor ShardedTensor::Whole(std::string key, DataType dtype, std::vector<int64_t> shape) {
  ShardedTensor t;
  t.key = std::move(key);
  t.dtype = dtype;
  t.global_offset.assign(shape.size(), 0);
  t.local_shape = shape;
  t.global_shape = std::move(shape);
  return t;
}

int64_t ShardedTensor::local_elements() const { return CheckedProduct(local_shape); }
int64_t ShardedTensor::global_elements() const { return CheckedProduct(global_shape); }
uint64_t ShardedTensor::local_bytes() const {
  return static_cast<uint64_t>(local_elements()) * DataTypeSize(dtype);
}

absl::Status ValidateShard(const ShardedTensor& s) {
  if (s.key.empty()) return absl::InvalidArgumentError("a tensor has an empty key");
  if (s.key.size() > kMaxTensorKeyBytes) {
    return absl::InvalidArgumentError(absl::StrCat("tensor key '", s.key.substr(0, 64), "...' is ",
                                                   s.key.size(), " bytes, more than ",
                                                   kMaxTensorKeyBytes));
  }
  if (!IsValidUtf8(s.key)) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor key '", absl::CHexEscape(s.key), "' is not valid UTF-8"));
  }
  if (s.key == "__metadata__") {
    return absl::InvalidArgumentError("tensor key '__metadata__' is reserved by safetensors");
  }
  if (!DataTypeFromInt(static_cast<int>(s.dtype)).ok()) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", s.key, "' has dtype value ",
                                                   static_cast<int>(s.dtype), " outside the enum"));
  }
  const size_t nd = s.global_shape.size();
  if (nd > kMaxTensorDims) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", s.key, "' has ", nd, " dimensions, more than ", kMaxTensorDims));
  }
  if (s.local_shape.size() != nd || s.global_offset.size() != nd) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", s.key, "': global shape ", Dims(s.global_shape), ", local shape ",
                     Dims(s.local_shape), " and global offset ", Dims(s.global_offset),
                     " must have the same number of dimensions"));
  }
  for (size_t d = 0; d < nd; ++d) {
    const int64_t g = s.global_shape[d], l = s.local_shape[d], o = s.global_offset[d];
    if (g < 0 || l < 0 || o < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", s.key, "': negative size or offset in dim ", d,
                       " (global shape ", Dims(s.global_shape), ", local shape ",
                       Dims(s.local_shape), ", offset ", Dims(s.global_offset), ")"));
    }
    if (o > g || l > g - o) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", s.key, "': the shard at offset ", Dims(s.global_offset),
                       " of shape ", Dims(s.local_shape), " extends past the global shape ",
                       Dims(s.global_shape), " in dim ", d, " (", o, " + ", l, " > ", g, ")"));
    }
  }
  if (CheckedProduct(s.global_shape) < 0 ||
      static_cast<uint64_t>(CheckedProduct(s.global_shape)) >
          static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) / DataTypeSize(s.dtype)) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", s.key, "': global shape ",
                                                   Dims(s.global_shape), " overflows int64 bytes"));
  }
  if (s.replica.count < 1 || s.replica.index < 0 || s.replica.index >= s.replica.count) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", s.key, "': replica index ",
                                                   s.replica.index, " of count ", s.replica.count,
                                                   " (need 0 <= index < count, count >= 1)"));
  }
  return absl::OkStatus();
}

std::vector<int> AssignWriters(absl::Span<const ShardedTensor> shards) {
  std::vector<int> writer(shards.size(), 0);
  std::vector<size_t> order;
  int max_count = 1;
  for (size_t i = 0; i < shards.size(); ++i) {
    if (shards[i].replica.count > 1) {
      order.push_back(i);
      max_count = std::max(max_count, shards[i].replica.count);
    }
  }
  // Largest first; ties broken by key and offset, so the order is a function
  // of the set, not of the caller's order.
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const ShardedTensor& x = shards[a];
    const ShardedTensor& y = shards[b];
    const uint64_t bx = x.local_bytes(), by = y.local_bytes();
    if (bx != by) return bx > by;
    return std::tie(x.key, x.global_offset, x.replica.count) <
           std::tie(y.key, y.global_offset, y.replica.count);
  });
  // One load vector per replica count: replicas of shards with different
  // counts belong to different groups.
  std::vector<std::vector<uint64_t>> load(static_cast<size_t>(max_count) + 1);
  for (size_t i : order) {
    const int count = shards[i].replica.count;
    std::vector<uint64_t>& l = load[static_cast<size_t>(count)];
    if (l.empty()) l.assign(static_cast<size_t>(count), 0);
    const int best = static_cast<int>(std::min_element(l.begin(), l.end()) - l.begin());
    writer[i] = best;
    // A zero-byte shard still counts, so many empty shards spread out too.
    l[static_cast<size_t>(best)] += std::max<uint64_t>(shards[i].local_bytes(), 1);
  }
  return writer;
}

}  // namespace strata
