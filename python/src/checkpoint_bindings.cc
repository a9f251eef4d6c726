// Bindings for the checkpoint layer (see include/strata/checkpoint/). The
// Python API, with state-dict handling, lives in python/strata/checkpoint.py;
// these are its thin private building blocks. Tensors cross as raw data
// pointers (torch's data_ptr()): no copy before the one into staging.
//
// Groups cross as handles (comm_access.h), never as communicator pointers:
// the checkpoint layer resolves them at each call, so a checkpointer or a
// reader made before a world rebuild follows it, and each call holds the
// groups' owner locks (shared), so no world is rebuilt or destroyed under
// it.
#include <pybind11/stl.h>

#include <algorithm>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "comm_access.h"
#include "registry.h"
#include "status_map.h"
#include "strata/checkpoint/checkpointer.h"
#include "strata/checkpoint/loader.h"
#include "strata/checkpoint/replica_check.h"
#include "strata/checkpoint/safetensors.h"

namespace py = pybind11;

namespace strata::bindings {
namespace {

// (key, dtype, global_shape, local_shape, global_offset, replica_index,
//  replica_count, data_ptr, is_cuda)
using PyShard = std::tuple<std::string, int, std::vector<int64_t>, std::vector<int64_t>,
                           std::vector<int64_t>, int, int, uintptr_t, bool>;
// (key, dtype, global_shape, local_shape, global_offset, data_ptr)
using PyTarget = std::tuple<std::string, int, std::vector<int64_t>, std::vector<int64_t>,
                            std::vector<int64_t>, uintptr_t>;
// (key, dtype, shape, content digest)
using PyReplica = std::tuple<std::string, int, std::vector<int64_t>, uint64_t>;

[[noreturn]] void Raise(const absl::Status& s) { RaiseStatus(s, ErrorArea::kCheckpoint); }

absl::Duration Seconds(double s) { return absl::Seconds(s); }

absl::Time DeadlineIn(std::optional<double> seconds) {
  return seconds ? absl::Now() + absl::Seconds(*seconds) : absl::InfiniteFuture();
}

template <typename Enum>
Enum Choice(const std::string& value, const char* what,
            std::initializer_list<std::pair<const char*, Enum>> choices) {
  std::string known;
  for (const auto& [name, e] : choices) {
    if (value == name) return e;
    absl::StrAppend(&known, known.empty() ? "" : ", ", name);
  }
  Raise(absl::InvalidArgumentError(absl::StrCat(what, " '", value, "' is not one of: ", known)));
}

ShardedTensor ToShard(const std::string& key, int dtype, std::vector<int64_t> global,
                      std::vector<int64_t> local, std::vector<int64_t> offset) {
  ShardedTensor s;
  s.key = key;
  absl::StatusOr<DataType> t = DataTypeFromInt(dtype);
  if (!t.ok()) Raise(t.status());
  s.dtype = *t;
  s.global_shape = std::move(global);
  s.local_shape = std::move(local);
  s.global_offset = std::move(offset);
  return s;
}

// The groups of a checkpoint object or call. Add() (GIL held) gives the
// group's handle; Lease (GIL released) holds every group's owner lock
// shared for one call and fails when a group was destroyed.
class Groups {
 public:
  GroupHandle Add(py::handle group) {
    refs_.push_back(GroupRefOf(group));
    return refs_.back().handle;
  }
  bool empty() const { return refs_.empty(); }

  class Lease {
   public:
    explicit Lease(const Groups& groups) {
      std::vector<std::shared_mutex*> mus;
      for (const GroupRef& r : groups.refs_) mus.push_back(r.mu);
      std::sort(mus.begin(), mus.end());  // one lock per owner, in one order
      mus.erase(std::unique(mus.begin(), mus.end()), mus.end());
      for (std::shared_mutex* mu : mus) locks_.emplace_back(*mu);
      for (const GroupRef& r : groups.refs_) {
        if (!r.alive()) {
          status_ = absl::FailedPreconditionError(
              absl::StrCat("group '", r.handle.name(),
                           "' was destroyed (or its world was): the checkpoint "
                           "call cannot use it"));
          break;
        }
      }
    }
    const absl::Status& status() const { return status_; }

