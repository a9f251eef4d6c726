// The tensor-parallel linear kernels on CUDA memory (cuBLASLt, bias in the
// epilogue, fp32 main-gradient accumulation), run by benchmarks/run_tp_gpu.py
// on a machine with GPUs. Two modes, by the size of the job:
//
//   tp_gpu_bench [options]                      one process, one GPU
//     For the column- and row-parallel kernel at their local shapes (the
//     shard of one rank of a tp = --shards layer), the time of forward and
//     of forward + backward; the driver times torch.matmul on the same
//     shapes in the same run (the peer) and reports throughput ratios.
//   mpirun -np N tp_gpu_bench [options]         N >= 2 ranks, a GPU each
//     tp = N over NCCL: each layer's forward + backward against its parts
//     measured alone, i.e. the same kernels on a group of one rank (the
//     GEMMs without communication) plus the layer's collectives alone. With
//     the input-gradient collective overlapped with the weight-gradient
//     GEMM the layer takes less than the sum (< 1.0x).
//
// Options: --tokens 8192 --hidden 4096 --ffn 16384 --shards 8 --dtype bf16
// (or fp16) --iters 20 --rounds 9. Rank 0 prints one JSON object on its
// last line: {"gpu": false, "reason"} without a usable GPU (exit 0), else
// {"gpu": true, "device", "mode", "results": [...]}, times in ms, each the
// median over rounds of the slowest rank's time per iteration.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "strata/base/status.h"
#include "strata/comm/backend.h"
#include "strata/comm/launch_env.h"
#include "strata/parallel/tensor_parallel/linear.h"

#if STRATA_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace strata {
namespace {

struct Args {
  int64_t tokens = 8192, hidden = 4096, ffn = 16384, shards = 8;
  DataType dtype = DataType::kBFloat16;
  int iters = 20, rounds = 9;
};

int ParseArgs(int argc, char** argv, Args* a) {
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--dtype") {
      if (v != "bf16" && v != "fp16") {
        std::fprintf(stderr, "tp_gpu_bench: --dtype %s: want bf16 or fp16\n", v.c_str());
        return 2;
      }
      a->dtype = v == "bf16" ? DataType::kBFloat16 : DataType::kFloat16;
      continue;
    }
    const long n = std::atol(v.c_str());
    if (n <= 0) {
      std::fprintf(stderr, "tp_gpu_bench: %s %s: want a positive number\n", k.c_str(), v.c_str());
      return 2;
    }
    if (k == "--tokens") {
      a->tokens = n;
    } else if (k == "--hidden") {
      a->hidden = n;
    } else if (k == "--ffn") {
      a->ffn = n;
    } else if (k == "--shards") {
      a->shards = n;
    } else if (k == "--iters") {
      a->iters = static_cast<int>(n);
    } else if (k == "--rounds") {
      a->rounds = static_cast<int>(n);
    } else {
      std::fprintf(stderr, "tp_gpu_bench: unknown option %s\n", k.c_str());
      return 2;
    }
  }
  return 0;
}

#if STRATA_HAVE_CUDA

void Check(const absl::Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "tp_gpu_bench: %s: %s\n", what, std::string(s.message()).c_str());
    std::exit(1);
  }
}

void CheckCuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "tp_gpu_bench: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

