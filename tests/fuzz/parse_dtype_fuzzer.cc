// ParseDataType on arbitrary strings: never crashes, and every accepted name
// maps to a dtype whose short name parses back to the same dtype.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "strata/base/dtype.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string s(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<strata::DataType> t = strata::ParseDataType(s);
  if (t.ok()) {
    absl::StatusOr<strata::DataType> again = strata::ParseDataType(strata::DataTypeName(*t));
    if (!again.ok() || *again != *t) std::abort();
  }
  return 0;
}
