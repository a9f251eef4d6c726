// ncclConfig_t from the topology profile's NcclConfigFields, plus the
// mapping of strata's dtypes and reduction ops to NCCL's.
//
//   NcclConfig config = BuildNcclConfig(setup.config, {.nonblocking = true, .comm_name = "tp"});
//   api->CommSplit(parent, color, key, &child, config.get());
//
// The struct is laid out by the nccl.h strata is built with (2.28); NCCL
// reads `size` and `version` from it and ignores fields its own release does
// not know, so a newer header works with an older runtime. The fields that
// release cannot honour are listed in `ignored_by_runtime` for the log.
//
// Thread-safety: plain values.
#pragma once

#include <nccl.h>

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "strata/comm/communicator.h"
#include "strata/comm/nccl_profile.h"
#include "strata/comm/nccl_settings.h"

namespace strata::nccl {

struct ConfigOptions {
  // strata waits on its own deadlines, so its communicators are nonblocking
  // (blocking = 0) unless a caller asks otherwise.
  bool nonblocking = true;
  // ncclConfig_t::commName ("tp"); empty keeps the profile's.
  std::string comm_name;
  // The NCCL in use, to list fields it predates.
  NcclVersion runtime;
};

// An ncclConfig_t and the strings its pointers refer to. Copying keeps the
// pointers pointing at the copy's own strings.
class NcclConfig {
 public:
  NcclConfig();
  NcclConfig(const NcclConfig& other);
  NcclConfig& operator=(const NcclConfig& other);

  ncclConfig_t* get() { return &config_; }
  const ncclConfig_t& config() const { return config_; }
  // Fields set that the NCCL in use predates ("nvlinkCentricSched (NCCL
  // 2.28)"), for the log.
  const std::vector<std::string>& ignored_by_runtime() const { return ignored_; }

 private:
  friend NcclConfig BuildNcclConfig(const NcclConfigFields& fields, const ConfigOptions&);
  void Repoint();

  ncclConfig_t config_;
  std::optional<std::string> net_name_;
  std::optional<std::string> comm_name_;
  std::vector<std::string> ignored_;
};

// The config with every field of `fields` that is set; `options` override
// blocking and commName.
NcclConfig BuildNcclConfig(const NcclConfigFields& fields, const ConfigOptions& options);

// The NCCL release that introduced each settable config field (from NCCL's
// nccl.h history), keyed by the ncclConfig_t field name; unknown names: 2.14.
NcclVersion ConfigFieldSince(const std::string& field);

// strata dtype -> ncclDataType_t; InvalidArgument naming the dtype when
// NCCL has none (e.g. int16).
absl::StatusOr<ncclDataType_t> ToNcclType(DataType dtype);
// True when NCCL can move / reduce `dtype` (validate.h's Capabilities).
bool NcclCanMove(DataType dtype);
bool NcclCanReduce(DataType dtype);
// strata op -> ncclRedOp_t (avg is native since NCCL 2.10).
ncclRedOp_t ToNcclOp(ReduceOp op);

}  // namespace strata::nccl
