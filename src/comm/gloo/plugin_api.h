// The boundary between libstrata and the Gloo plugin (libstrata_gloo.so).
//
// Why a plugin: the torch wheel's libtorch_cpu.so carries its own copy of
// Gloo and exports its gloo:: symbols with default visibility; Debian's
// libgloo.so.0 exports the same names for a different version of the code.
// When both copies sit in one lookup scope (a C++ trainer that links
// LibTorch and strata, or torch imported with RTLD_GLOBAL), the dynamic
// linker binds every gloo:: reference to whichever copy came first, and one
// library runs the other's code. So strata keeps every gloo:: reference out
// of libstrata: the Gloo code lives in this plugin, which libstrata loads
// with dlopen(RTLD_LOCAL | RTLD_DEEPBIND) so that the plugin and libgloo
// resolve gloo:: symbols in their own scope first, and that scope is never
// visible to anyone else. docs/nccl.md has the measurements.
//
// The plugin exports one C symbol, strata_gloo_plugin_api, which returns the
// function table below. Everything that crosses the boundary is plain C++
// (std::string, std::function, abstract classes with virtual functions);
// both sides are built by the same build with the same compiler. `Api::size`
// and `version` catch a plugin from another build.
//
// Thread-safety: Device is thread-safe. A Context's collectives must be
// called from one thread at a time (libstrata runs them on the
// communicator's worker thread); Send/Recv may be posted from that thread
// while a Pending is waited for on another; CloseConnections may be called
// from any thread at any time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace strata::gloo_plugin {

inline constexpr int kApiVersion = 5;

// An error: `code` is an absl::StatusCode value (0 is OK).
struct Error {
  int code = 0;
  std::string message;
  // For a connect that gave up waiting for one peer's connection (timed
  // out, or Gloo's own connect failed): that peer's rank; else -1.
  int peer = -1;
  bool ok() const { return code == 0; }
};

// absl::StatusCode values used by the plugin (it does not link abseil).
inline constexpr int kDeadlineExceeded = 4;
inline constexpr int kInvalidArgument = 3;
inline constexpr int kInternal = 13;
inline constexpr int kUnavailable = 14;
inline constexpr int kAborted = 10;

// The store, as the plugin's rendezvous sees it (implemented by libstrata,
// bounded by the connection's deadline).
class Rendezvous {
 public:
  virtual ~Rendezvous() = default;
  virtual Error Set(const std::string& key, const std::string& value) = 0;
  // Waits until `key` exists.
  virtual Error Get(const std::string& key, std::string* value) = 0;
  // True once the caller gave up on this connect (an abort of the
  // communicator being shrunk): the waits that are not the store's end
  // then too. Asked from another thread while Connect runs.
  virtual bool Cancelled() { return false; }
};

// The network device every context of a root communicator shares (one
// event-loop thread, joined when the last context using it is gone).
class Device {
 public:
  virtual ~Device() = default;
  virtual std::string Describe() const = 0;
};

struct DeviceOptions {
  // The network interface to use ("eth0"), or empty for `hostname`.
  std::string iface;
  // The host name or address to bind to; empty: this host's name.
  std::string hostname;
};

struct ConnectOptions {
  int rank = 0;
  int size = 1;
  int64_t timeout_ms = 0;
};

// out = a (op) b, elementwise over n elements; out may alias a or b.
using ReduceFn = std::function<void(void* out, const void* a, const void* b, size_t n)>;

// A posted point-to-point transfer.
class Pending {
 public:
  virtual ~Pending() = default;
  // Blocks until the transfer completed, failed, or `timeout_ms` passed.
  virtual Error Wait(int64_t timeout_ms) = 0;
  // Makes a Wait in progress return (with kAborted).
  virtual void Abort() = 0;
};

// A point-to-point message between ranks of one host (Context::HostSend,
// HostRecv), copied directly between the two ranks' buffers.
class HostTransfer {
 public:
  virtual ~HostTransfer() = default;
  // Waits until the message was copied, until `timeout_ms` or until
  // Suspend or Interrupt. Returns kAborted with finished() false when
  // suspended (a later Wait resumes); any other return is final and
  // repeated by later calls. After a final error no rank touches this
  // side's buffer again.
  virtual Error Wait(int64_t timeout_ms) = 0;
  // Makes the wait in progress, or the next, return (resumable).
  virtual void Suspend() = 0;
  // Makes the wait in progress, or the next, fail for good with kAborted,
  // unless the message was copied already. Once it returns no rank starts
  // copying from or into this side's buffer (the peer's wait fails).
  virtual void Interrupt() = 0;
  virtual bool finished() const = 0;
  // After a receive's successful Wait: the size the sender sent, in bytes
  // (the buffer holds the first min(sent, capacity) of them).
  virtual uint64_t sent_bytes() const = 0;
};

