// Bindings for the pipeline runner (include/strata/parallel/pipeline/
// runner.h): strata._strata.pipeline._Runner, driven by
// python/strata/pipeline_exec.py.
//
// The runner walks this rank's list of actions in C++ with the GIL
// released, and calls back into Python for the stage's forward and
// backward and to allocate receive buffers. Tensors cross zero-copy: every
// tensor the runner holds came from Python (an output, a gradient, or a
// buffer the allocate callback made) as (tensor, address, dtype, shape),
// and the runner keeps the tensor object itself as the owner of the
// memory, handing the same objects back to the callbacks. A Python
// exception in a callback becomes the step's error (and its __cause__);
// the runner then fails the step on every rank as it does for any error.
#include <pybind11/stl.h>

#include <memory>
#include <optional>
#include <shared_mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "comm_access.h"
#include "registry.h"
#include "status_map.h"
#include "strata/parallel/pipeline/runner.h"
#include "strata/parallel/pipeline/schedule.h"

namespace py = pybind11;

namespace strata::bindings {
namespace {

using pipeline::BackwardCall;
using pipeline::ForwardCall;
using pipeline::ForwardResult;
using pipeline::StageTensor;
using pipeline::StepResult;
using pipeline::TensorList;
using pipeline::TensorSpec;

constexpr ErrorArea kArea = ErrorArea::kPipeline;

// A reference to a Python object that may be dropped on any thread, with
// or without the GIL: the runner releases tensors and contexts while the
// GIL is released.
struct PyRef {
  py::object object;
  ~PyRef() {
    if (!object) return;
    if (!Py_IsInitialized()) {
      object.release();  // the interpreter is gone; nothing to decrement
      return;
    }
    py::gil_scoped_acquire gil;
    object = py::object();
  }
};

std::shared_ptr<void> Hold(py::object o) {
  auto ref = std::make_shared<PyRef>();
  ref->object = std::move(o);
  return ref;
}

py::object Held(const std::shared_ptr<void>& owner) {
  if (owner == nullptr) return py::none();
  return static_cast<PyRef*>(owner.get())->object;
}

// (tensor, address, dtype name, shape) -> a StageTensor owning `tensor`.
StageTensor ToStageTensor(const py::handle& item) {
  py::tuple t = py::reinterpret_borrow<py::tuple>(item);
  if (!py::isinstance<py::tuple>(item) || t.size() != 4) {
    throw py::value_error("a stage tensor must be (tensor, address, dtype, shape)");
  }
  StageTensor out;
  absl::StatusOr<DataType> dtype = ParseDataType(t[2].cast<std::string>());
  if (!dtype.ok()) throw py::value_error(std::string(dtype.status().message()));
  out.spec.dtype = *dtype;
  out.spec.shape = t[3].cast<std::vector<int64_t>>();
  out.data = reinterpret_cast<void*>(t[1].cast<uintptr_t>());
  out.owner = Hold(py::reinterpret_borrow<py::object>(t[0]));
  return out;
}

TensorList ToTensorList(const py::handle& items) {
  TensorList out;
  for (py::handle item : items) out.push_back(ToStageTensor(item));
  return out;
}

py::list ToPython(const TensorList& tensors) {
  py::list out;
  for (const StageTensor& t : tensors) out.append(Held(t.owner));
  return out;
}

// One step's callbacks into Python. The first Python exception raised in a
// callback is kept, to become the cause of the step's error.
class Callbacks {
 public:
  Callbacks(py::object forward, py::object backward, py::object allocate)
      : forward_(std::move(forward)),
        backward_(std::move(backward)),
        allocate_(std::move(allocate)) {}

  pipeline::StageFunctions Functions() {
    pipeline::StageFunctions f;
    f.forward = [this](const ForwardCall& call) { return Forward(call); };
    f.backward = [this](const BackwardCall& call) { return Backward(call, "B"); };
    f.backward_input = [this](const BackwardCall& call) { return Backward(call, "I"); };
    f.backward_weight = [this](const BackwardCall& call) { return Backward(call, "W").status(); };
    return f;
  }

