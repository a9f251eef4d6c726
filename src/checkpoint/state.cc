#include "strata/checkpoint/state.h"

#include "absl/strings/str_cat.h"
#include "checkpoint/internal/json_util.h"
#include "strata/base/status.h"

namespace strata {

absl::Status ValidateTrainingState(const TrainingState& state) {
  if (state.version != TrainingState::kVersion) {
    return absl::InvalidArgumentError(absl::StrCat("TrainingState version ", state.version,
                                                   " is not supported (this build writes version ",
                                                   TrainingState::kVersion, ")"));
  }
  if (state.optimizer_step < -1) {
    return absl::InvalidArgumentError(
        absl::StrCat("optimizer_step ", state.optimizer_step, " is negative (-1 means unset)"));
  }
  const std::pair<const char*, const std::string*> fields[] = {{"lr_schedule", &state.lr_schedule},
                                                               {"extra", &state.extra},
                                                               {"data_loader", &state.data_loader}};
  for (const auto& [name, text] : fields) {
    if (text->empty()) continue;
    const checkpoint_internal::JsonContext ctx{absl::StrCat("TrainingState.", name),
                                               absl::StatusCode::kInvalidArgument};
    STRATA_RETURN_IF_ERROR(
        checkpoint_internal::ParseJson(*text, uint64_t{1} << 30, kMaxStateJsonDepth, ctx).status());
  }
  return absl::OkStatus();
}

}  // namespace strata
