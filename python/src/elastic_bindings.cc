// Bindings for the elastic loop (include/strata/elastic/elastic_loop.h):
// strata._ElasticLoop, which python/strata/elastic.py drives (run, recover,
// the optimizer's commit hook).
//
// The monitor thread calls the store (a torch TCPStore goes through Python
// callbacks that take the GIL), so every call that may wait for it, and the
// destructor (which joins the thread), releases the GIL. Recover takes the
// World's lock exclusively (it shrinks and rebuilds the World); the
// monitor's abort of the World goes around the lock (WorldRef::abort_all).
#include <pybind11/stl.h>

#include <map>
#include <memory>
#include <optional>
#include <shared_mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "comm_access.h"
#include "registry.h"
#include "status_map.h"
#include "store_handle.h"
#include "strata/elastic/elastic_loop.h"
#include "strata/elastic/membership.h"

namespace py = pybind11;

namespace strata::bindings {
namespace {

using elastic::ElasticLoop;
using elastic::ElasticOptions;

absl::Duration Seconds(const py::dict& d, const char* key, absl::Duration fallback) {
  if (!d.contains(key) || d[key].is_none()) return fallback;
  return absl::Seconds(d[key].cast<double>());
}

ElasticOptions OptionsFrom(const py::dict& d) {
  ElasticOptions o;
  if (d.contains("job") && !d["job"].is_none()) o.job = d["job"].cast<std::string>();
  o.heartbeat_interval = Seconds(d, "heartbeat_interval", o.heartbeat_interval);
  o.heartbeat_timeout = Seconds(d, "heartbeat_timeout", o.heartbeat_timeout);
  o.settle_timeout = Seconds(d, "settle_timeout", o.settle_timeout);
  o.decision_timeout = Seconds(d, "decision_timeout", o.decision_timeout);
  o.rebuild_timeout = Seconds(d, "rebuild_timeout", o.rebuild_timeout);
  o.commit_timeout = Seconds(d, "commit_timeout", o.commit_timeout);
  if (d.contains("probe_processes")) o.probe_processes = d["probe_processes"].cast<bool>();
  if (d.contains("fence_unresponsive")) o.fence_unresponsive = d["fence_unresponsive"].cast<bool>();
  if (d.contains("max_leader_takeovers"))
    o.max_leader_takeovers = d["max_leader_takeovers"].cast<int>();
  if (d.contains("max_attempts")) o.max_attempts = d["max_attempts"].cast<int>();
  if (d.contains("config") && !d["config"].is_none()) o.config = d["config"].cast<std::string>();
  if (d.contains("grow")) o.grow = d["grow"].cast<bool>();
  o.join_timeout = Seconds(d, "join_timeout", o.join_timeout);
  // Python's run() decides what a leaving rank does; the loop returns.
  o.leave = elastic::LeavePolicy::kReturn;
  return o;
}

py::dict MeshDict(const MeshSpec& s) {
  py::dict d;
  d["world_size"] = s.world_size;
  d["dp"] = s.dp;
  d["tp"] = s.tp;
  d["pp"] = s.pp;
  d["cp"] = s.cp;
  d["ep"] = s.ep;
  d["etp"] = s.etp;
  d["order"] = s.order;
  return d;
}

class PyElastic {
 public:
  PyElastic(py::handle world, std::optional<PyStore> store, std::optional<PyStore> monitor_store,
            const py::dict& options)
      : ref_(WorldRefOf(world)) {
    ElasticOptions o = OptionsFrom(options);
    std::shared_ptr<Store> s = store ? store->store : nullptr;
    elastic::ElasticHooks hooks;
    hooks.abort_all = ref_.abort_all;
    if (monitor_store) hooks.monitor_store = monitor_store->store;
    absl::StatusOr<std::unique_ptr<ElasticLoop>> loop;
    {
      py::gil_scoped_release release;
      std::shared_lock<std::shared_mutex> lock(*ref_.mu);
      if (!ref_.alive()) {
        loop = absl::FailedPreconditionError("the world was destroyed");
      } else {
        loop = ElasticLoop::Create(*ref_.world(), std::move(s), o, std::move(hooks));
      }
    }
    loop_ = Unwrap(std::move(loop), ErrorArea::kElastic);
  }

  // A joiner's loop, over `world` (the strata._World Join made).
  PyElastic(py::handle world, std::unique_ptr<ElasticLoop> loop)
      : ref_(WorldRefOf(world)), loop_(std::move(loop)) {
    loop_->SetAbortAll(ref_.abort_all);  // the World is the strata._World's now
  }