// One group's connections. Every collective blocks until done or until
// `timeout_ms` (kDeadlineExceeded); `tag` must be the same on every rank and
// differ between operations that could overlap. Sizes are in bytes or
// elements of `elem` bytes as named; none is zero.
class Context {
 public:
  virtual ~Context() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // In place on `data` (count x elem bytes).
  virtual Error AllReduce(void* data, size_t count, size_t elem, const ReduceFn& fn, uint32_t tag,
                          int64_t timeout_ms) = 0;
  virtual Error Broadcast(void* data, size_t bytes, int root, uint32_t tag, int64_t timeout_ms) = 0;
  // `recv` is written on `root` only.
  virtual Error Reduce(const void* send, void* recv, size_t count, size_t elem, const ReduceFn& fn,
                       int root, uint32_t tag, int64_t timeout_ms) = 0;
  // recv = size() blocks of `block_bytes`; `send` null: this rank's block of
  // recv is already in place.
  virtual Error AllGather(const void* send, void* recv, size_t block_bytes, uint32_t tag,
                          int64_t timeout_ms) = 0;
  // send = size() blocks of count x elem; recv (count x elem) gets block
  // rank() reduced over ranks. recv may be send's first block.
  virtual Error ReduceScatter(const void* send, void* recv, size_t count, size_t elem,
                              const ReduceFn& fn, uint32_t tag, int64_t timeout_ms) = 0;
  // send and recv (distinct) hold size() blocks of `block_bytes`.
  virtual Error AllToAll(const void* send, void* recv, size_t block_bytes, uint32_t tag,
                         int64_t timeout_ms) = 0;
  // Counts in elements per rank; send and recv distinct.
  virtual Error AllToAllV(const void* send, const std::vector<int64_t>& send_counts, void* recv,
                          const std::vector<int64_t>& recv_counts, size_t elem, uint32_t tag,
                          int64_t timeout_ms) = 0;
  virtual Error Barrier(uint32_t tag, int64_t timeout_ms) = 0;
  // Posts a transfer; messages between two ranks on one `slot` match in
  // the order they were posted.
  virtual Error Send(const void* data, size_t bytes, int peer, uint32_t slot,
                     std::unique_ptr<Pending>* out) = 0;
  virtual Error Recv(void* data, size_t bytes, int peer, uint32_t slot,
                     std::unique_ptr<Pending>* out) = 0;
  // With HostCopy() only: posts one message to / from `peer` (which may
  // be this rank); messages between two ranks match in the order they
  // were posted, whatever their sizes. Posting waits (until `timeout_ms`)
  // only while 256 messages of that pair are unfinished on either side.
  virtual Error HostSend(const void* data, size_t bytes, int peer, int64_t timeout_ms,
                         std::unique_ptr<HostTransfer>* out) = 0;
  virtual Error HostRecv(void* data, size_t capacity, int peer, int64_t timeout_ms,
                         std::unique_ptr<HostTransfer>* out) = 0;
  // Closes every connection: operations blocked in this context fail soon
  // after, here and (as "connection closed") on the peers.
  virtual void CloseConnections() = 0;
  // True when every rank of the group runs on this host and each can read
  // the others' memory (process_vm_readv; all ranks agree at connect, and
  // STRATA_GLOO_CMA=0 turns it off): AllReduce, AllGather, ReduceScatter,
  // Broadcast and AllToAll then copy directly between the ranks' buffers and
  // meet on a page of shared memory, and HostSend / HostRecv move
  // point-to-point messages the same way. Reduce, AllToAllV and Barrier use
  // Gloo's transport either way.
  virtual bool HostCopy() const = 0;
};

struct Api {
  int version = kApiVersion;
  size_t size = sizeof(Api);
  // The Gloo the plugin was built with: "0.5.0".
  const char* gloo_version = nullptr;
  Error (*create_device)(const DeviceOptions& options, std::shared_ptr<Device>* out) = nullptr;
  // Collective over `options.size` ranks: connects a full mesh among them,
  // exchanging addresses through `rendezvous` (keys are relative to it).
  Error (*connect)(const std::shared_ptr<Device>& device, const ConnectOptions& options,
                   Rendezvous& rendezvous, std::unique_ptr<Context>* out) = nullptr;
};

}  // namespace strata::gloo_plugin

// The plugin's one exported symbol: the table for `version`, or null when
// the plugin does not speak it.
extern "C" const strata::gloo_plugin::Api* strata_gloo_plugin_api(int version);
