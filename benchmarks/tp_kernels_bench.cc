// The C++ tensor-parallel kernels on N ranks (tp = all of them), run by
// benchmarks/run_tp.py under mpirun: for each layer case,
// forward + backward of the kernel against its three local sgemm calls
// alone plus its collectives alone, interleaved in rounds. Rank 0 prints
// one JSON object: {"results": [{"case", "layer_ms", "gemm_ms", "comm_ms"}]}.
//
//   mpirun -np 4 tp_kernels_bench [--tokens 1024] [--hidden 512] [--ffn 2048] [--rounds 21]
//                                 [--backend gloo|mpi|auto]
//
// The Gloo backend bootstraps through $STRATA_STORE (e.g. file:/tmp/dir).
#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "strata/base/status.h"
#include "strata/comm/backend.h"
#include "strata/comm/launch_env.h"
#include "strata/parallel/tensor_parallel/linear.h"

namespace strata {
namespace {

struct Args {
  int64_t tokens = 1024, hidden = 512, ffn = 2048;
  int rounds = 21, iters = 2;
  std::string backend = "auto";
};

void Check(const absl::Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "tp_kernels_bench: %s: %s\n", what, std::string(s.message()).c_str());
    std::exit(1);
  }
}

std::vector<float> Random(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = u(gen);
  return v;
}

class Bench {
 public:
  explicit Bench(Communicator& comm) : comm_(comm) {}

  void Wait(absl::StatusOr<std::unique_ptr<Work>> w, const char* what) {
    Check(w.status(), what);
    Check((*w)->Wait(absl::Now() + absl::Minutes(2)), what);
  }
  void Barrier() { Wait(comm_.Barrier(), "barrier"); }
  // Seconds per call of fn, the slowest rank's.
  double Time(const std::function<void()>& fn, int iters) {
    Barrier();
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) fn();
    double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / iters;
    Wait(comm_.AllReduce(ConstBuffer(&s, 1, DataType::kFloat64), Buffer{&s, 1, DataType::kFloat64},
                         ReduceOp::kMax),
         "max");
    return s;
  }
  void AllReduce(std::vector<float>& v) {
    Wait(comm_.AllReduce(Buffer::Of(v.data(), v.size()), Buffer::Of(v.data(), v.size()),
                         ReduceOp::kSum),
         "allreduce");
  }
  void AllGather(const std::vector<float>& in, std::vector<float>& out) {
    Wait(comm_.AllGather(ConstBuffer(in.data(), in.size(), DataType::kFloat32),
                         Buffer::Of(out.data(), out.size())),
         "allgather");
  }
  void ReduceScatter(const std::vector<float>& in, std::vector<float>& out) {
    Wait(comm_.ReduceScatter(ConstBuffer(in.data(), in.size(), DataType::kFloat32),
                             Buffer::Of(out.data(), out.size()), ReduceOp::kSum),
         "reduce_scatter");
  }

 private:
  Communicator& comm_;
};

// out[m, n] = a[m, k] . b[n, k]^T; out[m, k] = dy[m, n] . w[n, k]; acc[n, k] += dy^T x.
void Gemms(int64_t m, int64_t n, int64_t k, const float* x, const float* w, const float* dy,
           float* out, float* dx, float* acc) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1, x, k, w, k, 0, out, n);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, k, n, 1, dy, n, w, k, 0, dx, k);
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, n, k, m, 1, dy, n, x, k, 1, acc, k);
}