  ~PyElastic() { Stop(); }

  void Stop() {
    py::gil_scoped_release release;
    loop_.reset();
  }

  ElasticLoop& loop() {
    if (loop_ == nullptr) {
      RaiseStatus(absl::FailedPreconditionError("the elastic loop was stopped"),
                  ErrorArea::kElastic);
    }
    return *loop_;
  }

  void BeginStep(int64_t step) { ThrowIfError(loop().BeginStep(step), ErrorArea::kElastic); }

  bool Commit(int64_t step, bool ok) {
    ElasticLoop& l = loop();
    absl::StatusOr<bool> r;
    {
      py::gil_scoped_release release;
      r = l.Commit(step, ok);
    }
    return Unwrap(std::move(r), ErrorArea::kElastic);
  }

  void ReportFailure(const std::string& message) {
    ElasticLoop& l = loop();
    py::gil_scoped_release release;
    l.ReportFailure(absl::UnavailableError(message));
  }

  void RequestChange(const std::vector<int>& evict, const std::string& why, bool abort) {
    ElasticLoop& l = loop();
    absl::Status s;
    {
      py::gil_scoped_release release;
      s = l.RequestChange(evict, why, abort);
    }
    ThrowIfError(s, ErrorArea::kElastic);
  }

  // ("continue" | "leave", the event as JSON).
  py::tuple Recover() {
    return WithWorldLocked(&ElasticLoop::Recover, "the world was destroyed during the recovery");
  }

  // On a spare: waits until a recovery places it ("continue", the event),
  // the job finishes ("finished", "") or it must leave ("leave", the
  // event). The World's lock is held throughout: a spare's world has no
  // group anyone could use meanwhile.
  py::tuple StandBy() {
    return WithWorldLocked(&ElasticLoop::StandBy, "the world was destroyed while it stood by");
  }

  // Runs `step` (Recover or StandBy, which rebuild the World) without the
  // GIL and with the World's lock held exclusively; the outcome as a tuple.
  py::tuple WithWorldLocked(absl::StatusOr<ElasticLoop::Recovery> (ElasticLoop::*step)(),
                            const char* destroyed) {
    ElasticLoop& l = loop();
    absl::StatusOr<ElasticLoop::Recovery> r;
    {
      py::gil_scoped_release release;
      std::unique_lock<std::shared_mutex> lock(*ref_.mu);
      r = ref_.alive() ? (l.*step)() : absl::FailedPreconditionError(destroyed);
    }
    return Outcome(Unwrap(std::move(r), ErrorArea::kElastic));
  }

  bool JoinersWaiting() { return loop().joiners_waiting(); }

  void Admit(int64_t next_step) {
    ElasticLoop& l = loop();
    absl::Status s;
    {
      py::gil_scoped_release release;
      s = l.Admit(next_step);
    }
    ThrowIfError(s, ErrorArea::kElastic);
  }

  void Finish() {
    ElasticLoop& l = loop();
    absl::Status s;
    {
      py::gil_scoped_release release;
      s = l.Finish();
    }
    ThrowIfError(s, ErrorArea::kElastic);
  }

  static py::tuple Outcome(const ElasticLoop::Recovery& rec) {
    switch (rec.outcome) {
      case ElasticLoop::Outcome::kContinue:
        return py::make_tuple("continue", rec.event.ToJson());
      case ElasticLoop::Outcome::kLeave:
        return py::make_tuple("leave", rec.event.ToJson());
      case ElasticLoop::Outcome::kFinished:
        break;
    }
    return py::make_tuple("finished", "");
  }

  void RecordRestore(const std::string& restored_from) {
    loop().RecordRestore(absl::Now(), restored_from);
  }

  std::vector<std::string> Events() {
    std::vector<std::string> out;
    for (const elastic::RecoveryEvent& e : loop().events()) out.push_back(e.ToJson());
    return out;
  }

  py::dict Membership() {
    const elastic::Membership& m = loop().membership();
    py::dict d;
    d["epoch"] = m.epoch;
    d["members"] = m.members;
    d["spares"] = m.spares();
    d["full_dp"] = m.full_dp;
    d["joins_seen"] = m.joins_seen;
    d["mesh"] = MeshDict(m.mesh);
    d["describe"] = elastic::DescribeMesh(m.mesh);
    return d;
  }

