// Collectives and point-to-point operations of the MPI backend. Structure
// and fault handling (root creation, Split, Shrink, Revoke, Abort) are in
// mpi_structure.cc.
#include "comm/mpi/mpi_communicator.h"

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "comm/half_reduce.h"
#include "strata/base/status.h"

namespace strata::mpi {
namespace {

using comm_internal::DivideInPlace;

// Tags of the point-to-point messages on the operations communicator.
constexpr int kUserTag = 0;
constexpr int kAllToAllTag = 1;

class MpiWork final : public Work {
 public:
  explicit MpiWork(std::shared_ptr<Op> op) : op_(std::move(op)) {}
  absl::Status DoWait(absl::Time deadline) override { return op_->Wait(deadline); }
  absl::StatusOr<bool> Test() override { return op_->Test(); }
  std::string Describe() const override { return op_->description(); }
  // The op lives while MPI may use its buffers (the engine, or the runtime
  // until exit, holds it while requests are pending).
  void KeepBuffersAlive(std::shared_ptr<void> holder) override { op_->Keep(std::move(holder)); }

 private:
  std::shared_ptr<Op> op_;
};

size_t Bytes(size_t count, DataType t) { return count * DataTypeSize(t); }

char* At(void* base, size_t elements, DataType t) {
  return static_cast<char*>(base) + Bytes(elements, t);
}

const char* At(const void* base, size_t elements, DataType t) {
  return static_cast<const char*>(base) + Bytes(elements, t);
}

// Calls fn(offset, count) for consecutive chunks of at most `limit` of `n`
// elements; n == 0 still makes one (empty) call, so that every rank issues
// the same MPI calls.
template <typename F>
absl::Status ForChunks(size_t n, size_t limit, F&& fn) {
  if (n == 0) return fn(size_t{0}, 0);
  for (size_t offset = 0; offset < n; offset += limit) {
    STRATA_RETURN_IF_ERROR(fn(offset, static_cast<int>(std::min(limit, n - offset))));
  }
  return absl::OkStatus();
}

// `count` contiguous elements whose extent is `stride` elements: one chunk
// of each rank's block when a block is larger than one MPI call may carry.
absl::StatusOr<MPI_Datatype> StridedChunk(DataType dtype, int count, size_t stride) {
  MPI_Datatype contiguous = MPI_DATATYPE_NULL, resized = MPI_DATATYPE_NULL;
  int rc = MPI_Type_contiguous(count, MpiType(dtype), &contiguous);
  if (rc == MPI_SUCCESS) {
    rc = MPI_Type_create_resized(contiguous, 0, static_cast<MPI_Aint>(Bytes(stride, dtype)),
                                 &resized);
    MPI_Type_free(&contiguous);
  }
  if (rc == MPI_SUCCESS) rc = MPI_Type_commit(&resized);
  if (rc != MPI_SUCCESS) return FromMpi(rc, MPI_COMM_NULL, "building a strided MPI datatype");
  return resized;
}

// A copy of `bytes` bytes of `data` owned by `op`, for the in-place forms
// of the split-up (large-count) algorithms, which cannot use MPI_IN_PLACE.
const char* Stage(Op& op, const void* data, size_t bytes) {
  op.scratch.emplace_back(bytes);
  if (bytes != 0) std::memcpy(op.scratch.back().data(), data, bytes);
  return op.scratch.back().data();
}

// Starts one nonblocking MPI call on `comm` for `op`: `call(&request)`
// returns MPI's error code; the request joins the operation's.
template <typename Call>
absl::Status Post(Op& op, MPI_Comm comm, const Call& call) {
  MPI_Request r;
  const int rc = call(&r);
  if (rc != MPI_SUCCESS) return FromMpi(rc, comm, op.description());
  op.requests.push_back(r);
  return absl::OkStatus();
}

// Makes `op` divide `recv` by the group's `size` once MPI has summed into
// it (MPI has no average).
void AverageWhenDone(Op& op, Buffer recv, int size) {
  op.finish = [recv, size](absl::Span<const MPI_Status>) {
    DivideInPlace(recv.dtype, recv.data, recv.count, size);
    return absl::OkStatus();
  };
}

// True when `bytes` reach a size threshold of MpiOptions (0: never).
bool AtLeast(size_t bytes, size_t threshold) { return threshold != 0 && bytes >= threshold; }

bool CanMove(DataType) { return true; }
bool CanReduce(DataType t) { return t != DataType::kBool; }

}  // namespace

MPI_Datatype MpiType(DataType dtype) {
  switch (dtype) {
    case DataType::kFloat32:
      return MPI_FLOAT;
    case DataType::kFloat64:
      return MPI_DOUBLE;
    case DataType::kFloat16:
    case DataType::kBFloat16:
      return MPI_UINT16_T;
    case DataType::kInt8:
      return MPI_INT8_T;
    case DataType::kUInt8:
      return MPI_UINT8_T;
    case DataType::kInt32:
      return MPI_INT32_T;
    case DataType::kInt64:
      return MPI_INT64_T;
    case DataType::kInt16:
      return MPI_INT16_T;
    case DataType::kBool:
      return MPI_C_BOOL;
  }
  STRATA_CHECK(false, "MpiType of dtype value ", static_cast<int>(dtype));
  return MPI_DATATYPE_NULL;
}

MPI_Op MpiReduceOp(DataType dtype, ReduceOp op) {
  if (dtype == DataType::kFloat16 || dtype == DataType::kBFloat16) return HalfReduceOp(dtype, op);
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      return MPI_SUM;
    case ReduceOp::kProd:
      return MPI_PROD;
    case ReduceOp::kMin:
      return MPI_MIN;
    case ReduceOp::kMax:
      return MPI_MAX;
  }
  STRATA_CHECK(false, "MpiReduceOp of op value ", static_cast<int>(op));
  return MPI_OP_NULL;
}

