// TensorSpec, StageTensor and the shape header of forward transfers.
#include "parallel/pipeline/internal/wire.h"

#include <cstddef>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace strata::pipeline {

int64_t TensorSpec::num_elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

size_t TensorSpec::num_bytes() const {
  return static_cast<size_t>(num_elements()) * DataTypeSize(dtype);
}

std::string TensorSpec::ToString() const {
  return absl::StrCat(DataTypeName(dtype), "[", absl::StrJoin(shape, ", "), "]");
}

StageTensor StageTensor::Host(TensorSpec spec) {
  StageTensor t;
  auto storage = std::make_shared<std::vector<std::byte>>(spec.num_bytes());
  t.data = storage->data();
  t.owner = std::move(storage);
  t.spec = std::move(spec);
  return t;
}

namespace internal {

absl::Status CheckSpec(const TensorSpec& spec) {
  if (spec.shape.size() > static_cast<size_t>(kMaxTensorDims)) {
    return absl::InvalidArgumentError(absl::StrCat("tensor ", spec.ToString(), " has ",
                                                   spec.shape.size(), " dims; at most ",
                                                   kMaxTensorDims, " are supported"));
  }
  int64_t n = 1;
  for (int64_t d : spec.shape) {
    if (d < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", spec.ToString(), " has a negative dim"));
    }
    if (d > 0 && n > kMaxElements / d) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", spec.ToString(), " has more than ", kMaxElements, " elements"));
    }
    n *= d;
  }
  return absl::OkStatus();
}

std::string SpecList(const std::vector<TensorSpec>& specs) {
  return absl::StrCat("[",
                      absl::StrJoin(specs, ", ",
                                    [](std::string* out, const TensorSpec& s) {
                                      absl::StrAppend(out, s.ToString());
                                    }),
                      "]");
}

std::vector<TensorSpec> SpecsOf(const TensorList& tensors) {
  std::vector<TensorSpec> out;
  out.reserve(tensors.size());
  for (const StageTensor& t : tensors) out.push_back(t.spec);
  return out;
}

std::vector<int64_t> EncodeHeader(const std::vector<TensorSpec>& specs) {
  std::vector<int64_t> h(kHeaderWords, 0);
  h[0] = kHeaderMagic;
  h[1] = static_cast<int64_t>(specs.size());
  for (size_t t = 0; t < specs.size(); ++t) {
    int64_t* w = &h[2 + t * kTensorWords];
    w[0] = static_cast<int64_t>(specs[t].dtype);
    w[1] = static_cast<int64_t>(specs[t].shape.size());
    for (size_t d = 0; d < specs[t].shape.size(); ++d) w[2 + d] = specs[t].shape[d];
  }
  return h;
}

absl::StatusOr<std::vector<TensorSpec>> DecodeHeader(const std::vector<int64_t>& h) {
  if (h.size() != kHeaderWords || h[0] != kHeaderMagic) {
    return absl::DataLossError(
        "the shape header does not start with strata's magic number "
        "(is the peer running the same schedule and strata version?)");
  }
  if (h[1] < 1 || h[1] > kMaxTransferTensors) {
    return absl::DataLossError(absl::StrCat("the shape header announces ", h[1],
                                            " tensors (want 1..", kMaxTransferTensors, ")"));
  }
  std::vector<TensorSpec> specs(h[1]);
  for (size_t t = 0; t < specs.size(); ++t) {
    const int64_t* w = &h[2 + t * kTensorWords];
    absl::StatusOr<DataType> dtype = DataTypeFromInt(static_cast<int>(w[0]));
    if (!dtype.ok() || w[0] < 0 || w[0] > 255) {
      return absl::DataLossError(absl::StrCat("the shape header names dtype ", w[0]));
    }
    if (w[1] < 0 || w[1] > kMaxTensorDims) {
      return absl::DataLossError(absl::StrCat("the shape header announces ", w[1], " dims"));
    }
    specs[t].dtype = *dtype;
    specs[t].shape.assign(w + 2, w + 2 + w[1]);
    if (absl::Status st = CheckSpec(specs[t]); !st.ok()) {
      return absl::DataLossError(absl::StrCat("the shape header is malformed: ", st.message()));
    }
  }
  return specs;
}

}  // namespace internal
}  // namespace strata::pipeline