 private:
  WorldRef ref_;
  std::unique_ptr<ElasticLoop> loop_;
};

// strata.elastic's joiner (STRATA_ELASTIC_JOIN): asks the job to admit this
// process and builds its World once admitted; (the loop, the strata._World).
py::tuple JoinElastic(std::optional<PyStore> store, std::optional<PyStore> monitor_store,
                      const py::dict& options, std::optional<double> timeout,
                      std::optional<double> group_timeout,
                      std::optional<std::map<std::string, std::string>> env,
                      std::optional<bool> trace, std::optional<std::string> trace_dir,
                      std::optional<size_t> trace_buffer, std::shared_ptr<observe::OpSink> sink) {
  elastic::JoinOptions join;
  join.world =
      InitWorldOptions(timeout, group_timeout, trace, trace_dir, trace_buffer, std::move(sink));
  join.env = Unwrap(env ? LaunchEnv::Detect(*env) : LaunchEnv::Detect(), ErrorArea::kLaunch);
  elastic::ElasticHooks hooks;
  if (monitor_store) hooks.monitor_store = monitor_store->store;
  const ElasticOptions o = OptionsFrom(options);  // with the GIL
  std::shared_ptr<Store> s = store ? store->store : nullptr;
  absl::StatusOr<elastic::Joined> joined;
  {
    py::gil_scoped_release release;
    joined = ElasticLoop::Join(std::move(s), o, std::move(join), std::move(hooks));
  }
  elastic::Joined j = Unwrap(std::move(joined), ErrorArea::kElastic);
  if (j.finished()) return py::make_tuple(py::none(), py::none());
  py::object world = WrapWorld(std::move(j.world));
  auto loop = std::make_unique<PyElastic>(world, std::move(j.loop));
  return py::make_tuple(py::cast(std::move(loop)), world);
}

Registration reg(kOrderElastic, [](py::module_& m) {
  py::class_<PyElastic>(m, "_ElasticLoop")
      .def(py::init<py::handle, std::optional<PyStore>, std::optional<PyStore>, const py::dict&>(),
           py::arg("world"), py::arg("store"), py::arg("monitor_store"), py::arg("options"))
      .def_property_readonly("rank", [](PyElastic& e) { return e.loop().rank(); })
      .def_property_readonly("membership", &PyElastic::Membership)
      .def_property_readonly("alarmed", [](PyElastic& e) { return e.loop().alarmed(); })
      .def("begin_step", &PyElastic::BeginStep, py::arg("step"))
      .def("commit", &PyElastic::Commit, py::arg("step"), py::arg("ok"))
      .def("report_failure", &PyElastic::ReportFailure, py::arg("message"))
      .def("request_change", &PyElastic::RequestChange, py::arg("evict"), py::arg("why"),
           py::arg("abort") = true)
      .def("recover", &PyElastic::Recover)
      .def("stand_by", &PyElastic::StandBy)
      .def("finish", &PyElastic::Finish)
      .def_property_readonly("joiners_waiting", &PyElastic::JoinersWaiting)
      .def("admit", &PyElastic::Admit, py::arg("next_step"))
      .def("record_restore", &PyElastic::RecordRestore, py::arg("restored_from"))
      .def("events", &PyElastic::Events)
      .def("stop", &PyElastic::Stop);
  m.def("_join_elastic", &JoinElastic, py::arg("store"), py::arg("monitor_store"),
        py::arg("options"), py::arg("timeout") = py::none(), py::arg("group_timeout") = py::none(),
        py::arg("env") = py::none(), py::arg("trace") = py::none(),
        py::arg("trace_dir") = py::none(), py::arg("trace_buffer") = py::none(),
        py::arg("sink") = py::none());
  m.def(
      "_elastic_plan_regroup",
      [](const Mesh& mesh, const std::vector<int>& failed) {
        elastic::RegroupPlan p = Unwrap(elastic::PlanRegroup(mesh, failed), ErrorArea::kElastic);
        py::dict d;
        d["failed"] = p.failed;
        d["leaving"] = p.leaving;
        d["survivors"] = p.survivors;
        d["mesh"] = MeshDict(p.new_mesh);
        return d;
      },
      py::arg("mesh"), py::arg("failed"),
      "PlanRegroup (strata/elastic/membership.h): who leaves and the mesh of the survivors.");
  m.def(
      "_elastic_probe_process",
      [](const std::string& process) {
        return Unwrap(elastic::ProbeHeartbeatProcess(process), ErrorArea::kElastic);
      },
      py::arg("process"),
      "ProbeHeartbeatProcess (strata/elastic/heartbeat.h): alive, stopped, gone or on another "
      "host.");
});

}  // namespace
}  // namespace strata::bindings