const CommCapabilities& MpiCapabilities() {
  static const CommCapabilities caps{&CanMove, &CanReduce};
  return caps;
}

MpiCommunicator::MpiCommunicator(std::shared_ptr<Engine> engine, std::shared_ptr<CommState> state,
                                 const CommOptions& options)
    : Communicator(options, Membership{state->rank(), state->size(), state->world_rank()},
                   MpiCapabilities()),
      engine_(std::move(engine)),
      state_(std::move(state)) {}

absl::StatusOr<std::unique_ptr<Work>> MpiCommunicator::Start(
    const ResolvedOptions& options, const std::function<absl::Status(Op&)>& start) {
  std::lock_guard<std::mutex> lock(state_->issue_mu());
  STRATA_RETURN_IF_ERROR(state_->CheckUsable(options.description));
  auto op = std::make_shared<Op>(options.description, state_, options.deadline, options.timeout,
                                 engine_->wakeup());
  op->trace = options.trace;
  absl::Status started = start(*op);
  if (!started.ok()) {
    // Calls that did start (earlier chunks) finish in the background.
    if (started.code() == absl::StatusCode::kAborted ||
        started.code() == absl::StatusCode::kUnavailable) {
      state_->SetFailed(started);
    }
    op->trace = nullptr;  // Communicator records the failure to start
    engine_->Adopt(std::move(op));
    return started;
  }
  // Posted: MPI runs it from here on.
  if (options.trace != nullptr) options.trace->Started();
  engine_->Submit(op);
  return std::unique_ptr<Work>(new MpiWork(std::move(op)));
}

absl::StatusOr<std::unique_ptr<Work>> MpiCommunicator::DoAllReduce(ConstBuffer send, Buffer recv,
                                                                   ReduceOp op,
                                                                   const ResolvedOptions& options) {
  const bool in_place = send.data == recv.data;
  const size_t limit = engine_->max_elements_per_call();
  const int size = state_->size();
  return Start(options, [&](Op& o) {
    const MPI_Datatype type = MpiType(recv.dtype);
    const MPI_Op mpi_op = MpiReduceOp(recv.dtype, op);
    if (op == ReduceOp::kAvg) AverageWhenDone(o, recv, size);
    auto start = [&]() {
      return ForChunks(recv.count, limit, [&](size_t off, int n) {
        const void* s = in_place ? MPI_IN_PLACE : At(send.data, off, send.dtype);
        return Post(o, state_->comm(), [&](MPI_Request* r) {
          return MPI_Iallreduce(s, At(recv.data, off, recv.dtype), n, type, mpi_op, state_->comm(),
                                r);
        });
      });
    };
    if (AtLeast(Bytes(recv.count, recv.dtype), engine_->options().ring_allreduce_min_bytes)) {
      return WithNbcAlgorithm(NbcCollective::kIallreduce, kNbcAllreduceRing, start);
    }
    return start();
  });
}

absl::StatusOr<std::unique_ptr<Work>> MpiCommunicator::DoBroadcast(Buffer buffer, int root,
                                                                   const ResolvedOptions& options) {
  const size_t limit = engine_->max_elements_per_call();
  return Start(options, [&](Op& o) {
    return ForChunks(buffer.count, limit, [&](size_t off, int n) {
      return Post(o, state_->comm(), [&](MPI_Request* r) {
        return MPI_Ibcast(At(buffer.data, off, buffer.dtype), n, MpiType(buffer.dtype), root,
                          state_->comm(), r);
      });
    });
  });
}

