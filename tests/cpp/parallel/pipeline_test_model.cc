// The test model of pipeline_test_model.h.
#include "pipeline_test_model.h"

#include <cmath>
#include <memory>

namespace strata::pipeline::testing {

TestModel::TestModel(int stages) : a(stages), b(stages), da(stages, 0.0), db(stages, 0.0) {
  for (int s = 0; s < stages; ++s) {
    a[s] = 0.9 + 0.05 * s;
    b[s] = 0.1 * (s + 1);
  }
}

// Variable lengths come in pairs (3 3 4 4 5 5 3 3 ...), so transfers repeat
// the last shapes, change after a repeat, and change after a change: the
// runner's three cases of shape exchange.
int Length(int microbatch, bool variable) { return variable ? 3 + (microbatch / 2) % 3 : 4; }

double Input(int microbatch, int j) { return std::sin(7.0 * microbatch + j); }

double Reference(TestModel& model, int microbatch, bool variable, double scale) {
  const int n = Length(microbatch, variable), stages = static_cast<int>(model.a.size());
  std::vector<std::vector<double>> h(stages + 1, std::vector<double>(n)), g = h;
  for (int j = 0; j < n; ++j) h[0][j] = Input(microbatch, j);
  for (int s = 0; s < stages; ++s) {
    for (int j = 0; j < n; ++j) {
      h[s + 1][j] = model.a[s] * h[s][j] + model.b[s];
      g[s + 1][j] = g[s][j] + h[s][j];
    }
  }
  double loss = 0;
  std::vector<double> dh(n), dg(n);
  for (int j = 0; j < n; ++j) {
    loss += 0.5 * (h[stages][j] * h[stages][j] + g[stages][j] * g[stages][j]) / n;
    dh[j] = scale * h[stages][j] / n;
    dg[j] = scale * g[stages][j] / n;
  }
  for (int s = stages - 1; s >= 0; --s) {
    for (int j = 0; j < n; ++j) {
      model.da[s] += dh[j] * h[s][j];
      model.db[s] += dh[j];
      dh[j] = model.a[s] * dh[j] + dg[j];
    }
  }
  return loss;
}

double* Data(const StageTensor& t) { return static_cast<double*>(t.data); }

StageTensor Vector(int n, bool row) {
  TensorSpec spec{DataType::kFloat64, row ? std::vector<int64_t>{1, n} : std::vector<int64_t>{n}};
  return StageTensor::Host(spec);
}

// Stage 0 keeps its input in the context, since it receives none.
StageFunctions TestFunctions(TestModel* model, bool variable, bool split) {
  const int stages = static_cast<int>(model->a.size());
  StageFunctions f;
  f.forward = [=](const ForwardCall& call) -> absl::StatusOr<ForwardResult> {
    const int s = call.stage;
    TensorList in = *call.inputs;
    if (s == 0) {
      const int n = Length(call.microbatch, variable);
      in = {Vector(n, false), Vector(n, true)};
      for (int j = 0; j < n; ++j) Data(in[0])[j] = Input(call.microbatch, j);
    }
    const int n = static_cast<int>(in[0].spec.num_elements());
    ForwardResult out;
    out.outputs = {Vector(n, false), Vector(n, true)};
    for (int j = 0; j < n; ++j) {
      Data(out.outputs[0])[j] = model->a[s] * Data(in[0])[j] + model->b[s];
      Data(out.outputs[1])[j] = Data(in[1])[j] + Data(in[0])[j];
    }
    if (s == stages - 1) {
      double loss = 0;
      for (int j = 0; j < n; ++j) {
        loss += 0.5 *
                (Data(out.outputs[0])[j] * Data(out.outputs[0])[j] +
                 Data(out.outputs[1])[j] * Data(out.outputs[1])[j]) /
                n;
      }
      out.loss = loss;
    }
    if (s == 0) out.context = std::make_shared<TensorList>(in);
    return out;
  };
  // The output gradients (seeded from the loss on the last stage).
  auto grads_of = [=](const BackwardCall& call) {
    if (call.stage < stages - 1) return *call.output_grads;
    const int n = static_cast<int>((*call.outputs)[0].spec.num_elements());
    TensorList d = {Vector(n, false), Vector(n, true)};
    for (int k = 0; k < 2; ++k) {
      for (int j = 0; j < n; ++j) Data(d[k])[j] = call.loss_scale * Data((*call.outputs)[k])[j] / n;
    }
    return d;
  };
  auto inputs_of = [](const BackwardCall& call) {
    return call.stage == 0 ? *std::static_pointer_cast<TensorList>(*call.context) : *call.inputs;
  };
  auto weight = [=](const BackwardCall& call) {
    const TensorList d = grads_of(call), in = inputs_of(call);
    for (int64_t j = 0; j < d[0].spec.num_elements(); ++j) {
      model->da[call.stage] += Data(d[0])[j] * Data(in[0])[j];
      model->db[call.stage] += Data(d[0])[j];
    }
    return absl::OkStatus();
  };
  auto input = [=](const BackwardCall& call) -> absl::StatusOr<TensorList> {
    if (call.stage == 0) return TensorList{};
    const TensorList d = grads_of(call);
    const int n = static_cast<int>(d[0].spec.num_elements());
    TensorList out = {Vector(n, false), Vector(n, true)};
    for (int j = 0; j < n; ++j) {
      Data(out[0])[j] = model->a[call.stage] * Data(d[0])[j] + Data(d[1])[j];
      Data(out[1])[j] = Data(d[1])[j];
    }
    return out;
  };
  if (split) {
    f.backward_input = input;
    f.backward_weight = weight;
  } else {
    f.backward = [=](const BackwardCall& call) -> absl::StatusOr<TensorList> {
      (void)weight(call);
      return input(call);
    };
  }
  return f;
}

}  // namespace strata::pipeline::testing