   private:
    std::vector<std::shared_lock<std::shared_mutex>> locks_;
    absl::Status status_;
  };

 private:
  std::vector<GroupRef> refs_;
};

// Warnings from the C++ side (background failures under on_failure="warn",
// retention problems) wait here until Python collects them: the writer
// thread never calls into Python.
struct WarnSink {
  std::mutex mu;
  std::vector<std::string> messages;  // guarded by mu
};

class PyCheckpointer {
 public:
  PyCheckpointer(const std::string& directory, int keep_last, const std::string& checksum,
                 uint64_t chunk_bytes, uint64_t max_file_bytes, const std::string& on_busy,
                 double busy_timeout, const std::string& on_failure, double commit_timeout,
                 int staging_threads, const std::string& io_priority,
                 std::optional<std::string> fail_at, py::object split_from, py::object test_hook)
      : sink_(std::make_shared<WarnSink>()) {
    CheckpointOptions o;
    o.directory = directory;
    // Multi-rank: a communicator of the checkpointer's own is split off the
    // group (collectively), again after each rebuild of the group's world.
    if (!split_from.is_none()) o.split_from = groups_.Add(split_from);
    o.keep_last = keep_last;
    absl::StatusOr<ChecksumAlgorithm> alg = ParseChecksumAlgorithm(checksum);
    if (!alg.ok()) Raise(alg.status());
    o.checksum = *alg;
    o.chunk_bytes = chunk_bytes;
    o.max_file_bytes = max_file_bytes;
    o.on_busy = Choice<BusyPolicy>(on_busy, "on_busy",
                                   {{"wait", BusyPolicy::kWait}, {"refuse", BusyPolicy::kRefuse}});
    o.busy_timeout = Seconds(busy_timeout);
    o.on_failure = Choice<FailurePolicy>(
        on_failure, "on_failure",
        {{"raise", FailurePolicy::kReturnError}, {"warn", FailurePolicy::kWarn}});
    o.commit_timeout = Seconds(commit_timeout);
    o.staging_threads = staging_threads;
    o.io_priority = Choice<IoPriority>(
        io_priority, "io_priority", {{"low", IoPriority::kLow}, {"normal", IoPriority::kNormal}});
    std::shared_ptr<WarnSink> sink = sink_;
    o.warn = [sink](const absl::Status& s) {
      std::lock_guard<std::mutex> l(sink->mu);
      sink->messages.emplace_back(s.message());
    };
    if (fail_at) {
      // Testing only: fail each save at the named point.
      const std::string point = *fail_at;
      o.test_hook = [point](absl::string_view p) {
        return p == point ? absl::InternalError(absl::StrCat("injected failure at ", p))
                          : absl::OkStatus();
      };
    } else if (!test_hook.is_none()) {
      // Testing only: test_hook(point) runs on the writer thread at each
      // named point (with the GIL); an exception fails the save there. The
      // callable is released with the GIL: the checkpointer may be
      // destroyed without it.
      std::shared_ptr<py::object> fn(new py::object(std::move(test_hook)), [](py::object* f) {
        if (Py_IsInitialized()) {
          py::gil_scoped_acquire gil;
          delete f;
        } else {
          f->release();
          delete f;
        }
      });
      o.test_hook = [fn](absl::string_view p) {
        py::gil_scoped_acquire gil;
        try {
          (*fn)(std::string(p));
        } catch (py::error_already_set& e) {
          return absl::InternalError(absl::StrCat("test_hook at ", p, ": ", e.what()));
        }
        return absl::OkStatus();
      };
    }
    absl::StatusOr<std::unique_ptr<Checkpointer>> c;
    {
      py::gil_scoped_release release;  // the split waits for the other ranks
      Groups::Lease lease(groups_);
      c = lease.status().ok() ? Checkpointer::Create(o) : lease.status();
    }
    if (!c.ok()) Raise(c.status());
    ckpt_ = std::move(*c);
  }

  ~PyCheckpointer() {
    // Waits for a save in flight: let other Python threads run meanwhile.
    py::gil_scoped_release release;
    ckpt_.reset();
  }

