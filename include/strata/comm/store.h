// Store: a small key-value service that ranks use to find each other before
// any communicator exists (the NCCL unique id, Gloo's addresses, the
// survivors of a shrink).
//
// Implementations:
//   OpenFileStore      a directory on a filesystem every rank sees (a shared
//                      filesystem across nodes, any directory on one node);
//   MakeMemoryStore    this process's memory (ranks that are threads);
//   ConnectTcpStore    a client of torch.distributed's TCPStore (what
//                      torchrun serves at MASTER_ADDR:MASTER_PORT);
//   MakeCallbackStore  forwards to functions: the Python bindings wrap
//                      torch.distributed stores with it;
//   strata::torch::ConnectC10dStore (include/strata/torch/c10d_store.h, in
//                      the strata::torch target) wraps LibTorch's c10d
//                      TCPStore for C++ trainers that link LibTorch.
//
//   absl::StatusOr<std::shared_ptr<strata::Store>> store =
//       strata::OpenStore("file:/shared/job42");
//   const absl::Time deadline = absl::Now() + absl::Seconds(30);
//   if (rank == 0) STRATA_RETURN_IF_ERROR((*store)->Set("id", id, deadline));
//   STRATA_ASSIGN_OR_RETURN(std::string id, (*store)->Get("id", deadline));  // waits
//
// Every operation takes a deadline. Get and Wait block until the keys exist
// or the deadline passes (DeadlineExceeded naming the keys and the store);
// an unreachable store is Unavailable (or DeadlineExceeded when the store
// only says so by not answering). Keys are arbitrary byte strings; values are
// byte strings, except that Add keeps a decimal integer.
//
// Scale: strata's bootstrap uses O(1) store operations per rank where the
// backend allows it (one rank publishes, the others read); see docs/launch.md.
//
// Thread-safety: every Store is thread-safe.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "strata/base/export.h"

namespace strata {

// Ends a Store::CancellableWait from another thread. Cancel() holds until
// Reset(), so a cancel that comes before the wait starts still ends it.
class STRATA_EXPORT WaitCancel {
 public:
  WaitCancel();
  ~WaitCancel();
  WaitCancel(const WaitCancel&) = delete;
  WaitCancel& operator=(const WaitCancel&) = delete;

  void Cancel();
  void Reset();
  bool cancelled() const;
  // Readable while cancelled (for poll(2)); -1 if none could be made, and
  // then stores look at cancelled() every few milliseconds.
  int fd() const { return fd_; }

 private:
  int fd_ = -1;
  std::atomic<bool> cancelled_{false};
};

class STRATA_EXPORT Store {
 public:
  virtual ~Store() = default;

  // Sets `key` to `value`, replacing any earlier value.
  virtual absl::Status Set(absl::string_view key, absl::string_view value, absl::Time deadline) = 0;
  // Waits until `key` exists and returns its value.
  virtual absl::StatusOr<std::string> Get(absl::string_view key, absl::Time deadline) = 0;
  // Waits until every key of `keys` exists.
  virtual absl::Status Wait(absl::Span<const std::string> keys, absl::Time deadline) = 0;
  // Atomically adds `delta` to the integer at `key` (an absent key counts as
  // 0) and returns the new value. InvalidArgument when the key holds
  // something that is not a decimal integer.
  virtual absl::StatusOr<int64_t> Add(absl::string_view key, int64_t delta,
                                      absl::Time deadline) = 0;
  // Atomically: when the value at `key` equals `expected` (an absent key
  // matches an empty `expected`), replaces it with `desired`. Returns the
  // value after the call either way; NotFound when the key is absent and
  // stays absent (a non-empty `expected`).
  virtual absl::StatusOr<std::string> CompareSet(absl::string_view key, absl::string_view expected,
                                                 absl::string_view desired,
                                                 absl::Time deadline) = 0;
  // For messages: "file store /shared/job42", "torch TCPStore 10.0.0.1:29500".
  virtual std::string Describe() const = 0;

