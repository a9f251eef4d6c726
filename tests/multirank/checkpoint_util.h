// Helpers of the multi-rank checkpoint tests: a scratch directory shared by
// the ranks, reference values of global tensors, and a small transformer-
// like model laid out on a mesh (tensor-parallel weights, replicated norms,
// per-layer tensors on their pipeline stage, Adam-like optimizer states).
#pragma once

#include <stdlib.h>

#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "checkpoint/internal/file_util.h"
#include "strata/checkpoint/reshard.h"
#include "strata/checkpoint/sharded_tensor.h"
#include "strata/comm/communicator.h"
#include "strata/parallel/mesh.h"

namespace strata::testing {

inline absl::Status WaitFor(absl::StatusOr<std::unique_ptr<Work>> w) {
  if (!w.ok()) return w.status();
  return (*w)->Wait(absl::Now() + absl::Seconds(120));
}

// A directory made by rank 0 and known to every rank; removed by rank 0
// after every rank is done with it.
class SharedDir {
 public:
  explicit SharedDir(Communicator& comm) : comm_(comm) {
    char path[256] = {};
    if (comm.rank() == 0) {
      const char* base = getenv("TEST_TMPDIR");
      std::string tmpl = std::string(base != nullptr ? base : "/tmp") + "/strata-mr-XXXXXX";
      std::strncpy(path, tmpl.c_str(), sizeof(path) - 1);
      if (mkdtemp(path) == nullptr) path[0] = '\0';
    }
    absl::Status s = WaitFor(comm.Broadcast(Buffer{path, sizeof(path), DataType::kUInt8}, 0));
    if (s.ok()) path_ = path;
  }
  ~SharedDir() {
    (void)WaitFor(comm_.Barrier());
    if (comm_.rank() == 0 && !path_.empty()) (void)checkpoint_internal::RemoveTree(path_);
  }
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  Communicator& comm_;
  std::string path_;
};

// The bytes of a whole tensor: a function of its key only, every bit
// pattern possible (NaN payloads, -0).
inline std::vector<uint8_t> GlobalBytes(const ShardedTensor& s) {
  const uint64_t n = static_cast<uint64_t>(s.global_elements()) * DataTypeSize(s.dtype);
  std::mt19937 gen(static_cast<uint32_t>(std::hash<std::string>{}(s.key)));
  std::vector<uint8_t> out(n);
  for (auto& b : out) b = static_cast<uint8_t>(gen());
  if (s.dtype == DataType::kBool) {
    for (auto& b : out) b &= 1;
  }
  return out;
}

// The bytes of the box `s` holds, cut from GlobalBytes.
inline std::vector<uint8_t> BoxBytes(const ShardedTensor& s) {
  const std::vector<uint8_t> whole = GlobalBytes(s);
  std::vector<uint8_t> out(s.local_bytes());
  TensorBox all{std::vector<int64_t>(s.global_shape.size(), 0), s.global_shape};
  auto plan = PlanReshard(s.dtype, s.global_shape, {all}, {s.global_offset, s.local_shape});
  if (plan.ok()) {
    const void* src = whole.data();
    ApplyCopySegments(*plan, absl::MakeConstSpan(&src, 1), out.data());
  }
  return out;
}

// A model on a mesh: `layers` layers split evenly over the pipeline stages,
// each with a column-parallel weight [16, 8] (split on dim 0 by tp), a
// row-parallel weight [8, 16] (split on dim 1), a norm [8] replicated over
// tp; an embedding [32, 8] on the first stage (vocab split by tp) and a
// head [8] on the last; for every weight an "exp_avg" of the same layout.
// Boxes are replicated over dp (and tp where not split).
struct ModelLayout {
  int layers = 4;
  DataType dtype = DataType::kFloat32;

  std::vector<ShardedTensor> Shards(const Mesh& mesh, int rank) const {
    const std::map<std::string, int> c = *mesh.Coords(rank);
    const int tp = c.at("tp"), dp = c.at("dp"), pp = c.at("pp");
    const int per_stage = layers / mesh.pp();
    std::vector<ShardedTensor> out;
    // split_dim < 0: replicated over tp.
    auto add = [&](const std::string& key, std::vector<int64_t> shape, int split_dim) {
      for (const char* suffix : {"", ".exp_avg"}) {
        ShardedTensor s = ShardedTensor::Whole(key + suffix, dtype, shape);
        if (split_dim >= 0) {
          s.local_shape[split_dim] = shape[split_dim] / mesh.tp();
          s.global_offset[split_dim] = s.local_shape[split_dim] * tp;
          s.replica = {dp, mesh.dp()};
        } else {
          s.replica = {tp + mesh.tp() * dp, mesh.tp() * mesh.dp()};
        }
        out.push_back(std::move(s));
      }
    };
    for (int l = pp * per_stage; l < (pp + 1) * per_stage; ++l) {
      const std::string p = absl::StrCat("layers.", l, ".");
      add(p + "col.weight", {16, 8}, 0);
      add(p + "row.weight", {8, 16}, 1);
      add(p + "norm.weight", {8}, -1);
    }
    if (pp == 0) add("embed.weight", {32, 8}, 0);
    if (pp == mesh.pp() - 1) add("head.bias", {8}, -1);
    return out;
  }
};

inline Mesh MakeMesh(int world, int tp, int pp) {
  MeshSpec spec;
  spec.world_size = world;
  spec.tp = tp;
  spec.pp = pp;
  return *Mesh::Create(spec);
}

}  // namespace strata::testing