absl::StatusOr<std::unique_ptr<Work>> MpiCommunicator::DoReduce(ConstBuffer send, Buffer recv,
                                                                ReduceOp op, int root,
                                                                const ResolvedOptions& options) {
  const bool is_root = state_->rank() == root;
  const bool in_place = is_root && send.data == recv.data;
  const size_t limit = engine_->max_elements_per_call();
  const int size = state_->size();
  return Start(options, [&](Op& o) {
    const MPI_Datatype type = MpiType(send.dtype);
    const MPI_Op mpi_op = MpiReduceOp(send.dtype, op);
    if (op == ReduceOp::kAvg && is_root) AverageWhenDone(o, recv, size);
    auto start = [&]() {
      return ForChunks(send.count, limit, [&](size_t off, int n) {
        const void* s = in_place ? MPI_IN_PLACE : At(send.data, off, send.dtype);
        void* d = is_root ? At(recv.data, off, recv.dtype) : nullptr;
        return Post(o, state_->comm(), [&](MPI_Request* r) {
          return MPI_Ireduce(s, d, n, type, mpi_op, root, state_->comm(), r);
        });
      });
    };
    // Every rank must pick the same algorithm: decide on the send size.
    if (AtLeast(Bytes(send.count, send.dtype), engine_->options().binomial_reduce_min_bytes)) {
      return WithNbcAlgorithm(NbcCollective::kIreduce, kNbcReduceBinomial, start);
    }
    return start();
  });
}

absl::StatusOr<std::unique_ptr<Work>> MpiCommunicator::DoAllGather(ConstBuffer send, Buffer recv,
                                                                   const ResolvedOptions& options) {
  const size_t limit = engine_->max_elements_per_call();
  const size_t block = send.count;
  const bool in_place =
      send.data != nullptr && send.data == At(recv.data, block * rank(), recv.dtype);
  return Start(options, [&](Op& o) {
    const MPI_Datatype type = MpiType(send.dtype);
    if (block <= limit) {
      const void* s = in_place ? MPI_IN_PLACE : send.data;
      return Post(o, state_->comm(), [&](MPI_Request* r) {
        return MPI_Iallgather(s, static_cast<int>(block), type, recv.data, static_cast<int>(block),
                              type, state_->comm(), r);
      });
    }
    // Blocks larger than one call: gather chunk by chunk, each landing in
    // every rank's block through a datatype whose extent is one block.
    const char* source = in_place ? Stage(o, send.data, Bytes(block, send.dtype))
                                  : static_cast<const char*>(send.data);
    return ForChunks(block, limit, [&](size_t off, int n) {
      STRATA_ASSIGN_OR_RETURN(MPI_Datatype strided, StridedChunk(recv.dtype, n, block));
      return Post(o, state_->comm(), [&](MPI_Request* r) {
        const int rc =
            MPI_Iallgather(At(source, off, send.dtype), n, type, At(recv.data, off, recv.dtype), 1,
                           strided, state_->comm(), r);
        MPI_Type_free(&strided);  // MPI keeps it until the request completes
        return rc;
      });
    });
  });
}

absl::StatusOr<std::unique_ptr<Work>> MpiCommunicator::DoReduceScatter(
    ConstBuffer send, Buffer recv, ReduceOp op, const ResolvedOptions& options) {
  const size_t limit = engine_->max_elements_per_call();
  const size_t block = recv.count;
  const bool in_place = send.data == recv.data;
  const int size = state_->size();
  const int me = state_->rank();
  return Start(options, [&](Op& o) {
    const MPI_Datatype type = MpiType(recv.dtype);
    const MPI_Op mpi_op = MpiReduceOp(recv.dtype, op);
    if (op == ReduceOp::kAvg) AverageWhenDone(o, recv, size);
    const MpiOptions& tuning = engine_->options();
    const bool per_root =
        AtLeast(Bytes(block, recv.dtype), tuning.per_root_reduce_scatter_min_bytes) &&
        size <= tuning.per_root_reduce_scatter_max_ranks;
    if (block <= limit && !per_root) {
      const void* s = in_place ? MPI_IN_PLACE : send.data;
      return Post(o, state_->comm(), [&](MPI_Request* r) {
        return MPI_Ireduce_scatter_block(s, recv.data, static_cast<int>(block), type, mpi_op,
                                         state_->comm(), r);
      });
    }
    // One binomial reduce per destination rank (and chunk), all in flight:
    // for blocks larger than one MPI call (MPI has no strided
    // reduce-scatter), and for large blocks in small groups, where it beats
    // libnbc's reduce-scatter by 2-3x on shared memory (docs/mpi.md).
    const char* source = in_place ? Stage(o, send.data, Bytes(send.count, send.dtype))
                                  : static_cast<const char*>(send.data);
    return WithNbcAlgorithm(NbcCollective::kIreduce, kNbcReduceBinomial, [&]() {
      return ForChunks(block, limit, [&](size_t off, int n) {
        for (int root = 0; root < size; ++root) {
          void* d = root == me ? At(recv.data, off, recv.dtype) : nullptr;
          STRATA_RETURN_IF_ERROR(Post(o, state_->comm(), [&](MPI_Request* r) {
            return MPI_Ireduce(At(source, block * root + off, send.dtype), d, n, type, mpi_op, root,
                               state_->comm(), r);
          }));
        }
        return absl::OkStatus();
      });
    });
  });
}