  // Like Wait, and Cancelled as soon as `cancel` is cancelled (from any
  // thread): for a wait that another thread must be able to end, such as
  // a monitor's wait for an alarm when the monitor stops. The default
  // waits in slices of 50 ms and looks at `cancel` between them; a store
  // whose waits are served (waits_without_polling) ends at once.
  virtual absl::Status CancellableWait(absl::Span<const std::string> keys, absl::Time deadline,
                                       const WaitCancel& cancel);
  // Whether a wait costs the store nothing while it waits (the server
  // answers when the keys appear: the TCPStore client, on a connection of
  // its own for CancellableWait) rather than polling it (a file store, a
  // store made of functions). A caller that would otherwise look at a key
  // every few milliseconds waits for it instead when this is true.
  virtual bool waits_without_polling() const { return false; }
};

// ---- file store -----------------------------------------------------------

struct STRATA_EXPORT FileStoreOptions {
  static constexpr int kVersion = 1;
  int version = kVersion;
  // The directory; created (with its parents) when missing. Every rank must
  // name the same directory. Use a fresh directory per job: keys persist.
  std::string path;
  // Waiting (Get, Wait) polls the filesystem, starting at `min_poll` and
  // doubling up to `max_poll`. Taking the lock of Add/CompareSet, which
  // another client holds for a read and a rename, retries the same way
  // from 20 us (or `min_poll` if shorter).
  absl::Duration min_poll = absl::Microseconds(500);
  absl::Duration max_poll = absl::Milliseconds(20);
};

// A store kept as one file per key in a directory. Set writes a temporary
// file and renames it over the key's file (atomic on POSIX filesystems and
// NFS); Add and CompareSet hold an open-file-description lock
// (fcntl F_OFD_SETLK) on the key's lock file, so they are atomic across
// threads, processes and, on NFS with working locks, nodes. On NFS, mount
// with `lookupcache=positive` (or `none`) so that newly created keys are seen
// promptly. InvalidArgument when the options are bad, Unavailable (naming the
// path and errno) when the directory cannot be created or written.
STRATA_EXPORT absl::StatusOr<std::shared_ptr<Store>> OpenFileStore(const FileStoreOptions& options);

// ---- torch's TCPStore --------------------------------------------------------

struct STRATA_EXPORT TcpStoreOptions {
  static constexpr int kVersion = 1;
  int version = kVersion;
  // The server: under torchrun MASTER_ADDR:MASTER_PORT (the agent serves it).
  std::string host;
  int port = 0;
  // How long to try connecting (the server may not listen yet).
  absl::Duration connect_timeout = absl::Seconds(60);
  // Prepended to every key (the Python bindings' from_torch uses "strata/":
  // clients of both see the same keys).
  std::string prefix = "strata/";
};

// A client of a torch.distributed TCPStore server speaking its wire
// protocol itself: no LibTorch, no Python, so a thread that uses it (the
// elastic monitor's heartbeats) never takes Python's GIL. One connection,
// one request at a time: threads that wait long should each have their own.
// A Get or Wait past its deadline cancels its wait on the server and is
// DeadlineExceeded naming the keys; a request without an answer by its
// deadline, or a lost connection, is Unavailable naming the address (the
// next request connects again). InvalidArgument for bad options,
// Unavailable when no connection is made within connect_timeout.
STRATA_EXPORT absl::StatusOr<std::shared_ptr<Store>> ConnectTcpStore(
    const TcpStoreOptions& options);

// ---- memory store -------------------------------------------------------------

// A store in this process's memory: for ranks that are threads of one
// process (tests) and for a world of one rank.
STRATA_EXPORT std::shared_ptr<Store> MakeMemoryStore();

// ---- stores made of functions ----------------------------------------------

// The operations of a store as functions, for adapters (the Python bindings
// wrap torch.distributed stores with it). Each has the contract of the Store
// method of the same name; `describe` names the store. All must be set.
// The functions may be called from any thread, concurrently.
struct STRATA_EXPORT StoreCallbacks {
  static constexpr int kVersion = 1;
  int version = kVersion;
  std::function<absl::Status(absl::string_view key, absl::string_view value, absl::Time deadline)>
      set;
  std::function<absl::StatusOr<std::string>(absl::string_view key, absl::Time deadline)> get;
  std::function<absl::Status(absl::Span<const std::string> keys, absl::Time deadline)> wait;
  std::function<absl::StatusOr<int64_t>(absl::string_view key, int64_t delta, absl::Time deadline)>
      add;
  std::function<absl::StatusOr<std::string>(absl::string_view key, absl::string_view expected,
                                            absl::string_view desired, absl::Time deadline)>
      compare_set;
  std::string describe;
};

// InvalidArgument naming the first missing function.
STRATA_EXPORT absl::StatusOr<std::shared_ptr<Store>> MakeCallbackStore(StoreCallbacks callbacks);

// ---- helpers -----------------------------------------------------------------

// A view of `base` in which every key is prefixed with `prefix` + "/".
STRATA_EXPORT std::shared_ptr<Store> MakePrefixStore(std::shared_ptr<Store> base,
                                                     absl::string_view prefix);

// Opens a store from a URL: "file:/path/to/dir" (or "file:///path"). This is
// what the environment variable STRATA_STORE holds for the C++ bootstrap
// (see strata/comm/backend.h). InvalidArgument names an unknown scheme.
STRATA_EXPORT absl::StatusOr<std::shared_ptr<Store>> OpenStore(absl::string_view url);

}  // namespace strata
