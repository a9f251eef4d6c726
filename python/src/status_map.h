// The one mapper from absl::Status to the strata.Error hierarchy
// (python/strata/errors.py). Each binding names its area's exception;
// a status carrying the rank-failure payload becomes strata.RankFailure.
#pragma once

#include <pybind11/pybind11.h>

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace strata::bindings {

enum class ErrorArea {
  kGeneric,
  kLaunch,
  kMesh,
  kComm,
  kCheckpoint,
  kPipeline,
  kTopology,
  kElastic
};

// Raises the Python exception for a non-OK status (throws
// pybind11::error_already_set).
[[noreturn]] void RaiseStatus(const absl::Status& status, ErrorArea area);

inline void ThrowIfError(const absl::Status& status, ErrorArea area) {
  if (!status.ok()) RaiseStatus(status, area);
}

template <typename T>
T Unwrap(absl::StatusOr<T> value, ErrorArea area) {
  if (!value.ok()) RaiseStatus(value.status(), area);
  return std::move(value).value();
}

}  // namespace strata::bindings
