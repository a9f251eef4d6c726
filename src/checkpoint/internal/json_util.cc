#include "checkpoint/internal/json_util.h"

#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "strata/base/status.h"

namespace strata::checkpoint_internal {

int JsonNestingDepth(absl::string_view text, int limit) {
  int depth = 0, max_depth = 0;
  bool in_string = false, escaped = false;
  for (char c : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth) {
        max_depth = depth;
        if (max_depth > limit) return limit + 1;
      }
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return max_depth;
}

absl::Status FieldError(const JsonContext& ctx, absl::string_view path, absl::string_view message) {
  return absl::Status(ctx.code, absl::StrCat(ctx.what, ": ", path, " ", message));
}

absl::StatusOr<Json> ParseJson(absl::string_view text, size_t max_bytes, int max_depth,
                               const JsonContext& ctx) {
  if (text.size() > max_bytes) {
    return absl::Status(ctx.code, absl::StrCat(ctx.what, " is ", text.size(),
                                               " bytes, more than the limit of ", max_bytes));
  }
  const int depth = JsonNestingDepth(text, max_depth);
  if (depth > max_depth) {
    return absl::Status(ctx.code, absl::StrCat(ctx.what, " nests arrays/objects deeper than ",
                                               max_depth, " levels"));
  }
  try {
    return Json::parse(text.begin(), text.end());
  } catch (const Json::exception& e) {
    return absl::Status(ctx.code, absl::StrCat(ctx.what, " is not valid JSON: ", e.what()));
  }
}

namespace {

const char* TypeName(const Json& v) { return v.type_name(); }

}  // namespace

absl::StatusOr<std::string> DumpJson(const Json& j, int indent) {
  try {
    return j.dump(indent);
  } catch (const Json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("cannot serialize JSON: ", e.what()));
  }
}

const Json* FindField(const Json& obj, const char* key) {
  if (!obj.is_object()) return nullptr;
  auto it = obj.find(key);
  return it == obj.end() ? nullptr : &*it;
}

absl::StatusOr<const Json*> GetField(const Json& obj, const char* key, absl::string_view path,
                                     const JsonContext& ctx) {
  if (!obj.is_object())
    return FieldError(ctx, path, absl::StrCat("is a ", TypeName(obj), ", not an object"));
  const Json* v = FindField(obj, key);
  if (v == nullptr) return FieldError(ctx, absl::StrCat(path, ".", key), "is missing");
  return v;
}

absl::StatusOr<int64_t> AsInt(const Json& v, absl::string_view path, const JsonContext& ctx) {
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return FieldError(ctx, path, absl::StrCat("is ", u, ", too large"));
    }
    return static_cast<int64_t>(u);
  }
  if (v.is_number_integer()) return v.get<int64_t>();
  return FieldError(ctx, path, absl::StrCat("is a ", TypeName(v), ", not an integer"));
}

absl::StatusOr<uint64_t> AsUInt(const Json& v, absl::string_view path, const JsonContext& ctx) {
  if (v.is_number_unsigned()) return v.get<uint64_t>();
  if (v.is_number_integer()) {
    return FieldError(ctx, path,
                      absl::StrCat("is ", v.get<int64_t>(), ", not a non-negative integer"));
  }
  return FieldError(ctx, path, absl::StrCat("is a ", TypeName(v), ", not an integer"));
}

absl::StatusOr<int64_t> GetInt(const Json& obj, const char* key, absl::string_view path,
                               const JsonContext& ctx) {
  STRATA_ASSIGN_OR_RETURN(const Json* v, GetField(obj, key, path, ctx));
  return AsInt(*v, absl::StrCat(path, ".", key), ctx);
}

absl::StatusOr<uint64_t> GetUInt(const Json& obj, const char* key, absl::string_view path,
                                 const JsonContext& ctx) {
  STRATA_ASSIGN_OR_RETURN(const Json* v, GetField(obj, key, path, ctx));
  return AsUInt(*v, absl::StrCat(path, ".", key), ctx);
}

absl::StatusOr<std::string> GetString(const Json& obj, const char* key, absl::string_view path,
                                      const JsonContext& ctx) {
  STRATA_ASSIGN_OR_RETURN(const Json* v, GetField(obj, key, path, ctx));
  if (!v->is_string()) {
    return FieldError(ctx, absl::StrCat(path, ".", key),
                      absl::StrCat("is a ", TypeName(*v), ", not a string"));
  }
  return v->get<std::string>();
}

absl::StatusOr<const Json*> GetObject(const Json& obj, const char* key, absl::string_view path,
                                      const JsonContext& ctx) {
  STRATA_ASSIGN_OR_RETURN(const Json* v, GetField(obj, key, path, ctx));
  if (!v->is_object()) {
    return FieldError(ctx, absl::StrCat(path, ".", key),
                      absl::StrCat("is a ", TypeName(*v), ", not an object"));
  }
  return v;
}

absl::StatusOr<const Json*> GetArray(const Json& obj, const char* key, absl::string_view path,
                                     const JsonContext& ctx) {
  STRATA_ASSIGN_OR_RETURN(const Json* v, GetField(obj, key, path, ctx));
  if (!v->is_array()) {
    return FieldError(ctx, absl::StrCat(path, ".", key),
                      absl::StrCat("is a ", TypeName(*v), ", not an array"));
  }
  return v;
}

absl::StatusOr<std::vector<int64_t>> GetDims(const Json& obj, const char* key,
                                             absl::string_view path, size_t max_len,
                                             const JsonContext& ctx) {
  STRATA_ASSIGN_OR_RETURN(const Json* arr, GetArray(obj, key, path, ctx));
  const std::string where = absl::StrCat(path, ".", key);
  if (arr->size() > max_len) {
    return FieldError(ctx, where,
                      absl::StrCat("has ", arr->size(), " entries, more than ", max_len));
  }
  std::vector<int64_t> out;
  out.reserve(arr->size());
  for (size_t i = 0; i < arr->size(); ++i) {
    STRATA_ASSIGN_OR_RETURN(int64_t d, AsInt((*arr)[i], absl::StrCat(where, "[", i, "]"), ctx));
    if (d < 0)
      return FieldError(ctx, absl::StrCat(where, "[", i, "]"),
                        absl::StrCat("is ", d, ", negative"));
    out.push_back(d);
  }
  return out;
}

absl::Status CheckKeys(const Json& obj, std::initializer_list<const char*> allowed,
                       absl::string_view path, const JsonContext& ctx) {
  for (auto it = obj.begin(); it != obj.end(); ++it) {
    bool known = false;
    for (const char* a : allowed) known = known || it.key() == a;
    if (!known) {
      return FieldError(ctx, path,
                        absl::StrCat("has an unknown field '", it.key(), "' (known: ",
                                     absl::StrJoin(allowed.begin(), allowed.end(), ", "), ")"));
    }
  }
  return absl::OkStatus();
}

}  // namespace strata::checkpoint_internal