  void Save(int64_t step, const std::vector<PyShard>& shards, const py::dict& state,
            uintptr_t cuda_stream) {
    SaveRequest req;
    req.step = step;
    req.cuda_stream = reinterpret_cast<void*>(cuda_stream);
    req.tensors.reserve(shards.size());
    for (const PyShard& p : shards) {
      TensorData t;
      t.shard =
          ToShard(std::get<0>(p), std::get<1>(p), std::get<2>(p), std::get<3>(p), std::get<4>(p));
      t.shard.replica = {std::get<5>(p), std::get<6>(p)};
      t.data = reinterpret_cast<const void*>(std::get<7>(p));
      t.memory = std::get<8>(p) ? MemoryKind::kCuda : MemoryKind::kHost;
      req.tensors.push_back(std::move(t));
    }
    if (state.contains("optimizer_step"))
      req.state.optimizer_step = state["optimizer_step"].cast<int64_t>();
    if (state.contains("lr_schedule"))
      req.state.lr_schedule = state["lr_schedule"].cast<std::string>();
    if (state.contains("data_loader"))
      req.state.data_loader = state["data_loader"].cast<std::string>();
    if (state.contains("extra")) req.state.extra = state["extra"].cast<std::string>();
    if (state.contains("rng_states")) {
      for (auto item : state["rng_states"].cast<py::dict>()) {
        req.state.rng_states[item.first.cast<std::string>()] = item.second.cast<py::bytes>();
      }
    }
    if (state.contains("mesh") && !state["mesh"].is_none()) {
      py::dict m = state["mesh"].cast<py::dict>();
      req.state.mesh.world_size = m["world_size"].cast<int>();
      req.state.mesh.tp = m["tp"].cast<int>();
      req.state.mesh.pp = m["pp"].cast<int>();
      req.state.mesh.cp = m["cp"].cast<int>();
      req.state.mesh.ep = m["ep"].cast<int>();
      req.state.mesh.etp = m["etp"].cast<int>();
      req.state.mesh.dp = m["dp"].cast<int>();
      req.state.mesh.order = m["order"].cast<std::string>();
    }
    absl::Status s;
    {
      py::gil_scoped_release release;  // staging copies run without the GIL
      // Save resolves split_from (and splits again after a world rebuild).
      Groups::Lease lease(groups_);
      s = lease.status().ok() ? ckpt_->Save(req) : lease.status();
    }
    if (!s.ok()) Raise(s);
  }

  void Wait(std::optional<double> timeout) {
    absl::Status s;
    {
      py::gil_scoped_release release;
      s = ckpt_->Wait(DeadlineIn(timeout));
    }
    if (!s.ok()) Raise(s);
  }

  void Close(std::optional<double> timeout) {
    absl::Status s;
    {
      py::gil_scoped_release release;
      s = ckpt_->Close(DeadlineIn(timeout));
    }
    if (!s.ok()) Raise(s);
  }

  py::dict Status() const {
    const SaveStatus st = ckpt_->status();
    py::dict d;
    d["state"] = st.state == SaveStatus::State::kIdle      ? "idle"
                 : st.state == SaveStatus::State::kStaging ? "staging"
                                                           : "writing";
    d["step_in_flight"] =
        st.step_in_flight >= 0 ? py::object(py::int_(st.step_in_flight)) : py::none();
    d["last_committed_step"] =
        st.last_committed_step >= 0 ? py::object(py::int_(st.last_committed_step)) : py::none();
    d["pending_error"] = st.pending_error.ok()
                             ? py::object(py::none())
                             : py::object(py::str(std::string(st.pending_error.message())));
    d["staging_seconds"] = st.last.staging_seconds;
    d["write_seconds"] = st.last.write_seconds;
    d["commit_seconds"] = st.last.commit_seconds;
    d["bytes_written"] = st.last.bytes_written;
    d["files_written"] = st.last.files_written;
    d["last_step"] = st.last.step;
    d["staging_capacity"] = st.staging_capacity;
    d["staging_allocations"] = st.staging_allocations;
    return d;
  }

