// Root options completed from strata's settings (internal): what
// CreateRootCommunicator hands its backend, from its one reading of the
// STRATA_* variables (strata/base/settings.h). Two readers stay in the Gloo
// backend, because no option reaches them: the plugin loader
// (STRATA_GLOO_PLUGIN, STRATA_GLOO_DEEPBIND; gloo_loader.h) and the plugin's
// STRATA_GLOO_CMA (gloo_plugin.cc).
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "strata/base/settings.h"
#include "strata/comm/backend.h"

namespace strata::comm_internal {

// `options` with what the settings say filled in where the caller left it
// to the environment: MpiOptions::oversubscribed (STRATA_OVERSUBSCRIBED);
// NcclOptions::apply_profile is off when either says so
// (STRATA_NCCL_PROFILE).
RootOptions ResolveRootOptions(RootOptions options, const Settings& settings);

// The store of `options`, else the one STRATA_STORE names (errors say so),
// else null.
absl::StatusOr<std::shared_ptr<Store>> ResolveStore(const RootOptions& options,
                                                    const Settings& settings);

}  // namespace strata::comm_internal
