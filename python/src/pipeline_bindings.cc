// Bindings for pipeline schedules (include/strata/parallel/pipeline/): the
// submodule strata._strata.pipeline, wrapped by python/strata/pipeline.py.
// Errors raise strata.PipelineError.
#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "registry.h"
#include "status_map.h"
#include "strata/parallel/pipeline/generate.h"
#include "strata/parallel/pipeline/layout.h"
#include "strata/parallel/pipeline/schedule.h"
#include "strata/parallel/pipeline/simulate.h"
#include "strata/parallel/pipeline/validate.h"

namespace py = pybind11;

namespace strata::bindings {
namespace {

using pipeline::CostModel;
using pipeline::Schedule;
using pipeline::SimulationResult;
using pipeline::StageLayout;

constexpr ErrorArea kArea = ErrorArea::kPipeline;

// The cost keywords every simulating call takes.
CostModel Costs(const py::kwargs& kwargs) {
  CostModel c;
  for (auto item : kwargs) {
    const std::string key = py::cast<std::string>(item.first);
    py::handle v = item.second;
    if (key == "forward") {
      c.forward = py::cast<double>(v);
    } else if (key == "backward") {
      c.backward = py::cast<double>(v);
    } else if (key == "backward_input") {
      c.backward_input = py::cast<double>(v);
    } else if (key == "backward_weight") {
      c.backward_weight = py::cast<double>(v);
    } else if (key == "transfer") {
      c.transfer = py::cast<double>(v);
    } else if (key == "stage_scale") {
      if (!v.is_none()) c.stage_scale = py::cast<std::vector<double>>(v);
    } else {
      throw py::type_error(
          absl::StrCat("unexpected keyword argument '", key,
                       "' (costs are forward, backward, backward_input, backward_weight, transfer, "
                       "stage_scale)"));
    }
  }
  return c;
}

pipeline::CommModel Model(const std::string& name) {
  return Unwrap(pipeline::ParseCommModel(name), kArea);
}

pipeline::CommActions Communication(const std::string& name) {
  if (name == "auto") return pipeline::CommActions::kAuto;
  if (name == "required") return pipeline::CommActions::kRequired;
  if (name == "implied") return pipeline::CommActions::kImplied;
  RaiseStatus(absl::InvalidArgumentError(absl::StrCat("unknown communication '", name,
                                                      "' (expected auto, required or implied)")),
              kArea);
}

Schedule Generate(const std::string& kind, int num_ranks, int num_microbatches, int virtual_stages,
                  std::optional<int> group_size, bool compute_only, const py::kwargs& kwargs) {
  pipeline::ScheduleOptions o;
  o.kind = Unwrap(pipeline::ParseScheduleKind(kind), kArea);
  o.num_ranks = num_ranks;
  o.num_microbatches = num_microbatches;
  o.virtual_stages = virtual_stages;
  if (group_size && *group_size < 1) {
    RaiseStatus(absl::InvalidArgumentError(absl::StrCat("microbatch_group_size is ", *group_size,
                                                        "; want None (meaning p) or >= p")),
                kArea);
  }
  o.microbatch_group_size = group_size.value_or(0);
  o.costs = Costs(kwargs);
  return Unwrap(compute_only ? pipeline::GenerateComputeOrder(o) : pipeline::GenerateSchedule(o),
                kArea);
}

SimulationResult Simulate(const Schedule& s, const std::string& comm_model,
                          const py::kwargs& kwargs) {
  pipeline::SimulateOptions o;
  o.comm_model = Model(comm_model);
  o.costs = Costs(kwargs);
  return Unwrap(pipeline::SimulateSchedule(s, o), kArea);
}

std::string Grid(const Schedule& s, const SimulationResult& r, std::optional<double> unit,
                 double begin, std::optional<double> end) {
  pipeline::GridOptions g;
  g.unit = unit.value_or(0);
  g.begin = begin;
  g.end = end.value_or(-1);
  return pipeline::RenderGrid(s, r, g);
}

std::vector<std::string> Tokens(const Schedule& s, int rank) {
  if (rank < 0 || rank >= s.num_ranks()) {
    throw py::index_error(
        absl::StrCat("rank ", rank, " is not a rank of this ", s.num_ranks(), "-rank schedule"));
  }
  std::vector<std::string> out;
  for (const pipeline::Action& a : s.actions(rank)) out.push_back(a.ToString());
  return out;
}

Registration reg(kOrderParallel, [](py::module_& top) {
  py::module_ m = top.def_submodule("pipeline", "Pipeline schedules: generate, validate, simulate");

  py::class_<SimulationResult>(m, "SimulationResult",
                               "Makespan, per-rank busy time and bubble, peak activations.")
      .def_readonly("makespan", &SimulationResult::makespan)
      .def_readonly("busy", &SimulationResult::busy)
      .def_readonly("bubble_fraction", &SimulationResult::bubble_fraction)
      .def_readonly("peak_in_flight", &SimulationResult::peak_in_flight)
      .def_property_readonly("mean_bubble_fraction", &SimulationResult::mean_bubble_fraction)
      .def_property_readonly("timeline",
                             [](const SimulationResult& r) {
                               std::vector<std::vector<std::pair<double, double>>> out;
                               for (const auto& rank : r.timeline) {
                                 auto& row = out.emplace_back();
                                 for (const auto& t : rank) row.emplace_back(t.start, t.end);
                               }
                               return out;
                             })
      .def("__repr__", [](const SimulationResult& r) {
        return absl::StrCat("SimulationResult(makespan=", r.makespan,
                            ", mean_bubble_fraction=", r.mean_bubble_fraction(), ")");
      });

  py::class_<Schedule>(m, "Schedule", R"doc(
Per-rank action lists of one training step, in the text form
``<stage><F|B|I|W|SEND_F|RECV_F|SEND_B|RECV_B><microbatch>[>peer|<peer]``,
one line per rank. Build one with generate() or parse().
)doc")
      .def_property_readonly("num_ranks", &Schedule::num_ranks)
      .def_property_readonly("num_stages", &Schedule::num_stages)
      .def_property_readonly("num_microbatches", &Schedule::num_microbatches)
      .def_property_readonly("stage_ranks", &Schedule::stage_ranks)
      .def_property_readonly("name", &Schedule::name)
      .def_property_readonly("activation_limit", &Schedule::activation_limit)
      .def_property_readonly("has_communication", &Schedule::has_communication)
      .def("actions", &Tokens, py::arg("rank"), "The tokens of `rank`'s actions, in order.")
      .def("to_text", &Schedule::ToText, "One line per rank; parse() reads it back exactly.")
      .def("__str__", &Schedule::ToText)
      .def("__len__", &Schedule::size)
      .def("__eq__", [](const Schedule& a, const Schedule& b) { return a == b; })
      .def("__repr__",
           [](const Schedule& s) {
             return absl::StrCat("Schedule(", s.name().empty() ? "" : "'" + s.name() + "', ",
                                 "num_ranks=", s.num_ranks(), ", num_stages=", s.num_stages(),
                                 ", num_microbatches=", s.num_microbatches(), ")");
           })
      .def(
          "validate",
          [](const Schedule& s, const std::string& communication, const std::string& comm_model,
             std::optional<std::vector<int>> max_in_flight, int max_problems,
             const py::kwargs& kwargs) {
            pipeline::ValidateOptions o;
            o.communication = Communication(communication);
            o.comm_model = Model(comm_model);
            o.max_in_flight = max_in_flight.value_or(std::vector<int>{});
            o.max_problems = max_problems;
            o.costs = Costs(kwargs);
            ThrowIfError(pipeline::ValidateSchedule(s, o), kArea);
          },
          py::kw_only(), py::arg("communication") = "auto", py::arg("comm_model") = "rendezvous",
          py::arg("max_in_flight") = py::none(), py::arg("max_problems") = 10,
          "Raises PipelineError listing every problem (see docs/pipeline.md).")
      .def("simulate", &Simulate, py::kw_only(), py::arg("comm_model") = "async",
           "Simulates every rank; costs as keywords (forward=1, backward=1, ...).")
      .def(
          "grid",
          [](const Schedule& s, std::optional<double> unit, double begin, std::optional<double> end,
             const std::string& comm_model, const py::kwargs& kwargs) {
            return Grid(s, Simulate(s, comm_model, kwargs), unit, begin, end);
          },
          py::kw_only(), py::arg("unit") = py::none(), py::arg("begin") = 0.0,
          py::arg("end") = py::none(), py::arg("comm_model") = "async",
          "The rank x timestep grid of a simulation with the given costs.")
      .def("peak_in_flight", &pipeline::PeakInFlight,
           "Per rank: the most activations held at once.")
      .def(
          "insert_communication",
          [](const Schedule& s, const py::kwargs& kwargs) {
            pipeline::InsertOptions o;
            o.costs = Costs(kwargs);
            return Unwrap(pipeline::InsertCommunication(s, o), kArea);
          },
          "This compute order with SEND/RECV actions in a deadlock-free order.");

  m.def(
      "parse", [](const std::string& text) { return Unwrap(Schedule::Parse(text), kArea); },
      py::arg("text"), "Reads the text form (one line per rank).");
  m.def("generate", &Generate, py::arg("kind") = "1f1b", py::kw_only(), py::arg("num_ranks"),
        py::arg("num_microbatches"), py::arg("virtual_stages") = 1,
        py::arg("microbatch_group_size") = py::none(), py::arg("compute_only") = false,
        "A GPipe, 1F1B, interleaved-1F1B or ZB-H1 schedule (communication inserted unless "
        "compute_only).");
  m.def("render_grid", &Grid, py::arg("schedule"), py::arg("result"), py::kw_only(),
        py::arg("unit") = py::none(), py::arg("begin") = 0.0, py::arg("end") = py::none());

  py::class_<StageLayout>(m, "StageLayout", "Which layers each pipeline stage holds.")
      .def_static(
          "parse", [](const std::string& text) { return Unwrap(StageLayout::Parse(text), kArea); },
          py::arg("text"))
      .def_static(
          "from_counts",
          [](const std::vector<int>& counts) {
            return Unwrap(StageLayout::FromCounts(counts), kArea);
          },
          py::arg("layers_per_stage"))
      .def_static(
          "balanced",
          [](int num_layers, int num_stages, double embedding_weight, double loss_weight) {
            pipeline::BalancedLayoutOptions o;
            o.num_layers = num_layers;
            o.num_stages = num_stages;
            o.embedding_weight = embedding_weight;
            o.loss_weight = loss_weight;
            return Unwrap(StageLayout::Balanced(o), kArea);
          },
          py::kw_only(), py::arg("num_layers"), py::arg("num_stages"),
          py::arg("embedding_weight") = 0.0, py::arg("loss_weight") = 0.0)
      .def_property_readonly("num_stages", &StageLayout::num_stages)
      .def_property_readonly("num_layers", &StageLayout::num_layers)
      .def_property_readonly("layer_counts", &StageLayout::layer_counts)
      .def(
          "first_layer",
          [](const StageLayout& l, int stage) {
            if (stage < 0 || stage >= l.num_stages()) {
              throw py::index_error(absl::StrCat("stage ", stage, " is not a stage of this ",
                                                 l.num_stages(), "-stage layout"));
            }
            return l.first_layer(stage);
          },
          py::arg("stage"))
      .def("to_text", &StageLayout::ToText)
      .def("__str__", &StageLayout::ToText)
      .def("__eq__", [](const StageLayout& a, const StageLayout& b) { return a == b; })
      .def("describe", &StageLayout::Describe, py::arg("num_ranks"))
      .def(
          "stage_weights",
          [](const StageLayout& l, double layer, double embedding, double loss) {
            return l.StageWeights({layer, embedding, loss});
          },
          py::kw_only(), py::arg("layer") = 1.0, py::arg("embedding") = 0.0, py::arg("loss") = 0.0,
          "Per-stage cost scale, for stage_scale=.")
      .def(
          "check_fits",
          [](const StageLayout& l, const Schedule& s) {
            ThrowIfError(pipeline::CheckLayoutFits(l, s), kArea);
          },
          py::arg("schedule"))
      .def("__repr__",
           [](const StageLayout& l) { return absl::StrCat("StageLayout('", l.ToText(), "')"); });
});

}  // namespace
}  // namespace strata::bindings