  std::vector<std::string> TakeWarnings() {
    std::lock_guard<std::mutex> l(sink_->mu);
    std::vector<std::string> out;
    out.swap(sink_->messages);
    return out;
  }

 private:
  Groups groups_;  // split_from, if any
  std::shared_ptr<WarnSink> sink_;
  std::unique_ptr<Checkpointer> ckpt_;
};

py::dict StateDict(const TrainingState& s) {
  py::dict d;
  d["step"] = s.step;
  d["optimizer_step"] = s.optimizer_step;
  d["lr_schedule"] = s.lr_schedule;
  d["data_loader"] = s.data_loader;
  d["extra"] = s.extra;
  d["library_version"] = s.library_version;
  py::dict rng;
  for (const auto& [k, v] : s.rng_states) rng[py::str(k)] = py::bytes(v);
  d["rng_states"] = rng;
  py::dict mesh;
  mesh["world_size"] = s.mesh.world_size;
  mesh["tp"] = s.mesh.tp;
  mesh["pp"] = s.mesh.pp;
  mesh["cp"] = s.mesh.cp;
  mesh["ep"] = s.mesh.ep;
  mesh["etp"] = s.mesh.etp;
  mesh["dp"] = s.mesh.dp;
  mesh["order"] = s.mesh.order;
  d["mesh"] = mesh;
  return d;
}

class PyReader {
 public:
  PyReader(const std::string& directory, int64_t step, bool verify, uint64_t read_buffer_bytes,
           py::object comm, double timeout, uint64_t merge_gap_bytes) {
    LoadOptions o;
    o.merge_gap_bytes = merge_gap_bytes;
    // Multi-rank: Open and Load are collective over the group, resolved at
    // each of them.
    if (!comm.is_none()) o.group = groups_.Add(comm);
    o.timeout = absl::Seconds(timeout);
    o.directory = directory;
    o.step = step;
    o.verify = verify ? ChecksumVerification::kVerify : ChecksumVerification::kSkip;
    o.matching = KeyMatching::kLenient;  // the Python layer applies strictness per entry
    o.read_buffer_bytes = read_buffer_bytes;
    absl::StatusOr<std::unique_ptr<CheckpointReader>> r;
    {
      py::gil_scoped_release release;
      Groups::Lease lease(groups_);
      r = lease.status().ok() ? CheckpointReader::Open(o) : lease.status();
    }
    if (!r.ok()) Raise(r.status());
    reader_ = std::move(*r);
  }

  int64_t step() const { return reader_->step(); }
  std::string step_directory() const { return reader_->step_directory(); }

  // [(key, dtype, shape)] sorted by key.
  std::vector<std::tuple<std::string, int, std::vector<int64_t>>> Tensors() const {
    std::vector<std::tuple<std::string, int, std::vector<int64_t>>> out;
    for (const ManifestTensor& t : reader_->manifest().tensors) {
      out.emplace_back(t.key, static_cast<int>(t.dtype), t.shape);
    }
    return out;
  }

  // {key: number of saved boxes}: 1 for a tensor saved whole.
  std::map<std::string, size_t> ShardCounts() const {
    std::map<std::string, size_t> out;
    for (const ManifestTensor& t : reader_->manifest().tensors) out[t.key] = t.shards.size();
    return out;
  }

  py::dict Info() const {
    const Manifest& m = reader_->manifest();
    py::dict d;
    d["step"] = m.step;
    d["created"] = m.created;
    d["library_version"] = m.library_version;
    d["world_size"] = m.world_size;
    d["checksum"] = ChecksumAlgorithmName(m.checksum);
    d["directory"] = reader_->step_directory();
    uint64_t bytes = 0;
    for (const ManifestFile& f : m.files) bytes += f.size;
    d["bytes"] = bytes;
    d["files"] = m.files.size();
    return d;
  }

  py::dict State(int rank) const { return StateDict(reader_->state(rank)); }

