#include "comm/mpi/mpi_runtime.h"

#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <optional>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "comm/half_reduce.h"
#include "strata/base/status.h"

#ifdef STRATA_HAVE_ULFM
#include <mpi-ext.h>
#endif

namespace strata::mpi {
namespace {

// MPI_Op user functions: one instantiation per (dtype, op), so the MPI
// callback needs no lookup.
template <DataType D, ReduceOp O>
void HalfOpFn(void* in, void* inout, int* len, MPI_Datatype* /*type*/) {
  comm_internal::HalfReduce(D, O, static_cast<const uint16_t*>(in), static_cast<uint16_t*>(inout),
                            static_cast<size_t>(*len));
}

struct Runtime {
  std::mutex mu;             // initialisation and the facts below
  std::mutex hooks_mu;       // `hooks`
  std::mutex kept_mu;        // `kept`
  bool initialized = false;  // by anyone
  bool we_initialized = false;
  bool exit_handler_registered = false;
  RuntimeInfo info;
  // [dtype: 0 fp16, 1 bf16][op: sum, prod, min, max]
  MPI_Op half_ops[2][4] = {};
  std::set<ExitHook*> hooks;
  std::vector<std::shared_ptr<void>> kept;
  // libnbc's algorithm variables, writable through MPI_T (null handle when
  // not available or set by the user's environment), and the lock that
  // makes "set, then start the collective" atomic.
  std::mutex nbc_mu;
  bool mpit_initialized = false;
  MPI_T_cvar_handle nbc[2] = {nullptr, nullptr};
};

// Deliberately leaked: it must outlive every static destructor that might
// still destroy a communicator at exit.
Runtime& GetRuntime() {
  static Runtime* runtime = new Runtime();
  return *runtime;
}

// Reads an integer MCA variable through MPI_T; nullopt when unknown.
std::optional<int> ReadIntVariable(const char* name) {
  int index = -1;
  if (MPI_T_cvar_get_index(name, &index) != MPI_SUCCESS) return std::nullopt;
  MPI_T_cvar_handle handle;
  int count = 0;
  if (MPI_T_cvar_handle_alloc(index, nullptr, &handle, &count) != MPI_SUCCESS) return std::nullopt;
  int value = 0;
  const bool ok = MPI_T_cvar_read(handle, &value) == MPI_SUCCESS;
  MPI_T_cvar_handle_free(&handle);
  if (!ok) return std::nullopt;
  return value;
}

bool ReadFaultTolerance() {
  // mpirun --with-ft ulfm sets the MCA parameter mpi_ft_enable; read it
  // through MPI_T so that every way of setting it counts.
  std::optional<int> value = ReadIntVariable("mpi_ft_enable");
  if (value) return *value != 0;
  const char* env = std::getenv("OMPI_MCA_mpi_ft_enable");
  return env != nullptr && std::strcmp(env, "0") != 0 && std::strcmp(env, "false") != 0;
}

// Handles of libnbc's algorithm variables, unless the user chose an
// algorithm in the environment (then theirs stays).
void OpenNbcVariables(Runtime& rt) {
  const char* names[2] = {"coll_libnbc_iallreduce_algorithm", "coll_libnbc_ireduce_algorithm"};
  for (int i = 0; i < 2; ++i) {
    std::optional<int> current = ReadIntVariable(names[i]);
    if (!current || *current != 0) continue;
    int index = -1, count = 0;
    if (MPI_T_cvar_get_index(names[i], &index) != MPI_SUCCESS) continue;
    MPI_T_cvar_handle handle;
    if (MPI_T_cvar_handle_alloc(index, nullptr, &handle, &count) == MPI_SUCCESS) {
      rt.nbc[i] = handle;
    }
  }
}

void FinalizeAtExit() {
  Runtime& rt = GetRuntime();
  {
    // Held while the hooks run, so that an engine being destroyed on
    // another thread (which unregisters first) cannot vanish under us.
    std::lock_guard<std::mutex> lock(rt.hooks_mu);
    for (ExitHook* hook : rt.hooks) hook->StopBeforeFinalize();
  }
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  {
    std::lock_guard<std::mutex> lock(rt.nbc_mu);
    for (MPI_T_cvar_handle& h : rt.nbc) {
      if (h != nullptr) MPI_T_cvar_handle_free(&h);
    }
    if (rt.mpit_initialized) MPI_T_finalize();
    rt.mpit_initialized = false;
  }
  MPI_Finalize();
}

absl::Status CreateHalfOps(Runtime& rt) {
  using F = MPI_User_function;
  F* fns[2][4] = {{&HalfOpFn<DataType::kFloat16, ReduceOp::kSum>,
                   &HalfOpFn<DataType::kFloat16, ReduceOp::kProd>,
                   &HalfOpFn<DataType::kFloat16, ReduceOp::kMin>,
                   &HalfOpFn<DataType::kFloat16, ReduceOp::kMax>},
                  {&HalfOpFn<DataType::kBFloat16, ReduceOp::kSum>,
                   &HalfOpFn<DataType::kBFloat16, ReduceOp::kProd>,
                   &HalfOpFn<DataType::kBFloat16, ReduceOp::kMin>,
                   &HalfOpFn<DataType::kBFloat16, ReduceOp::kMax>}};
  for (int d = 0; d < 2; ++d) {
    for (int o = 0; o < 4; ++o) {
      int rc = MPI_Op_create(fns[d][o], /*commute=*/1, &rt.half_ops[d][o]);
      if (rc != MPI_SUCCESS) return FromMpi(rc, MPI_COMM_NULL, "creating the fp16/bf16 MPI ops");
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<const RuntimeInfo*> EnsureInitialized() {
  Runtime& rt = GetRuntime();
  std::lock_guard<std::mutex> lock(rt.mu);
  if (rt.initialized) return &rt.info;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) {
    return absl::FailedPreconditionError(
        "MPI was already finalised in this process; it cannot be initialised again");
  }
  int initialized = 0;
  MPI_Initialized(&initialized);
  int provided = 0;
  if (!initialized) {
    int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
    if (rc != MPI_SUCCESS) {
      return absl::UnavailableError(absl::StrCat("MPI_Init_thread failed with error ", rc));
    }
    rt.we_initialized = true;
    if (!rt.exit_handler_registered) {
      std::atexit(&FinalizeAtExit);
      rt.exit_handler_registered = true;
    }
  } else {
    MPI_Query_thread(&provided);
  }
  if (provided < MPI_THREAD_MULTIPLE) {
    return absl::FailedPreconditionError(absl::StrCat(
        "MPI provides thread level ", provided, " but strata needs MPI_THREAD_MULTIPLE (",
        MPI_THREAD_MULTIPLE, ")",
        rt.we_initialized ? "" : "; MPI was initialised before strata with a lower level"));
  }
  MPI_Comm_rank(MPI_COMM_WORLD, &rt.info.world_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &rt.info.world_size);
  int mpit_level = 0;
  rt.mpit_initialized = MPI_T_init_thread(MPI_THREAD_MULTIPLE, &mpit_level) == MPI_SUCCESS;
#ifdef STRATA_HAVE_ULFM
  rt.info.ulfm_built = true;
  rt.info.fault_tolerant = ReadFaultTolerance();
#endif
  if (rt.mpit_initialized) OpenNbcVariables(rt);
  char version[MPI_MAX_LIBRARY_VERSION_STRING];
  int len = 0;
  MPI_Get_library_version(version, &len);
  std::string library(version, static_cast<size_t>(len));
  rt.info.library = library.substr(0, library.find_first_of("\n,"));
  STRATA_RETURN_IF_ERROR(CreateHalfOps(rt));
  rt.initialized = true;
  return &rt.info;
}

bool Finalized() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  return finalized != 0;
}

MPI_Op HalfReduceOp(DataType dtype, ReduceOp op) {
  Runtime& rt = GetRuntime();
  STRATA_CHECK(dtype == DataType::kFloat16 || dtype == DataType::kBFloat16,
               "HalfReduceOp on dtype ", DataTypeName(dtype));
  const int o = static_cast<int>(op == ReduceOp::kAvg ? ReduceOp::kSum : op);
  STRATA_CHECK(o >= 0 && o < 4, "HalfReduceOp on op ", o);
  return rt.half_ops[dtype == DataType::kFloat16 ? 0 : 1][o];
}

void RegisterExitHook(ExitHook* hook) {
  Runtime& rt = GetRuntime();
  std::lock_guard<std::mutex> lock(rt.hooks_mu);
  rt.hooks.insert(hook);
}

void UnregisterExitHook(ExitHook* hook) {
  Runtime& rt = GetRuntime();
  std::lock_guard<std::mutex> lock(rt.hooks_mu);
  rt.hooks.erase(hook);
}

absl::Status WithNbcAlgorithm(NbcCollective collective, int algorithm,
                              const std::function<absl::Status()>& start) {
  Runtime& rt = GetRuntime();
  MPI_T_cvar_handle handle = rt.nbc[static_cast<int>(collective)];
  if (handle == nullptr) return start();
  std::lock_guard<std::mutex> lock(rt.nbc_mu);
  if (!rt.mpit_initialized) return start();
  MPI_T_cvar_write(handle, &algorithm);
  absl::Status s = start();
  int automatic = 0;
  MPI_T_cvar_write(handle, &automatic);
  return s;
}

void KeepUntilExit(std::shared_ptr<void> object) {
  Runtime& rt = GetRuntime();
  std::lock_guard<std::mutex> lock(rt.kept_mu);
  rt.kept.push_back(std::move(object));
}

std::vector<int> FailedRanks(MPI_Comm comm) {
  std::vector<int> ranks;
#if defined(STRATA_HAVE_ULFM) && defined(OMPI_HAVE_MPIX_COMM_GET_FAILED)
  if (comm == MPI_COMM_NULL || Finalized()) return ranks;
  MPI_Group failed = MPI_GROUP_NULL, all = MPI_GROUP_NULL;
  if (MPIX_Comm_get_failed(comm, &failed) != MPI_SUCCESS) return ranks;
  int n = 0;
  MPI_Group_size(failed, &n);
  if (n > 0 && MPI_Comm_group(comm, &all) == MPI_SUCCESS) {
    std::vector<int> in(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) in[static_cast<size_t>(i)] = i;
    ranks.resize(static_cast<size_t>(n));
    MPI_Group_translate_ranks(failed, n, in.data(), all, ranks.data());
    MPI_Group_free(&all);
  }
  MPI_Group_free(&failed);
#else
  (void)comm;
#endif
  return ranks;
}

absl::Status FromMpi(int rc, MPI_Comm comm, absl::string_view context) {
  if (rc == MPI_SUCCESS) return absl::OkStatus();
  int error_class = rc;
  std::string mpi_text;
  if (rc < 0) {
    // Not an MPI error code: Open MPI's nonblocking collectives can return
    // an internal one (OMPI_ERROR, -1, from NBC_Start_round after a peer
    // died). MPI_Error_class would reject it through MPI_COMM_WORLD's
    // handler, MPI_ERRORS_ARE_FATAL: the process would abort.
    error_class = MPI_ERR_INTERN;
    mpi_text = absl::StrCat("Open MPI internal error code ", rc);
  } else {
    MPI_Error_class(rc, &error_class);
    char text[MPI_MAX_ERROR_STRING];
    int len = 0;
    if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) len = 0;
    mpi_text.assign(text, static_cast<size_t>(len));
  }
#ifdef STRATA_HAVE_ULFM
  if (error_class == MPIX_ERR_PROC_FAILED || error_class == MPIX_ERR_PROC_FAILED_PENDING ||
      error_class == MPIX_ERR_REVOKED) {
    const std::vector<int> failed = FailedRanks(comm);
    const std::string who =
        failed.empty()
            ? std::string("")
            : absl::StrCat(" (failed ranks of this group: ", absl::StrJoin(failed, ", "), ")");
    absl::Status status;
    if (error_class == MPIX_ERR_REVOKED) {
      status = absl::AbortedError(
          absl::StrCat(context, ": the communicator was revoked, by this rank or a peer", who,
                       " [MPI: ", mpi_text, "]"));
    } else {
      status = absl::UnavailableError(
          absl::StrCat(context, ": a peer rank failed", who, " [MPI: ", mpi_text, "]"));
    }
    if (error_class != MPIX_ERR_REVOKED || !failed.empty()) {
      status.SetPayload(kRankFailurePayload, absl::Cord(absl::StrJoin(failed, ",")));
    }
    return status;
  }
#endif
  if (error_class == MPI_ERR_TRUNCATE) {
    return absl::InvalidArgumentError(absl::StrCat(
        context, ": the message received is larger than the buffer [MPI: ", mpi_text, "]"));
  }
  return absl::InternalError(
      absl::StrCat(context, ": MPI error class ", error_class, " [MPI: ", mpi_text, "]"));
}

}  // namespace strata::mpi
