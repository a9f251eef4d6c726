#include "status_map.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace strata::bindings {

namespace {

// The exception for what happened, wherever it surfaced
// (python/strata/errors.py): a failed peer, a passed deadline, an aborted
// communicator, misuse of a communicator. Null when the area decides.
const char* KindName(const absl::Status& status, ErrorArea area) {
  // Payload set by the communication layer when a peer rank has failed.
  if (status.GetPayload("strata/rank-failure").has_value()) return "RankFailure";
  switch (status.code()) {
    case absl::StatusCode::kDeadlineExceeded:
      return "TimeoutError";
    case absl::StatusCode::kAborted:
      return "Aborted";
    case absl::StatusCode::kInvalidArgument:
      // Misuse of a communicator is a ValueError, not a communication
      // failure; the other areas name their own misuse (CheckpointError,
      // LaunchError, ... with code INVALID_ARGUMENT).
      if (area == ErrorArea::kComm || area == ErrorArea::kGeneric) return "InvalidArgument";
      return nullptr;
    default:
      return nullptr;
  }
}

// The exception of the area the error surfaced in; null for none.
const char* AreaName(ErrorArea area) {
  switch (area) {
    case ErrorArea::kLaunch:
      return "LaunchError";
    case ErrorArea::kMesh:
      return "MeshError";
    case ErrorArea::kComm:
      return "CommError";
    case ErrorArea::kCheckpoint:
      return "CheckpointError";
    case ErrorArea::kPipeline:
      return "PipelineError";
    case ErrorArea::kTopology:
      return "TopologyError";
    case ErrorArea::kElastic:
      return "ElasticError";
    case ErrorArea::kGeneric:
      break;
  }
  return nullptr;
}

}  // namespace

void RaiseStatus(const absl::Status& status, ErrorArea area) {
  pybind11::object errors = pybind11::module_::import("strata.errors");
  const char* kind = KindName(status, area);
  const char* where = AreaName(area);
  pybind11::object type;
  if (kind != nullptr && where != nullptr) {
    // Both: a timed-out checkpoint agreement is a strata.TimeoutError that
    // `except strata.CheckpointError` also catches.
    type = errors.attr("_error_class")(errors.attr(kind), errors.attr(where));
  } else if (kind != nullptr || where != nullptr) {
    type = errors.attr(kind != nullptr ? kind : where);
  } else {
    type = errors.attr(status.code() == absl::StatusCode::kInvalidArgument ? "InvalidArgument"
                                                                           : "Error");
  }
  std::string message(status.message());
  pybind11::object exc = type(message);
  exc.attr("code") = std::string(absl::StatusCodeToString(status.code()));
  PyErr_SetObject(type.ptr(), exc.ptr());
  throw pybind11::error_already_set();
}

}  // namespace strata::bindings