int Main(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const long v = std::atol(argv[i + 1]);
    if (!std::strcmp(argv[i], "--backend"))
      a.backend = argv[i + 1];
    else if (!std::strcmp(argv[i], "--tokens"))
      a.tokens = v;
    else if (!std::strcmp(argv[i], "--hidden"))
      a.hidden = v;
    else if (!std::strcmp(argv[i], "--ffn"))
      a.ffn = v;
    else if (!std::strcmp(argv[i], "--rounds"))
      a.rounds = static_cast<int>(v);
    else {
      std::fprintf(stderr, "unknown option %s\n", argv[i]);
      return 2;
    }
  }
  absl::StatusOr<LaunchEnv> env = LaunchEnv::Detect();
  Check(env.status(), "launch environment");
  RootOptions options;
  options.backend = a.backend;
  options.comm.timeout = absl::Minutes(5);
  absl::StatusOr<std::unique_ptr<Communicator>> root = CreateRootCommunicator(*env, options);
  Check(root.status(), "root communicator");
  Communicator& tp = **root;
  Bench bench(tp);
  const int n = tp.size();
  const int64_t T = a.tokens, h = a.hidden, f = a.ffn;
  std::string json = "{\"results\": [";
  for (int c = 0; c < 4; ++c) {
    const bool column = c % 2 == 0, sp = c >= 2;
    LinearOptions o;
    o.in_features = column ? h : f;
    o.out_features = column ? f : h;
    o.sequence_parallel = sp;
    o.input_is_parallel = !column;
    std::unique_ptr<ColumnParallelLinear> col;
    std::unique_ptr<RowParallelLinear> row;
    if (column) {
      auto made = ColumnParallelLinear::Create(o, strata::GroupHandle::Fixed(&tp));
      Check(made.status(), "create");
      col = std::move(made).value();
    } else {
      auto made = RowParallelLinear::Create(o, strata::GroupHandle::Fixed(&tp));
      Check(made.status(), "create");
      row = std::move(made).value();
    }
    // Local GEMM dims: m tokens (all of them), n output and k input features.
    const int64_t m = T, gn = column ? f / n : h, gk = column ? h : f / n;
    const int64_t in_rows = column && sp ? T / n : T, out_rows = !column && sp ? T / n : T;
    const int64_t in_cols = gk, out_cols = gn;
    std::vector<float> x = Random(in_rows * in_cols, 1), w = Random(gn * gk, 2),
                       b = Random(column ? gn : h, 3), y(out_rows * out_cols),
                       dy = Random(out_rows * out_cols, 4), dx(in_rows * in_cols),
                       dw(gn * gk, 0.0f), db(b.size(), 0.0f);
    LinearForward fw{ConstMatrixRef::Of(x.data(), in_rows, in_cols),
                     ConstMatrixRef::Of(w.data(), gn, gk), b.data(),
                     MatrixRef::Of(y.data(), out_rows, out_cols)};
    LinearBackward bw{ConstMatrixRef::Of(dy.data(), out_rows, out_cols), fw.input,  fw.weight,
                      MatrixRef::Of(dx.data(), in_rows, in_cols),        dw.data(), db.data()};
    auto layer = [&] {
      Check(col ? col->Forward(fw) : row->Forward(fw), "forward");
      Check(col ? col->Backward(bw) : row->Backward(bw), "backward");
    };
    std::vector<float> gx = Random(m * gk, 5), gdy = Random(m * gn, 6), gout(m * gn), gdx(m * gk),
                       gacc(gn * gk, 0.0f);
    auto gemm = [&] {
      Gemms(m, gn, gk, gx.data(), w.data(), gdy.data(), gout.data(), gdx.data(), gacc.data());
    };
    // The layer's collectives on buffers of the same sizes.
    std::vector<float> full_in(T * gk), part_in(T / n * gk), full_out(T * gn), part_out(T / n * gn),
        full_dx(T * gk);
    auto comm = [&] {
      if (column && !sp) {
        bench.AllReduce(full_dx);
      } else if (column) {
        bench.AllGather(part_in, full_in);  // forward
        bench.AllGather(part_in, full_in);  // backward, for the weight gradient
        bench.ReduceScatter(full_dx, part_in);
      } else if (!sp) {
        bench.AllReduce(full_out);
      } else {
        bench.ReduceScatter(full_out, part_out);
        bench.AllGather(part_out, full_out);
      }
    };
    std::vector<std::function<void()>> fns = {layer, gemm, comm};
    for (auto& fn : fns) fn();  // warm up
    std::vector<std::vector<double>> samples(fns.size());
    for (int r = 0; r < a.rounds; ++r) {
      for (size_t i = 0; i < fns.size(); ++i) samples[i].push_back(bench.Time(fns[i], a.iters));
    }
    double med[3];
    for (size_t i = 0; i < fns.size(); ++i) {
      std::sort(samples[i].begin(), samples[i].end());
      med[i] = samples[i][samples[i].size() / 2] * 1e3;
    }
    char line[400];
    std::snprintf(line, sizeof(line),
                  "%s{\"case\": \"%s-parallel %ld->%ld%s\", \"layer_ms\": %.4f, \"gemm_ms\": "
                  "%.4f, \"comm_ms\": %.4f}",
                  c ? ", " : "", column ? "column" : "row", static_cast<long>(o.in_features),
                  static_cast<long>(o.out_features), sp ? ", sequence-parallel" : "", med[0],
                  med[1], med[2]);
    json += line;
  }
  json += "]}";
  if (tp.rank() == 0) std::printf("%s\n", json.c_str());
  return 0;
}

}  // namespace
}  // namespace strata

int main(int argc, char** argv) { return strata::Main(argc, argv); }
