#include "status_map.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace strata::bindings {

namespace {

// What happened decides first, the area second (python/strata/errors.py):
// a failed peer, a passed deadline, an aborted communicator and misuse are
// the same error wherever they surface.
const char* ExceptionName(const absl::Status& status, ErrorArea area) {
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
      break;
    default:
      break;
  }
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
    case ErrorArea::kGeneric:
      break;
  }
  return status.code() == absl::StatusCode::kInvalidArgument ? "InvalidArgument" : "Error";
}

}  // namespace

void RaiseStatus(const absl::Status& status, ErrorArea area) {
  pybind11::object errors = pybind11::module_::import("strata.errors");
  pybind11::object type = errors.attr(ExceptionName(status, area));
  std::string message(status.message());
  pybind11::object exc = type(message);
  exc.attr("code") = std::string(absl::StatusCodeToString(status.code()));
  PyErr_SetObject(type.ptr(), exc.ptr());
  throw pybind11::error_already_set();
}

}  // namespace strata::bindings