  absl::StatusOr<StageTensor> Allocate(const TensorSpec& spec) {
    py::gil_scoped_acquire gil;
    try {
      return ToStageTensor(allocate_(DataTypeName(spec.dtype), py::cast(spec.shape)));
    } catch (py::error_already_set& e) {
      return Caught(e);
    } catch (const std::exception& e) {
      return absl::InvalidArgumentError(absl::StrCat("the allocate callback: ", e.what()));
    }
  }

  // The exception a callback raised, if any.
  const std::optional<py::error_already_set>& exception() const { return exception_; }

 private:
  absl::StatusOr<ForwardResult> Forward(const ForwardCall& call) {
    py::gil_scoped_acquire gil;
    try {
      py::tuple r = forward_(call.stage, call.microbatch, ToPython(*call.inputs));
      ForwardResult out;
      out.outputs = ToTensorList(r[0]);
      if (!r[1].is_none()) out.loss = r[1].cast<double>();
      out.context = Hold(r[2]);
      return out;
    } catch (py::error_already_set& e) {
      return Caught(e);
    } catch (const std::exception& e) {
      return absl::InvalidArgumentError(absl::StrCat("the forward callback: ", e.what()));
    }
  }

  // `part`: "B" (the whole backward), "I" (input gradients) or "W" (weight
  // gradients, returning None).
  absl::StatusOr<TensorList> Backward(const BackwardCall& call, const char* part) {
    py::gil_scoped_acquire gil;
    try {
      py::object r = backward_(call.stage, call.microbatch, ToPython(*call.output_grads),
                               Held(*call.context), call.loss_scale, part);
      if (r.is_none()) return TensorList{};
      return ToTensorList(r);
    } catch (py::error_already_set& e) {
      return Caught(e);
    } catch (const std::exception& e) {
      return absl::InvalidArgumentError(absl::StrCat("the backward callback: ", e.what()));
    }
  }

  // "ValueError: boom", with the code of a strata error kept (a collective
  // that timed out inside a stage stays DEADLINE_EXCEEDED).
  absl::Status Caught(py::error_already_set& e) {
    absl::StatusCode code = absl::StatusCode::kUnknown;
    py::object value = e.value();
    if (py::hasattr(value, "code")) {
      const std::string name = py::str(value.attr("code"));
      for (int c = 1; c <= 16; ++c) {
        if (absl::StatusCodeToString(static_cast<absl::StatusCode>(c)) == name) {
          code = static_cast<absl::StatusCode>(c);
        }
      }
    }
    std::string message =
        absl::StrCat(py::str(py::type::of(value).attr("__name__")).cast<std::string>(), ": ",
                     py::str(value).cast<std::string>());
    if (!exception_) exception_ = std::move(e);
    return absl::Status(code, message);
  }

  py::object forward_, backward_, allocate_;
  std::optional<py::error_already_set> exception_;
};

// The runner holds the group's handle (following world rebuilds that keep
// its layout) and resolves it at each step, with the world's lock shared so
// that the world is neither rebuilt nor destroyed during the step.
class PyRunner {
 public:
  PyRunner(const pipeline::Schedule& schedule, py::handle group, double timeout, bool scale_grads)
      : group_(GroupRefOf(group)) {
    options_.timeout = absl::Seconds(timeout);
    options_.grad_scaling =
        scale_grads ? pipeline::GradScaling::kMean : pipeline::GradScaling::kSum;
    // Receive buffers come from Python (set per step, see Step).
    options_.allocate = [this](const TensorSpec& spec) -> absl::StatusOr<StageTensor> {
      return callbacks_->Allocate(spec);
    };
    absl::StatusOr<std::unique_ptr<pipeline::PipelineRunner>> runner;
    {
      py::gil_scoped_release release;  // resolving may create the group
      std::shared_lock<std::shared_mutex> lease(*group_.mu);
      runner = group_.alive()
                   ? pipeline::PipelineRunner::Create(schedule, group_.handle, options_)
                   : absl::FailedPreconditionError("the pipeline group's world was destroyed");
    }
    runner_ = Unwrap(std::move(runner), kArea);
  }