absl::StatusOr<std::unique_ptr<Work>> MpiCommunicator::DoAllToAll(ConstBuffer send, Buffer recv,
                                                                  const ResolvedOptions& options) {
  const size_t limit = engine_->max_elements_per_call();
  const size_t block = send.count / static_cast<size_t>(state_->size());
  const bool in_place = send.data == recv.data && send.count != 0;
  return Start(options, [&](Op& o) {
    const MPI_Datatype type = MpiType(send.dtype);
    if (block <= limit) {
      const void* s = in_place ? MPI_IN_PLACE : send.data;
      return Post(o, state_->comm(), [&](MPI_Request* r) {
        return MPI_Ialltoall(s, static_cast<int>(block), type, recv.data, static_cast<int>(block),
                             type, state_->comm(), r);
      });
    }
    const char* source = in_place ? Stage(o, send.data, Bytes(send.count, send.dtype))
                                  : static_cast<const char*>(send.data);
    return ForChunks(block, limit, [&](size_t off, int n) {
      STRATA_ASSIGN_OR_RETURN(MPI_Datatype strided, StridedChunk(send.dtype, n, block));
      return Post(o, state_->comm(), [&](MPI_Request* r) {
        const int rc = MPI_Ialltoall(At(source, off, send.dtype), 1, strided,
                                     At(recv.data, off, recv.dtype), 1, strided, state_->comm(), r);
        MPI_Type_free(&strided);  // MPI keeps it until the request completes
        return rc;
      });
    });
  });
}

absl::StatusOr<std::unique_ptr<Work>> MpiCommunicator::DoAllToAllV(ConstBuffer send, Buffer recv,
                                                                   const AllToAllCounts& counts,
                                                                   const ResolvedOptions& options) {
  const size_t limit = engine_->max_elements_per_call();
  const bool in_place = send.data == recv.data && send.count != 0;
  const int size = state_->size();
  const int me = state_->rank();
  return Start(options, [&](Op& o) {
    const MPI_Datatype type = MpiType(send.dtype);
    if (send.count <= limit && recv.count <= limit) {
      // Every count and displacement fits MPI's int.
      o.int_scratch.resize(4, std::vector<int>(static_cast<size_t>(size)));
      std::vector<int>& sc = o.int_scratch[0];
      std::vector<int>& sd = o.int_scratch[1];
      std::vector<int>& rc_ = o.int_scratch[2];
      std::vector<int>& rd = o.int_scratch[3];
      size_t s_off = 0, r_off = 0;
      for (size_t i = 0; i < static_cast<size_t>(size); ++i) {
        sc[i] = static_cast<int>(counts.send_counts[i]);
        sd[i] = static_cast<int>(s_off);
        rc_[i] = static_cast<int>(counts.recv_counts[i]);
        rd[i] = static_cast<int>(r_off);
        s_off += counts.send_counts[i];
        r_off += counts.recv_counts[i];
      }
      // Open MPI 5.0.11's MPI_Ialltoallv delivers wrong blocks with
      // MPI_IN_PLACE (seen on 4 ranks; docs/mpi.md), so the in-place form
      // sends from a staged copy instead.
      const void* source =
          in_place ? Stage(o, send.data, Bytes(send.count, send.dtype)) : send.data;
      return Post(o, state_->comm(), [&](MPI_Request* r) {
        return MPI_Ialltoallv(source, sc.data(), sd.data(), type, recv.data, rc_.data(), rd.data(),
                              type, state_->comm(), r);
      });
    }
    // Larger than MPI's int counts: point-to-point messages per peer,
    // chunked. Receives first, then sends; the own block is a copy.
    const char* source = in_place ? Stage(o, send.data, Bytes(send.count, send.dtype))
                                  : static_cast<const char*>(send.data);
    std::vector<size_t> s_disp(static_cast<size_t>(size)), r_disp(static_cast<size_t>(size));
    for (size_t i = 1; i < static_cast<size_t>(size); ++i) {
      s_disp[i] = s_disp[i - 1] + counts.send_counts[i - 1];
      r_disp[i] = r_disp[i - 1] + counts.recv_counts[i - 1];
    }
    for (int p = 0; p < size; ++p) {
      if (p == me) continue;
      const size_t n = counts.recv_counts[static_cast<size_t>(p)];
      if (n == 0) continue;
      STRATA_RETURN_IF_ERROR(ForChunks(n, limit, [&](size_t off, int c) {
        return Post(o, state_->comm(), [&](MPI_Request* r) {
          return MPI_Irecv(At(recv.data, r_disp[static_cast<size_t>(p)] + off, recv.dtype), c, type,
                           p, kAllToAllTag, state_->comm(), r);
        });
      }));
    }
    for (int p = 0; p < size; ++p) {
      if (p == me) continue;
      const size_t n = counts.send_counts[static_cast<size_t>(p)];
      if (n == 0) continue;
      STRATA_RETURN_IF_ERROR(ForChunks(n, limit, [&](size_t off, int c) {
        return Post(o, state_->comm(), [&](MPI_Request* r) {
          return MPI_Isend(At(source, s_disp[static_cast<size_t>(p)] + off, send.dtype), c, type, p,
                           kAllToAllTag, state_->comm(), r);
        });
      }));
    }
    const size_t own = counts.send_counts[static_cast<size_t>(me)];
    if (own != 0 && !in_place) {
      std::memmove(At(recv.data, r_disp[static_cast<size_t>(me)], recv.dtype),
                   At(source, s_disp[static_cast<size_t>(me)], send.dtype), Bytes(own, send.dtype));
    }
    return absl::OkStatus();
  });
}