// A device allocation of n elements of dtype, filled with small values.
class DeviceArray {
 public:
  DeviceArray(int64_t n, DataType dtype, uint32_t seed) : n_(n), dtype_(dtype) {
    const size_t bytes = static_cast<size_t>(n) * DataTypeSize(dtype);
    CheckCuda(cudaMalloc(&ptr_, std::max<size_t>(bytes, 1)), "cudaMalloc");
    // Values in [-1, 1) as 16-bit floats (or fp32), drawn on the host once.
    std::vector<uint16_t> half(dtype == DataType::kFloat32 ? 0 : static_cast<size_t>(n));
    std::vector<float> full(dtype == DataType::kFloat32 ? static_cast<size_t>(n) : 0);
    uint32_t x = seed * 2654435761u + 1;
    for (int64_t i = 0; i < n; ++i) {
      x = x * 1664525u + 1013904223u;
      const float f = static_cast<float>(x >> 8) / static_cast<float>(1u << 24) * 2.0f - 1.0f;
      if (dtype == DataType::kFloat32) {
        full[static_cast<size_t>(i)] = f;
      } else {
        uint32_t bits;
        std::memcpy(&bits, &f, sizeof bits);
        // bf16: the high half; fp16: a value in [-1, 1) built from the sign
        // and mantissa (exponent 14: magnitudes in [0.5, 1)).
        half[static_cast<size_t>(i)] =
            dtype == DataType::kBFloat16 ? static_cast<uint16_t>(bits >> 16)
                                         : static_cast<uint16_t>(((bits >> 16) & 0x8000u) |
                                                                 (14u << 10) | ((x >> 9) & 0x3ffu));
      }
    }
    const void* src = dtype == DataType::kFloat32 ? static_cast<const void*>(full.data())
                                                  : static_cast<const void*>(half.data());
    CheckCuda(cudaMemcpy(ptr_, src, bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
  }
  ~DeviceArray() { cudaFree(ptr_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;

  void* data() const { return ptr_; }
  MatrixRef Matrix(int64_t rows, int64_t cols) const { return MatrixRef{ptr_, rows, cols, dtype_}; }
  Buffer AsBuffer() const { return Buffer{ptr_, static_cast<size_t>(n_), dtype_}; }

 private:
  void* ptr_ = nullptr;
  int64_t n_;
  DataType dtype_;
};

// One layer case's tensors and calls, on a given group.
class LayerCase {
 public:
  // column: in = hidden, out = ffn; row: in = ffn, out = hidden
  // (input_is_parallel). Global sizes; the group's size shards them.
  LayerCase(const Args& a, bool column, int64_t in, int64_t out, Communicator& group,
            cudaStream_t stream)
      : column_(column), stream_(stream) {
    LinearOptions o;
    o.in_features = in;
    o.out_features = out;
    o.dtype = a.dtype;
    o.memory = MemoryKind::kCuda;
    o.input_is_parallel = !column;
    if (column) {
      auto made = ColumnParallelLinear::Create(o, strata::GroupHandle::Fixed(&group));
      Check(made.status(), "create the column-parallel layer");
      col_ = std::move(made).value();
    } else {
      auto made = RowParallelLinear::Create(o, strata::GroupHandle::Fixed(&group));
      Check(made.status(), "create the row-parallel layer");
      row_ = std::move(made).value();
    }
    absl::StatusOr<LinearShapes> s = col_ ? col_->Shapes(a.tokens) : row_->Shapes(a.tokens);
    Check(s.status(), "shapes");
    shapes_ = *s;
    x_ = std::make_unique<DeviceArray>(s->input_rows * s->input_cols, a.dtype, 1);
    w_ = std::make_unique<DeviceArray>(s->weight_rows * s->weight_cols, a.dtype, 2);
    b_ = std::make_unique<DeviceArray>(s->bias, a.dtype, 3);
    y_ = std::make_unique<DeviceArray>(s->output_rows * s->output_cols, a.dtype, 4);
    dy_ = std::make_unique<DeviceArray>(s->output_rows * s->output_cols, a.dtype, 5);
    dx_ = std::make_unique<DeviceArray>(s->input_rows * s->input_cols, a.dtype, 6);
    dw_ = std::make_unique<DeviceArray>(s->weight_rows * s->weight_cols, DataType::kFloat32, 7);
    db_ = std::make_unique<DeviceArray>(s->bias, DataType::kFloat32, 8);
  }

  void Forward() {
    LinearForward f{x_->Matrix(shapes_.input_rows, shapes_.input_cols),
                    w_->Matrix(shapes_.weight_rows, shapes_.weight_cols), b_->data(),
                    y_->Matrix(shapes_.output_rows, shapes_.output_cols), stream_};
    Check(col_ ? col_->Forward(f) : row_->Forward(f), "forward");
  }
  void Backward() {
    LinearBackward b{dy_->Matrix(shapes_.output_rows, shapes_.output_cols),
                     x_->Matrix(shapes_.input_rows, shapes_.input_cols),
                     w_->Matrix(shapes_.weight_rows, shapes_.weight_cols),
                     dx_->Matrix(shapes_.input_rows, shapes_.input_cols),
                     static_cast<float*>(dw_->data()),
                     static_cast<float*>(db_->data()),
                     stream_};
    Check(col_ ? col_->Backward(b) : row_->Backward(b), "backward");
  }
  const LinearShapes& shapes() const { return shapes_; }
  // The buffers the layer's collectives move, for timing them alone:
  // column: grad_input [rows, in] (all-reduce, backward); row: the output
  // [rows, out] (all-reduce, forward).
  Buffer CollectiveBuffer() const { return column_ ? dx_->AsBuffer() : y_->AsBuffer(); }

 private:
  bool column_;
  cudaStream_t stream_;
  std::unique_ptr<ColumnParallelLinear> col_;
  std::unique_ptr<RowParallelLinear> row_;
  LinearShapes shapes_;
  std::unique_ptr<DeviceArray> x_, w_, b_, y_, dy_, dx_, dw_, db_;
};

class Timer {
 public:
  Timer(Communicator& world, cudaStream_t stream, int iters)
      : world_(world), stream_(stream), iters_(iters) {}
  // Seconds per call of fn, the slowest rank's: the stream is drained
  // before and after, and the ranks start together.
  double Time(const std::function<void()>& fn) {
    CheckCuda(cudaStreamSynchronize(stream_), "synchronize");
    Barrier();
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < iters_; ++i) fn();
    CheckCuda(cudaStreamSynchronize(stream_), "synchronize");
    double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / iters_;
    return Max(s);
  }

 private:
  void Barrier() {
    auto w = world_.Barrier();
    Check(w.status(), "barrier");
    Check((*w)->Wait(absl::Now() + absl::Minutes(5)), "barrier");
  }
  // The world communicator may live on device memory (NCCL): reduce a
  // device scalar there.
  double Max(double s) {
    if (world_.size() == 1) return s;
    double* d = nullptr;
    CheckCuda(cudaMalloc(&d, sizeof(double)), "cudaMalloc");
    CheckCuda(cudaMemcpy(d, &s, sizeof s, cudaMemcpyHostToDevice), "cudaMemcpy");
    OpOptions opts;
    opts.stream = stream_;
    auto w = world_.AllReduce(ConstBuffer(d, 1, DataType::kFloat64),
                              Buffer{d, 1, DataType::kFloat64}, ReduceOp::kMax, opts);
    Check(w.status(), "max");
    Check((*w)->Wait(absl::Now() + absl::Minutes(5)), "max");
    CheckCuda(cudaStreamSynchronize(stream_), "synchronize");
    CheckCuda(cudaMemcpy(&s, d, sizeof s, cudaMemcpyDeviceToHost), "cudaMemcpy");
    cudaFree(d);
    return s;
  }

  Communicator& world_;
  cudaStream_t stream_;
  int iters_;
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Each function's median (ms) over rounds, the functions interleaved in
// every round so that drift hits them alike.
std::vector<double> Measure(Timer& timer, const std::vector<std::function<void()>>& fns,
                            int rounds) {
  for (const auto& fn : fns) fn();  // warm up: cuBLASLt heuristics, NCCL setup
  std::vector<std::vector<double>> samples(fns.size());
  for (int r = 0; r < rounds; ++r) {
    for (size_t i = 0; i < fns.size(); ++i) samples[i].push_back(timer.Time(fns[i]));
  }
  std::vector<double> ms;
  for (auto& s : samples) ms.push_back(Median(s) * 1e3);
  return ms;
}

std::string CaseName(bool column, int64_t in, int64_t out) {
  return std::string(column ? "column" : "row") + "-parallel " + std::to_string(in) + "->" +
         std::to_string(out);
}

int Main(int argc, char** argv) {
  Args a;
  if (int rc = ParseArgs(argc, argv, &a); rc != 0) return rc;
  absl::StatusOr<LaunchEnv> env = LaunchEnv::Detect();
  Check(env.status(), "launch environment");
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    cudaGetLastError();
    if (env->rank == 0) {
      std::printf("{\"gpu\": false, \"reason\": \"no CUDA device visible\"}\n");
    }
    return 0;
  }
  const int device = env->local_rank % devices;
  CheckCuda(cudaSetDevice(device), "cudaSetDevice");
  cudaDeviceProp prop{};
  CheckCuda(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  cudaStream_t stream = nullptr;
  CheckCuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");

  RootOptions options;
  options.comm.timeout = absl::Minutes(5);
  // One rank: any backend carries a group of one (the layers do not
  // communicate); several: NCCL, one GPU each.
  options.memory = env->world_size > 1 ? RootMemory::kDevice : RootMemory::kHost;
  absl::StatusOr<std::unique_ptr<Communicator>> root = CreateRootCommunicator(*env, options);
  Check(root.status(), "root communicator");
  Communicator& world = **root;
  Timer timer(world, stream, a.iters);
  const int n = world.size();
  const char* dtype = a.dtype == DataType::kBFloat16 ? "bf16" : "fp16";
  std::string json = std::string("{\"gpu\": true, \"device\": \"") + prop.name +
                     "\", \"dtype\": \"" + dtype + "\", \"ranks\": " + std::to_string(n) +
                     ", \"mode\": \"" + (n == 1 ? "throughput" : "overlap") + "\", \"results\": [";
  char line[600];
  if (n == 1) {
    // The local shapes of one rank of a tp = shards layer.
    if (a.ffn % a.shards != 0) {
      std::fprintf(stderr, "tp_gpu_bench: --ffn %ld is not divisible by --shards %ld\n",
                   static_cast<long>(a.ffn), static_cast<long>(a.shards));
      return 2;
    }
    const int64_t local = a.ffn / a.shards;
    for (int c = 0; c < 2; ++c) {
      const bool column = c == 0;
      const int64_t in = column ? a.hidden : local, out = column ? local : a.hidden;
      LayerCase layer(a, column, in, out, world, stream);
      const std::vector<double> ms = Measure(timer,
                                             {[&] { layer.Forward(); },
                                              [&] {
                                                layer.Forward();
                                                layer.Backward();
                                              }},
                                             a.rounds);
      std::snprintf(
          line, sizeof line,
          "%s{\"case\": \"%s\", \"m\": %ld, \"n\": %ld, \"k\": %ld, \"forward_ms\": %.5f, "
          "\"fwd_bwd_ms\": %.5f}",
          c ? ", " : "", CaseName(column, in, out).c_str(), static_cast<long>(a.tokens),
          static_cast<long>(out), static_cast<long>(in), ms[0], ms[1]);
      json += line;
    }
  } else {
    // tp = n against the same kernels on a group of one plus the
    // collectives alone.
    absl::StatusOr<std::unique_ptr<Communicator>> self =
        world.Split(world.rank(), 0, CommOptions{});
    Check(self.status(), "split into groups of one");
    for (int c = 0; c < 2; ++c) {
      const bool column = c == 0;
      const int64_t in = column ? a.hidden : a.ffn, out = column ? a.ffn : a.hidden;
      LayerCase layer(a, column, in, out, world, stream);
      // The same local shapes on one rank: global sizes of the shard.
      const int64_t lin = column ? in : in / n, lout = column ? out / n : out;
      LayerCase alone(a, column, lin, lout, **self, stream);
      Buffer moved = layer.CollectiveBuffer();
      auto collective = [&] {
        OpOptions opts;
        opts.stream = stream;
        auto w = world.AllReduce(moved, moved, ReduceOp::kSum, opts);
        Check(w.status(), "all-reduce");
        Check((*w)->Wait(absl::Now() + absl::Minutes(5)), "all-reduce");
      };
      const std::vector<double> ms = Measure(timer,
                                             {[&] {
                                                layer.Forward();
                                                layer.Backward();
                                              },
                                              [&] {
                                                alone.Forward();
                                                alone.Backward();
                                              },
                                              collective},
                                             a.rounds);
      std::snprintf(
          line, sizeof line,
          "%s{\"case\": \"%s\", \"layer_ms\": %.5f, \"gemm_ms\": %.5f, \"comm_ms\": %.5f}",
          c ? ", " : "", CaseName(column, in, out).c_str(), ms[0], ms[1], ms[2]);
      json += line;
    }
  }
  json += "]}";
  if (world.rank() == 0) std::printf("%s\n", json.c_str());
  cudaStreamDestroy(stream);
  return 0;
}

#else  // !STRATA_HAVE_CUDA

int Main(int argc, char** argv) {
  Args a;
  if (int rc = ParseArgs(argc, argv, &a); rc != 0) return rc;
  std::printf("{\"gpu\": false, \"reason\": \"strata was built without CUDA\"}\n");
  return 0;
}

#endif

}  // namespace
}  // namespace strata

int main(int argc, char** argv) { return strata::Main(argc, argv); }