  StepResult Step(py::object forward, py::object backward, py::object allocate) {
    Callbacks callbacks(std::move(forward), std::move(backward), std::move(allocate));
    absl::StatusOr<StepResult> result;
    {
      py::gil_scoped_release release;
      std::shared_lock<std::shared_mutex> lease(*group_.mu);
      if (!group_.alive()) {
        result = absl::FailedPreconditionError(
            "the pipeline group's world was destroyed; create a new world and schedule");
      } else {
        callbacks_ = &callbacks;
        result = runner_->Step(callbacks.Functions());
        callbacks_ = nullptr;
      }
    }
    if (result.ok()) return std::move(result).value();
    const std::optional<py::error_already_set>& cause = callbacks.exception();
    if (cause && !cause->matches(PyExc_Exception)) {
      // KeyboardInterrupt, SystemExit: the step failed on every rank, and
      // the interrupt goes on as it was.
      py::error_already_set again = *cause;
      throw again;
    }
    try {
      RaiseStatus(result.status(), kArea);
    } catch (py::error_already_set& e) {
      if (cause) e.value().attr("__cause__") = cause->value();
      throw;
    }
  }

  const pipeline::Schedule& schedule() const { return runner_->schedule(); }
  int rank() const { return runner_->rank(); }

 private:
  GroupRef group_;
  pipeline::RunnerOptions options_;
  std::unique_ptr<pipeline::PipelineRunner> runner_;
  Callbacks* callbacks_ = nullptr;  // during a step
};

Registration reg(kOrderWorld + 1, [](py::module_& top) {
  py::module_ m = top.attr("pipeline").cast<py::module_>();

  py::class_<StepResult>(m, "StepStats", "What one pipeline step did on this rank.")
      .def_readonly("losses", &StepResult::losses,
                    "Per microbatch, on the rank of the last stage; empty elsewhere.")
      .def_readonly("peak_in_flight", &StepResult::peak_in_flight,
                    "The most activations this rank held at once.")
      .def_property_readonly(
          "start_time",
          [](const StepResult& r) { return absl::ToDoubleSeconds(r.start - absl::UnixEpoch()); },
          "When the step started, in seconds since the Unix epoch (time.time()'s clock): "
          "add it to `timings` to put the ranks of one host on one timeline.")
      .def_readonly("step_seconds", &StepResult::step_seconds)
      .def_readonly("busy_seconds", &StepResult::busy_seconds,
                    "Time spent in the stage's forward and backward.")
      .def_property_readonly("bubble_fraction",
                             [](const StepResult& r) {
                               return r.step_seconds > 0 ? 1.0 - r.busy_seconds / r.step_seconds
                                                         : 0.0;
                             })
      .def_property_readonly(
          "timings",
          [](const StepResult& r) {
            std::vector<std::tuple<std::string, double, double>> out;
            for (const pipeline::ComputeTiming& t : r.timings) {
              out.emplace_back(t.action.ToString(), t.start, t.end);
            }
            return out;
          },
          "(token, start, end) of each compute action, in seconds from "
          "the step's start.")
      .def("__repr__", [](const StepResult& r) {
        return absl::StrCat("StepStats(step_seconds=", r.step_seconds,
                            ", busy_seconds=", r.busy_seconds,
                            ", peak_in_flight=", r.peak_in_flight, ")");
      });

  py::class_<PyRunner>(m, "_Runner")
      .def(py::init<const pipeline::Schedule&, py::handle, double, bool>(), py::arg("schedule"),
           py::arg("group"), py::kw_only(), py::arg("timeout"), py::arg("scale_grads"))
      .def("step", &PyRunner::Step, py::arg("forward"), py::arg("backward"), py::arg("allocate"))
      .def_property_readonly("schedule", &PyRunner::schedule)
      .def_property_readonly("rank", &PyRunner::rank);
});

}  // namespace
}  // namespace strata::bindings
