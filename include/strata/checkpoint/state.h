// TrainingState: the plain objects saved beside the tensors, enough to
// resume training exactly: step, optimizer step, learning-rate schedule,
// RNG states, data-loader position, the mesh and the library version.
//
// It is stored in the manifest as a versioned JSON blob. Fields holding JSON
// text (lr_schedule, data_loader, extra) must parse as JSON; "" means absent.
// RNG states are raw bytes (stored base64-encoded).
//
// Most fields are shared by all ranks and saved from rank 0. rng_states and
// data_loader are per rank: every rank saves its own and gets its own back
// (a rank absent from the checkpoint, after a change of world size, gets
// them empty).
//
//   strata::TrainingState st;
//   st.optimizer_step = 1200;
//   st.lr_schedule = R"({"last_epoch": 1200, "base_lrs": [0.0003]})";
//   st.rng_states["cpu"] = std::string(rng_bytes, rng_size);
//
// Thread-safety: plain values.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "absl/status/status.h"
#include "strata/base/export.h"
#include "strata/parallel/mesh.h"

namespace strata {

struct STRATA_EXPORT TrainingState {
  static constexpr int kVersion = 1;
  int version = kVersion;
  // The training step; on save it is set from the save's step.
  int64_t step = 0;
  // Optimizer steps taken (may differ from step with gradient accumulation);
  // -1 when not recorded.
  int64_t optimizer_step = -1;
  // Learning-rate schedule state (JSON text).
  std::string lr_schedule;
  // Anything else the trainer needs (JSON text); the Python API keeps the
  // structure of the saved state dict here.
  std::string extra;
  // The mesh the checkpoint was saved under.
  MeshSpec mesh;
  // The strata version that wrote the checkpoint (set on save).
  std::string library_version;

  // ---- per rank ----
  // RNG generator states by name ("cpu", "cuda:0", "python", ...).
  std::map<std::string, std::string> rng_states;
  // Data-loader position (JSON text).
  std::string data_loader;
};

// Deepest nesting accepted in the JSON-text fields.
inline constexpr int kMaxStateJsonDepth = 48;

// Checks the JSON-text fields parse (and nest at most kMaxStateJsonDepth
// levels) and the version is supported. InvalidArgument naming the field.
STRATA_EXPORT absl::Status ValidateTrainingState(const TrainingState& state);

}  // namespace strata