  py::dict Load(const std::vector<PyTarget>& targets) const {
    std::vector<TensorTarget> t;
    t.reserve(targets.size());
    for (const PyTarget& p : targets) {
      t.push_back(
          {ToShard(std::get<0>(p), std::get<1>(p), std::get<2>(p), std::get<3>(p), std::get<4>(p)),
           reinterpret_cast<void*>(std::get<5>(p))});
    }
    absl::StatusOr<LoadReport> r;
    {
      py::gil_scoped_release release;
      Groups::Lease lease(groups_);
      r = lease.status().ok() ? reader_->Load(t) : absl::StatusOr<LoadReport>(lease.status());
    }
    if (!r.ok()) Raise(r.status());
    py::dict d;
    d["step"] = r->step;
    d["missing"] = r->missing;
    d["unexpected"] = r->unexpected;
    d["bytes_read"] = r->bytes_read;
    d["bytes_verified"] = r->bytes_verified;
    d["files_opened"] = r->files_opened;
    return d;
  }

  std::vector<std::string> Verify() const {
    VerifyReport v;
    {
      py::gil_scoped_release release;
      v = VerifyCheckpoint(reader_->step_directory(), reader_->manifest());
    }
    std::vector<std::string> out;
    for (const absl::Status& s : v.problems) out.emplace_back(s.message());
    return out;
  }

 private:
  Groups groups_;  // the group of a collective load, if any
  std::unique_ptr<CheckpointReader> reader_;
};

class PySafetensorsFile {
 public:
  explicit PySafetensorsFile(const std::string& path) {
    absl::StatusOr<SafetensorsFile> f = SafetensorsFile::Open(path);
    if (!f.ok()) Raise(f.status());
    file_ = std::make_unique<SafetensorsFile>(std::move(*f));
  }
  // [(name, dtype, shape)] in file order.
  std::vector<std::tuple<std::string, int, std::vector<int64_t>>> Tensors() const {
    std::vector<std::tuple<std::string, int, std::vector<int64_t>>> out;
    for (const SafetensorsEntry& e : file_->header().entries) {
      out.emplace_back(e.name, static_cast<int>(e.dtype), e.shape);
    }
    return out;
  }
  std::map<std::string, std::string> Metadata() const {
    return {file_->header().metadata.begin(), file_->header().metadata.end()};
  }
  void Read(const std::string& name, uintptr_t ptr, uint64_t nbytes) const {
    absl::Status s;
    {
      py::gil_scoped_release release;
      s = file_->Read(name, reinterpret_cast<void*>(ptr), nbytes);
    }
    if (!s.ok()) Raise(s);
  }

