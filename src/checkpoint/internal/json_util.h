// Bounded JSON parsing and typed field access for the checkpoint layer's
// stored formats (safetensors headers, manifests), which must be treated as
// hostile: a corrupt or crafted file gets an error naming the field, never a
// crash, an exception or an allocation out of proportion to its size.
//
// ParseJson checks the size and the nesting depth *before* parsing (a
// depth bomb cannot exhaust the stack), and turns nlohmann's exceptions into
// a Status with the caller's code. The Get* helpers read one field of an
// object and report a missing field or a wrong type as
// "<what>: <path>.<field> ..." with the same code.
//
// Thread-safety: free functions without shared state.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"

namespace strata::checkpoint_internal {

// Objects keep their keys in document order, so JSON text a trainer stores
// (e.g. the structure of a Python state dict) reads back in the same order.
using Json = nlohmann::ordered_json;
using OrderedJson = Json;

// Where a document comes from and how to report its faults.
struct JsonContext {
  std::string what;  // "manifest '/ckpt/step-1/manifest.json'"
  absl::StatusCode code = absl::StatusCode::kDataLoss;
};

// The deepest nesting of arrays and objects in `text` (strings skipped).
// Stops counting once `limit` is exceeded and returns limit + 1.
int JsonNestingDepth(absl::string_view text, int limit);

absl::StatusOr<Json> ParseJson(absl::string_view text, size_t max_bytes, int max_depth,
                               const JsonContext& ctx);

// Serializes; invalid UTF-8 in a string is an error, not an exception.
absl::StatusOr<std::string> DumpJson(const Json& j, int indent = -1);

absl::Status FieldError(const JsonContext& ctx, absl::string_view path, absl::string_view message);

// Field access on object `obj` located at `path` (for messages).
absl::StatusOr<const Json*> GetField(const Json& obj, const char* key, absl::string_view path,
                                     const JsonContext& ctx);
const Json* FindField(const Json& obj, const char* key);
absl::StatusOr<int64_t> GetInt(const Json& obj, const char* key, absl::string_view path,
                               const JsonContext& ctx);
absl::StatusOr<uint64_t> GetUInt(const Json& obj, const char* key, absl::string_view path,
                                 const JsonContext& ctx);
absl::StatusOr<std::string> GetString(const Json& obj, const char* key, absl::string_view path,
                                      const JsonContext& ctx);
absl::StatusOr<const Json*> GetObject(const Json& obj, const char* key, absl::string_view path,
                                      const JsonContext& ctx);
absl::StatusOr<const Json*> GetArray(const Json& obj, const char* key, absl::string_view path,
                                     const JsonContext& ctx);
// A value as int64 / uint64 (for array elements).
absl::StatusOr<int64_t> AsInt(const Json& v, absl::string_view path, const JsonContext& ctx);
absl::StatusOr<uint64_t> AsUInt(const Json& v, absl::string_view path, const JsonContext& ctx);
// An array of at most `max_len` non-negative integers that fit in int64.
absl::StatusOr<std::vector<int64_t>> GetDims(const Json& obj, const char* key,
                                             absl::string_view path, size_t max_len,
                                             const JsonContext& ctx);
// Fails if `obj` has a key outside `allowed` (catches typos and edits).
absl::Status CheckKeys(const Json& obj, std::initializer_list<const char*> allowed,
                       absl::string_view path, const JsonContext& ctx);

}  // namespace strata::checkpoint_internal
