// A small pipelined model for tests of the runner, with a plain-loop
// reference: shared by the in-process runner test (threads over a fake
// communicator) and the multi-rank test (processes over MPI).
//
// Stage s maps (h, g) to (a_s h + b_s, g + h), elementwise; h is fp64[n]
// and g fp64[1, n]. Stage 0 starts from h = x_i, g = 0; the loss is
// 0.5 * sum(h^2 + g^2) / n after the last stage. Microbatch i has
// n = 3 + i % 4 elements when shapes are variable, 4 otherwise.
//
//   TestModel model(num_stages), reference(num_stages);
//   StageFunctions fns = TestFunctions(&model, /*variable=*/true, /*split=*/false);
//   ...   // run a schedule with fns
//   for (int i = 0; i < m; ++i) Reference(reference, i, true, 1.0 / m);
//   // model.da / model.db now equal reference.da / reference.db
#pragma once

#include <vector>

#include "strata/parallel/pipeline/runner.h"

namespace strata::pipeline::testing {

struct TestModel {
  explicit TestModel(int stages);
  std::vector<double> a, b, da, db;
};

// Elements of microbatch `microbatch`.
int Length(int microbatch, bool variable);
// Element j of microbatch `microbatch`'s input.
double Input(int microbatch, int j);

// One microbatch through every stage and back, as a plain loop: adds the
// gradients (seeded with `scale`) to model.da / model.db; returns the loss.
double Reference(TestModel& model, int microbatch, bool variable, double scale);

// A zero-filled fp64 host tensor: [n], or [1, n] when `row`.
StageTensor Vector(int n, bool row);
double* Data(const StageTensor& t);

// The model's stage functions; with `split`, backward_input and
// backward_weight instead of backward. Gradients accumulate in `model`.
StageFunctions TestFunctions(TestModel* model, bool variable, bool split);

}  // namespace strata::pipeline::testing