 private:
  std::unique_ptr<SafetensorsFile> file_;
};

// Digests of host buffers [(data_ptr, nbytes)], without the GIL.
std::vector<uint64_t> Digests(const std::vector<std::pair<uintptr_t, uint64_t>>& buffers,
                              int threads) {
  std::vector<HostBytes> b;
  b.reserve(buffers.size());
  for (const auto& [ptr, n] : buffers) b.push_back({reinterpret_cast<const void*>(ptr), n});
  py::gil_scoped_release release;
  return ContentDigests(b, threads);
}

// Collective: `groups` is [(strata.Group, [PyReplica])], the same groups in
// the same order on every rank; `all` the group of every rank of the save.
void CheckReplicas(py::object all,
                   const std::vector<std::pair<py::object, std::vector<PyReplica>>>& groups,
                   int64_t step, double timeout) {
  Groups leased;
  std::vector<ReplicaGroup> g;
  g.reserve(groups.size());
  for (const auto& [group, tensors] : groups) {
    ReplicaGroup r;
    r.group = leased.Add(group);
    for (const PyReplica& t : tensors) {
      ReplicaDigest d;
      d.key = std::get<0>(t);
      absl::StatusOr<DataType> dt = DataTypeFromInt(std::get<1>(t));
      if (!dt.ok()) Raise(dt.status());
      d.dtype = *dt;
      d.shape = std::get<2>(t);
      d.content = std::get<3>(t);
      r.tensors.push_back(std::move(d));
    }
    g.push_back(std::move(r));
  }
  ReplicaCheckOptions o;
  o.all = leased.Add(all);
  o.deadline = absl::Now() + absl::Seconds(timeout);
  o.step = step;
  absl::Status s;
  {
    py::gil_scoped_release release;  // waits for the other ranks
    Groups::Lease lease(leased);
    s = lease.status().ok() ? CheckReplicasMatch(g, o) : lease.status();
  }
  if (!s.ok()) Raise(s);
}

Registration reg(kOrderCheckpoint, [](py::module_& m) {
  py::class_<PyCheckpointer>(m, "_Checkpointer",
                             "Private: see strata.checkpoint.AsyncCheckpointer.")
      .def(py::init<const std::string&, int, const std::string&, uint64_t, uint64_t,
                    const std::string&, double, const std::string&, double, int, const std::string&,
                    std::optional<std::string>, py::object, py::object>(),
           py::arg("directory"), py::kw_only(), py::arg("keep_last"), py::arg("checksum"),
           py::arg("chunk_bytes"), py::arg("max_file_bytes"), py::arg("on_busy"),
           py::arg("busy_timeout"), py::arg("on_failure"), py::arg("commit_timeout"),
           py::arg("staging_threads"), py::arg("io_priority"), py::arg("fail_at") = py::none(),
           py::arg("split_from") = py::none(), py::arg("test_hook") = py::none())
      .def("save", &PyCheckpointer::Save, py::arg("step"), py::arg("shards"), py::arg("state"),
           py::arg("cuda_stream") = 0)
      .def("wait", &PyCheckpointer::Wait, py::arg("timeout") = py::none())
      .def("close", &PyCheckpointer::Close, py::arg("timeout") = py::none())
      .def("status", &PyCheckpointer::Status)
      .def("take_warnings", &PyCheckpointer::TakeWarnings);

  py::class_<PyReader>(m, "_CheckpointReader", "Private: see strata.checkpoint.load.")
      .def(py::init<const std::string&, int64_t, bool, uint64_t, py::object, double, uint64_t>(),
           py::arg("directory"), py::kw_only(), py::arg("step"), py::arg("verify"),
           py::arg("read_buffer_bytes"), py::arg("comm") = py::none(), py::arg("timeout") = 600.0,
           py::arg("merge_gap_bytes") = uint64_t{256} << 10)
      .def_property_readonly("step", &PyReader::step)
      .def_property_readonly("step_directory", &PyReader::step_directory)
      .def("tensors", &PyReader::Tensors)
      .def("shard_counts", &PyReader::ShardCounts)
      .def("info", &PyReader::Info)
      .def("state", &PyReader::State, py::arg("rank") = 0)
      .def("load", &PyReader::Load, py::arg("targets"))
      .def("verify", &PyReader::Verify);

  py::class_<PySafetensorsFile>(m, "_SafetensorsFile",
                                "Private: see strata.checkpoint.load_safetensors.")
      .def(py::init<const std::string&>(), py::arg("path"))
      .def("tensors", &PySafetensorsFile::Tensors)
      .def("metadata", &PySafetensorsFile::Metadata)
      .def("read", &PySafetensorsFile::Read, py::arg("name"), py::arg("ptr"), py::arg("nbytes"));

  m.def("_content_digests", &Digests, py::arg("buffers"), py::arg("threads"),
        "Private: digests of host buffers [(data_ptr, nbytes)] (strata::ContentDigests).");
  m.def("_check_replicas", &CheckReplicas, py::arg("all"), py::arg("groups"), py::arg("step"),
        py::arg("timeout"), "Private: see strata::CheckReplicasMatch.");
  m.def(
      "_checkpoint_steps",
      [](const std::string& directory) {
        absl::StatusOr<std::vector<int64_t>> s = ListCheckpointSteps(directory);
        if (!s.ok()) Raise(s.status());
        return *s;
      },
      py::arg("directory"));
  m.def(
      "_latest_checkpoint_step",
      [](const std::string& directory) -> std::optional<int64_t> {
        absl::StatusOr<int64_t> s = LatestCheckpointStep(directory);
        if (absl::IsNotFound(s.status())) return std::nullopt;
        if (!s.ok()) Raise(s.status());
        return *s;
      },
      py::arg("directory"));
});

}  // namespace
}  // namespace strata::bindings
