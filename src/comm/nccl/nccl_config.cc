#include "comm/nccl/nccl_config.h"

#include <map>

#include "absl/strings/str_cat.h"
#include "strata/base/dtype.h"

namespace strata::nccl {
namespace {

// The first ncclConfig_t revision checked to carry each field: the struct is
// named after the release that last changed it (ncclConfig_v21400 has only
// `blocking`, v21700 adds cgaClusterSize..netName, v22700 ends at nvlsCTAs,
// v22800 adds nChannelsPerNetPeer and nvlinkCentricSched). splitShare came
// with ncclCommSplit (2.18). trafficClass, commName and collnetEnable are
// checked present in v22700 only, so 2.27 is a safe lower bound for them;
// an older runtime may know them, in which case the log line errs towards
// caution.
const std::map<std::string, NcclVersion>& SinceTable() {
  static const auto* table = new std::map<std::string, NcclVersion>{
      {"blocking", {2, 14, 0}},
      {"cgaClusterSize", {2, 17, 0}},
      {"minCTAs", {2, 17, 0}},
      {"maxCTAs", {2, 17, 0}},
      {"netName", {2, 17, 0}},
      {"splitShare", {2, 18, 0}},
      {"trafficClass", {2, 27, 0}},
      {"commName", {2, 27, 0}},
      {"collnetEnable", {2, 27, 0}},
      {"CTAPolicy", {2, 27, 0}},
      {"shrinkShare", {2, 27, 0}},
      {"nvlsCTAs", {2, 27, 0}},
      {"nChannelsPerNetPeer", {2, 28, 0}},
      {"nvlinkCentricSched", {2, 28, 0}},
  };
  return *table;
}

}  // namespace

NcclVersion ConfigFieldSince(const std::string& field) {
  auto it = SinceTable().find(field);
  return it == SinceTable().end() ? NcclVersion{2, 14, 0} : it->second;
}

NcclConfig::NcclConfig() : config_(NCCL_CONFIG_INITIALIZER) {}

NcclConfig::NcclConfig(const NcclConfig& other)
    : config_(other.config_),
      net_name_(other.net_name_),
      comm_name_(other.comm_name_),
      ignored_(other.ignored_) {
  Repoint();
}

NcclConfig& NcclConfig::operator=(const NcclConfig& other) {
  config_ = other.config_;
  net_name_ = other.net_name_;
  comm_name_ = other.comm_name_;
  ignored_ = other.ignored_;
  Repoint();
  return *this;
}

void NcclConfig::Repoint() {
  config_.netName = net_name_ ? net_name_->c_str() : NCCL_CONFIG_UNDEF_PTR;
  config_.commName = comm_name_ ? comm_name_->c_str() : NCCL_CONFIG_UNDEF_PTR;
}

NcclConfig BuildNcclConfig(const NcclConfigFields& fields, const ConfigOptions& options) {
  NcclConfig out;
  ncclConfig_t& c = out.config_;
  std::vector<std::string> set;
  auto put = [&](const char* name, const std::optional<int>& value, int* slot) {
    if (!value) return;
    *slot = *value;
    set.push_back(name);
  };
  put("cgaClusterSize", fields.cga_cluster_size, &c.cgaClusterSize);
  put("minCTAs", fields.min_ctas, &c.minCTAs);
  put("maxCTAs", fields.max_ctas, &c.maxCTAs);
  put("splitShare", fields.split_share, &c.splitShare);
  put("trafficClass", fields.traffic_class, &c.trafficClass);
  put("collnetEnable", fields.collnet_enable, &c.collnetEnable);
  put("CTAPolicy", fields.cta_policy, &c.CTAPolicy);
  put("shrinkShare", fields.shrink_share, &c.shrinkShare);
  put("nvlsCTAs", fields.nvls_ctas, &c.nvlsCTAs);
  put("nChannelsPerNetPeer", fields.n_channels_per_net_peer, &c.nChannelsPerNetPeer);
  put("nvlinkCentricSched", fields.nvlink_centric_sched, &c.nvlinkCentricSched);
  if (fields.net_name) {
    out.net_name_ = *fields.net_name;
    set.push_back("netName");
  }
  if (!options.comm_name.empty()) {
    out.comm_name_ = options.comm_name;
  } else if (fields.comm_name) {
    out.comm_name_ = *fields.comm_name;
  }
  if (out.comm_name_) set.push_back("commName");
  // strata's own choice wins over the profile's: its waits have deadlines
  // only when NCCL calls return instead of blocking.
  c.blocking = options.nonblocking ? 0 : 1;
  set.push_back("blocking");
  out.Repoint();
  for (const std::string& name : set) {
    const NcclVersion since = ConfigFieldSince(name);
    if (options.runtime < since) {
      out.ignored_.push_back(absl::StrCat(name, " (NCCL ", since.ToString(), ")"));
    }
  }
  return out;
}

absl::StatusOr<ncclDataType_t> ToNcclType(DataType dtype) {
  switch (dtype) {
    case DataType::kFloat32:
      return ncclFloat32;
    case DataType::kFloat64:
      return ncclFloat64;
    case DataType::kFloat16:
      return ncclFloat16;
    case DataType::kBFloat16:
      return ncclBfloat16;
    case DataType::kInt8:
      return ncclInt8;
    case DataType::kUInt8:
      return ncclUint8;
    case DataType::kInt32:
      return ncclInt32;
    case DataType::kInt64:
      return ncclInt64;
    case DataType::kBool:
      return ncclUint8;  // one byte, moved as such (never reduced)
    case DataType::kInt16:
      break;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("NCCL has no ", DataTypeName(dtype), " type: it can move ", DataTypeName(dtype),
                   " data but not reduce it (use int32, or float16/bfloat16 for 2-byte values)"));
}

bool NcclCanMove(DataType dtype) {
  // Every dtype moves as bytes when NCCL has no type of its own for it.
  return static_cast<int>(dtype) <= static_cast<int>(DataType::kBool);
}

bool NcclCanReduce(DataType dtype) {
  return dtype != DataType::kInt16 && dtype != DataType::kBool && NcclCanMove(dtype);
}

ncclRedOp_t ToNcclOp(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return ncclSum;
    case ReduceOp::kProd:
      return ncclProd;
    case ReduceOp::kMin:
      return ncclMin;
    case ReduceOp::kMax:
      return ncclMax;
    case ReduceOp::kAvg:
      return ncclAvg;
  }
  return ncclSum;
}

}  // namespace strata::nccl