absl::StatusOr<std::unique_ptr<Work>> MpiCommunicator::DoBarrier(const ResolvedOptions& options) {
  return Start(options, [&](Op& o) {
    return Post(o, state_->comm(), [&](MPI_Request* r) { return MPI_Ibarrier(state_->comm(), r); });
  });
}

absl::StatusOr<std::unique_ptr<Work>> MpiCommunicator::DoSend(ConstBuffer buffer, int peer,
                                                              const ResolvedOptions& options) {
  const size_t limit = engine_->max_elements_per_call();
  return Start(options, [&](Op& o) {
    return ForChunks(buffer.count, limit, [&](size_t off, int n) {
      return Post(o, state_->comm(), [&](MPI_Request* r) {
        return MPI_Isend(At(buffer.data, off, buffer.dtype), n, MpiType(buffer.dtype), peer,
                         kUserTag, state_->comm(), r);
      });
    });
  });
}

absl::StatusOr<std::unique_ptr<Work>> MpiCommunicator::DoRecv(Buffer buffer, int peer,
                                                              const ResolvedOptions& options) {
  const size_t limit = engine_->max_elements_per_call();
  return Start(options, [&](Op& o) {
    std::vector<int> expected;
    absl::Status s = ForChunks(buffer.count, limit, [&](size_t off, int n) {
      STRATA_RETURN_IF_ERROR(Post(o, state_->comm(), [&](MPI_Request* r) {
        return MPI_Irecv(At(buffer.data, off, buffer.dtype), n, MpiType(buffer.dtype), peer,
                         kUserTag, state_->comm(), r);
      }));
      expected.push_back(n);
      return absl::OkStatus();
    });
    o.cancel_on_failure = true;
    // A shorter message than the buffer is not an MPI error; it is ours.
    const std::string description = o.description();
    const DataType dtype = buffer.dtype;
    o.finish = [expected, description, dtype](absl::Span<const MPI_Status> statuses) {
      size_t got = 0, want = 0;
      for (size_t i = 0; i < statuses.size(); ++i) {
        int n = 0;
        MPI_Get_count(&statuses[i], MpiType(dtype), &n);
        got += static_cast<size_t>(n);
        want += static_cast<size_t>(expected[i]);
      }
      if (got != want) {
        return absl::InvalidArgumentError(absl::StrCat(description, ": received ", got, " x ",
                                                       DataTypeName(dtype), ", expected ", want,
                                                       " (the sender sent a different count)"));
      }
      return absl::OkStatus();
    };
    return s;
  });
}

}  // namespace strata::mpi
