// The Gloo plugin (libstrata_gloo.so): Gloo's TCP transport and collectives
// behind the table of plugin_api.h. libstrata loads it with
// dlopen(RTLD_LOCAL | RTLD_DEEPBIND); see plugin_api.h for why.
//
// Connecting a group (Connect): Gloo 0.5's TCP transport gives every pair
// of ranks its own listening socket, so rank i must learn, from every other
// rank j, the port of j's socket for i. Gloo's own connectFullMesh has every
// rank read every other rank's whole address list (O(N^2) bytes per rank).
// Here each rank publishes one compact record (its address and its N ports);
// rank 0 reads the N records and publishes, for each rank i, the column of
// addresses it needs; rank i reads that one key. Store operations: O(1) per
// rank, O(N) on rank 0; bytes read by rank i: O(N). The sockets themselves
// (N-1 per rank) are what Gloo's transport needs.
//
// Ranks on one host (host copies, host_copy.h): when every rank of a group
// can read every other's memory with process_vm_readv (Linux cross-memory
// attach: same host, same user, no ptrace restriction in the way),
// allreduce, allgather, reduce-scatter, broadcast and all-to-all skip TCP:
// each rank copies what it needs straight out of its peers' buffers (one
// copy, by the reader, instead of TCP's two through the kernel's socket
// buffers), and the ranks publish their buffers' addresses and fence on a
// page of POSIX shared memory (futex rounds) instead of exchanging messages,
// each of which costs a notify and a transfer between Gloo threads.
// Point-to-point messages take the same page (HostSend / HostRecv,
// host_p2p.h): one copy from the sender's buffer into the receiver's. Reduce,
// all-to-all-v and barrier stay on Gloo's transport: no benchmark row
// measures them (benchmarks/RESULTS.md, busbw_torchrun, has a row for each
// path kept). Connect decides: each rank publishes its pid and the address
// of a random word; every rank reads every peer's word and maps rank 0's
// page, and the group agrees (one round of messages) to use host copies
// only if every rank could. STRATA_GLOO_CMA=0 turns them off (for
// comparison, or where a security policy forbids them); libstrata checks
// its spelling through the settings registry before connecting, and this
// plugin, which cannot link libstrata, reads it itself.
//
// Over Gloo's transport (several hosts, more than 32 ranks, or host copies
// off), strata's own algorithms replace Gloo's where the STRATA_GLOO_CMA=0
// rows of busbw_torchrun show them faster (see kOwnAlgorithmRanks).
#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/alltoall.h>
#include <gloo/alltoallv.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/config.h>
#include <gloo/context.h>
#include <gloo/reduce.h>
#include <gloo/transport/context.h>
#include <gloo/transport/tcp/address.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "comm/gloo/plugin/connect_watch.h"
#include "comm/gloo/plugin/host_copy.h"
#include "comm/gloo/plugin/host_p2p.h"
#include "comm/gloo/plugin/loop_waker.h"
#include "comm/gloo/plugin_api.h"

namespace strata::gloo_plugin {
namespace {

// Slot prefixes of strata's own transfers, above Gloo's (0x01-0x08).
constexpr uint8_t kReduceScatterSlotPrefix = 0xf1;
constexpr uint8_t kUserSlotPrefix = 0xf2;
constexpr uint8_t kAllGatherSlotPrefix = 0xf3;
constexpr uint8_t kAllReduceSlotPrefix = 0xf4;
constexpr uint8_t kHostAgreeSlotPrefix = 0xf7;
// Up to this many ranks, strata's own algorithms run instead of Gloo's:
// allgather exchanges every block directly (one round: each rank posts its
// sends and receives at once) instead of a ring of 2 (size - 1) dependent
// steps, each rank sending and receiving the same bytes either way; and
// allreduce is a ring reduce-scatter followed by that allgather, or, up to
// kDirectAllReduceBytes, one direct exchange of the whole buffers, which
// every rank then reduces in rank order (so all get the same bits). From
// kOwnAllReduceMaxBytes on, Gloo's ring allreduce is as fast or faster
// (4 ranks on 2 cores: level at 4 MiB, 0.85-1.0x the time at 16 MiB; a
// direct reduce-scatter instead of the ring measured slower from 1 MiB).
constexpr int kOwnAlgorithmRanks = 32;
constexpr size_t kDirectAllReduceBytes = size_t{64} << 10;
constexpr size_t kOwnAllReduceMaxBytes = size_t{4} << 20;
#define STRATA_GLOO_STR2(x) #x
#define STRATA_GLOO_STR(x) STRATA_GLOO_STR2(x)
constexpr const char* kGlooVersion = STRATA_GLOO_STR(GLOO_VERSION_MAJOR) "." STRATA_GLOO_STR(
    GLOO_VERSION_MINOR) "." STRATA_GLOO_STR(GLOO_VERSION_PATCH);

// Turns what Gloo throws into an Error: its timeouts say "Timed out"; other
// I/O errors are lost or closed connections.
Error FromException(const std::exception& e, const std::string& what) {
  const std::string msg = e.what();
  if (const auto* h = dynamic_cast<const HostCopyError*>(&e); h != nullptr) {
    return {h->code(), what + ": " + msg};
  }
  if (dynamic_cast<const ::gloo::IoException*>(&e) != nullptr) {
    if (msg.find("Timed out") != std::string::npos) {
      return {kDeadlineExceeded, what + ": timed out in Gloo (" + msg + ")"};
    }
    return {kUnavailable, what + ": connection lost (" + msg + ")"};
  }
  return {kInternal, what + ": " + msg};
}

template <typename F>
Error Guard(const std::string& what, F&& f) {
  try {
    f();
    return {};
  } catch (const std::exception& e) {
    return FromException(e, what);
  }
}

// Calls f(T{}) with an unsigned integer type of `elem` bytes: Gloo's
// options take typed pointers, but only their size matters to it.
template <typename F>
Error BySize(size_t elem, F&& f) {
  switch (elem) {
    case 1:
      return f(uint8_t{});
    case 2:
      return f(uint16_t{});
    case 4:
      return f(uint32_t{});
    case 8:
      return f(uint64_t{});
    default:
      return {kInvalidArgument, "element size " + std::to_string(elem) + " is not 1, 2, 4 or 8"};
  }
}

class TcpDevice final : public Device {
 public:
  explicit TcpDevice(std::shared_ptr<::gloo::transport::Device> device)
      : device_(std::move(device)) {
    if (auto tcp = std::dynamic_pointer_cast<::gloo::transport::tcp::Device>(device_)) {
      waker_ = std::make_shared<LoopWaker>(std::move(tcp));
    }
  }
  std::string Describe() const override { return device_->str(); }
  std::shared_ptr<::gloo::transport::Device>& get() { return device_; }
  // Null when the device is not Gloo's TCP device.
  const std::shared_ptr<LoopWaker>& waker() const { return waker_; }

 private:
  std::shared_ptr<::gloo::transport::Device> device_;
  std::shared_ptr<LoopWaker> waker_;
};

// gloo::Context with the connections strata made (its members are
// protected).
class MeshContext final : public ::gloo::Context {
 public:
  MeshContext(int rank, int size) : ::gloo::Context(rank, size) {}
  void Adopt(std::shared_ptr<::gloo::transport::Device> device,
             std::shared_ptr<::gloo::transport::Context> transport) {
    device_ = std::move(device);
    transportContext_ = std::move(transport);
  }
};

class UnboundPending final : public Pending {
 public:
  UnboundPending(std::unique_ptr<::gloo::transport::UnboundBuffer> buf, bool send, int peer)
      : buf_(std::move(buf)), send_(send), peer_(peer) {}
  Error Wait(int64_t timeout_ms) override {
    const std::string what =
        std::string(send_ ? "send to" : "recv from") + " rank " + std::to_string(peer_);
    bool completed = false;
    Error e = Guard(what, [&] {
      completed = send_ ? buf_->waitSend(Ms(timeout_ms)) : buf_->waitRecv(Ms(timeout_ms));
    });
    if (e.ok() && !completed) return {kAborted, what + ": aborted"};
    return e;
  }
  void Abort() override {
    if (send_) {
      buf_->abortWaitSend();
    } else {
      buf_->abortWaitRecv();
    }
  }

 private:
  std::unique_ptr<::gloo::transport::UnboundBuffer> buf_;
  const bool send_;
  const int peer_;
};

class GlooContext final : public Context {
 public:
  GlooContext(std::shared_ptr<MeshContext> ctx,
              std::shared_ptr<::gloo::transport::Context> transport,
              std::unique_ptr<HostGroup> host, std::shared_ptr<HostP2P> p2p,
              std::shared_ptr<LoopWaker> waker)
      : waker_(std::move(waker)),
        ctx_(std::move(ctx)),
        transport_(std::move(transport)),
        host_(std::move(host)),
        p2p_(std::move(p2p)) {}

  ~GlooContext() override {
    // Pairs still connected close here, each taken off the event loop.
    Ticking ticking(waker_.get());
    p2p_.reset();
    host_.reset();
    ctx_.reset();
    transport_.reset();
  }

  int rank() const override { return ctx_->rank; }
  int size() const override { return ctx_->size; }
  bool HostCopy() const override { return host_ != nullptr; }

  // Collective, once after connecting: host copies are used when every rank
  // could read every other and map the board (`mine`: this rank could).
  Error AgreeHostCopy(bool mine, int64_t timeout_ms) {
    mine = mine && host_ != nullptr;
    const int n = ctx_->size;
    std::vector<char> flags(static_cast<size_t>(n), 0);
    flags[static_cast<size_t>(ctx_->rank)] = mine ? 1 : 0;
    const Deadline deadline(timeout_ms);
    Error e = Run("connect: agreeing on host copies", [&] {
      return ExchangeBlocks(flags.data(), Blocks{flags.size(), n}, 1,
                            ::gloo::Slot::build(kHostAgreeSlotPrefix, 0), deadline);
    });
    if (!e.ok()) return e;
    if (!std::all_of(flags.begin(), flags.end(), [](char f) { return f == 1; })) {
      host_.reset();
      p2p_.reset();
    }
    return {};
  }

  Error AllReduce(void* data, size_t count, size_t elem, const ReduceFn& fn, uint32_t tag,
                  int64_t timeout_ms) override {
    const int n = ctx_->size;
    if (host_ != nullptr) {
      if (count == 0) return {};
      return OnHost("allreduce", timeout_ms, [&](const Deadline& d) {
        host_->AllReduce(static_cast<char*>(data), count, elem, fn, d);
      });
    }
    if (n > kOwnAlgorithmRanks || count * elem >= kOwnAllReduceMaxBytes) {
      return BySize(elem, [&](auto t) {
        using T = decltype(t);
        return Guard("allreduce", [&] {
          ::gloo::AllreduceOptions opts(ctx_);
          opts.setOutput(static_cast<T*>(data), count);
          opts.setReduceFunction(fn);
          opts.setTag(tag);
          opts.setTimeout(Ms(timeout_ms));
          ::gloo::allreduce(opts);
        });
      });
    }
    if (n == 1 || count == 0) return {};
    char* out = static_cast<char*>(data);
    const size_t bytes = count * elem;
    const Deadline deadline(timeout_ms);
    const uint64_t slot = ::gloo::Slot::build(kAllReduceSlotPrefix, tag);
    if (bytes <= kDirectAllReduceBytes || count < static_cast<size_t>(n)) {
      std::vector<char> all(bytes * static_cast<size_t>(n));
      std::memcpy(all.data() + static_cast<size_t>(ctx_->rank) * bytes, out, bytes);
      Error e = Run("allreduce", [&] {
        return ExchangeBlocks(all.data(), Blocks{all.size(), n}, 1, slot, deadline);
      });
      if (!e.ok()) return e;
      std::memcpy(out, all.data(), bytes);
      for (int k = 1; k < n; ++k) fn(out, out, all.data() + static_cast<size_t>(k) * bytes, count);
      return {};
    }
    const Blocks blocks{count, n};
    return Run("allreduce", [&] {
      return RingReduceScatter(out, blocks, elem, fn, slot, deadline) &&
             ExchangeBlocks(out, blocks, elem, ::gloo::Slot::build(kAllGatherSlotPrefix, tag),
                            deadline);
    });
  }

  Error Broadcast(void* data, size_t bytes, int root, uint32_t tag, int64_t timeout_ms) override {
    if (host_ != nullptr) {
      return OnHost("broadcast", timeout_ms,
                    [&](const Deadline& d) { host_->Broadcast(data, bytes, root, d); });
    }
    return Guard("broadcast", [&] {
      ::gloo::BroadcastOptions opts(ctx_);
      opts.setOutput(static_cast<uint8_t*>(data), bytes);
      opts.setRoot(root);
      opts.setTag(tag);
      opts.setTimeout(Ms(timeout_ms));
      ::gloo::broadcast(opts);
    });
  }

  Error Reduce(const void* send, void* recv, size_t count, size_t elem, const ReduceFn& fn,
               int root, uint32_t tag, int64_t timeout_ms) override {
    // Gloo's ring reduce uses the output on every rank as scratch.
    std::vector<char> scratch;
    if (ctx_->rank != root) {
      scratch.resize(count * elem);
      recv = scratch.data();
    }
    return BySize(elem, [&](auto t) {
      using T = decltype(t);
      return Guard("reduce", [&] {
        ::gloo::ReduceOptions opts(ctx_);
        if (send != recv) opts.setInput(const_cast<T*>(static_cast<const T*>(send)), count);
        opts.setOutput(static_cast<T*>(recv), count);
        opts.setRoot(root);
        opts.setReduceFunction(fn);
        opts.setTag(tag);
        opts.setTimeout(Ms(timeout_ms));
        ::gloo::reduce(opts);
      });
    });
  }

  Error AllGather(const void* send, void* recv, size_t block_bytes, uint32_t tag,
                  int64_t timeout_ms) override {
    const int n = ctx_->size;
    if (n > kOwnAlgorithmRanks) {
      return Guard("allgather", [&] {
        ::gloo::AllgatherOptions opts(ctx_);
        if (send != nullptr) {
          opts.setInput(const_cast<uint8_t*>(static_cast<const uint8_t*>(send)), block_bytes);
        }
        opts.setOutput(static_cast<uint8_t*>(recv), block_bytes * static_cast<size_t>(n));
        opts.setTag(tag);
        opts.setTimeout(Ms(timeout_ms));
        ::gloo::allgather(opts);
      });
    }
    char* out = static_cast<char*>(recv);
    if (send != nullptr && block_bytes > 0) {
      std::memcpy(out + static_cast<size_t>(ctx_->rank) * block_bytes, send, block_bytes);
    }
    if (n == 1 || block_bytes == 0) return {};
    if (host_ != nullptr) {
      return OnHost("allgather", timeout_ms,
                    [&](const Deadline& d) { host_->AllGather(out, block_bytes, d); });
    }
    const Deadline deadline(timeout_ms);
    return Run("allgather", [&] {
      return ExchangeBlocks(out, Blocks{block_bytes * static_cast<size_t>(n), n}, 1,
                            ::gloo::Slot::build(kAllGatherSlotPrefix, tag), deadline);
    });
  }

  Error ReduceScatter(const void* send, void* recv, size_t count, size_t elem, const ReduceFn& fn,
                      uint32_t tag, int64_t timeout_ms) override {
    const int n = ctx_->size;
    const size_t block = count * elem;
    if (host_ != nullptr) {
      return OnHost("reduce_scatter", timeout_ms, [&](const Deadline& d) {
        host_->ReduceScatter(static_cast<const char*>(send), static_cast<char*>(recv), count, elem,
                             fn, d);
      });
    }
    std::vector<char> acc(static_cast<const char*>(send),
                          static_cast<const char*>(send) + block * static_cast<size_t>(n));
    const Deadline deadline(timeout_ms);
    Error e = Run("reduce_scatter", [&] {
      return RingReduceScatter(acc.data(), Blocks{count * static_cast<size_t>(n), n}, elem, fn,
                               ::gloo::Slot::build(kReduceScatterSlotPrefix, tag), deadline);
    });
    if (!e.ok()) return e;
    std::memcpy(recv, acc.data() + static_cast<size_t>(ctx_->rank) * block, block);
    return {};
  }

  Error AllToAll(const void* send, void* recv, size_t block_bytes, uint32_t tag,
                 int64_t timeout_ms) override {
    if (host_ != nullptr) {
      return OnHost("all_to_all", timeout_ms, [&](const Deadline& d) {
        host_->AllToAll(static_cast<const char*>(send), static_cast<char*>(recv), block_bytes, d);
      });
    }
    return Guard("all_to_all", [&] {
      const size_t bytes = block_bytes * static_cast<size_t>(ctx_->size);
      ::gloo::AlltoallOptions opts(ctx_);
      opts.setInput(const_cast<uint8_t*>(static_cast<const uint8_t*>(send)), bytes);
      opts.setOutput(static_cast<uint8_t*>(recv), bytes);
      opts.setTag(tag);
      opts.setTimeout(Ms(timeout_ms));
      ::gloo::alltoall(opts);
    });
  }

  Error AllToAllV(const void* send, const std::vector<int64_t>& send_counts, void* recv,
                  const std::vector<int64_t>& recv_counts, size_t elem, uint32_t tag,
                  int64_t timeout_ms) override {
    return BySize(elem, [&](auto t) {
      using T = decltype(t);
      return Guard("all_to_all_v", [&] {
        ::gloo::AlltoallvOptions opts(ctx_);
        opts.setInput(const_cast<T*>(static_cast<const T*>(send)), send_counts);
        opts.setOutput(static_cast<T*>(recv), recv_counts);
        opts.setTag(tag);
        opts.setTimeout(Ms(timeout_ms));
        ::gloo::alltoallv(opts);
      });
    });
  }

  Error Barrier(uint32_t tag, int64_t timeout_ms) override {
    return Guard("barrier", [&] {
      ::gloo::BarrierOptions opts(ctx_);
      opts.setTag(tag);
      opts.setTimeout(Ms(timeout_ms));
      ::gloo::barrier(opts);
    });
  }

  Error Send(const void* data, size_t bytes, int peer, uint32_t slot,
             std::unique_ptr<Pending>* out) override {
    return Guard("send", [&] {
      auto buf = ctx_->createUnboundBuffer(const_cast<void*>(data), bytes);
      buf->send(peer, ::gloo::Slot::build(kUserSlotPrefix, slot), 0, bytes);
      *out = std::make_unique<UnboundPending>(std::move(buf), true, peer);
    });
  }

  Error Recv(void* data, size_t bytes, int peer, uint32_t slot,
             std::unique_ptr<Pending>* out) override {
    return Guard("recv", [&] {
      auto buf = ctx_->createUnboundBuffer(data, bytes);
      buf->recv(peer, ::gloo::Slot::build(kUserSlotPrefix, slot), 0, bytes);
      *out = std::make_unique<UnboundPending>(std::move(buf), false, peer);
    });
  }

  Error HostSend(const void* data, size_t bytes, int peer, int64_t timeout_ms,
                 std::unique_ptr<HostTransfer>* out) override {
    if (p2p_ == nullptr) return {kInternal, "send: this group does not use host copies"};
    return p2p_->Send(data, bytes, peer, timeout_ms, out);
  }

  Error HostRecv(void* data, size_t capacity, int peer, int64_t timeout_ms,
                 std::unique_ptr<HostTransfer>* out) override {
    if (p2p_ == nullptr) return {kInternal, "recv: this group does not use host copies"};
    return p2p_->Recv(data, capacity, peer, timeout_ms, out);
  }

  void CloseConnections() override {
    // Wakes the ranks waiting in a round or for a point-to-point message.
    if (host_ != nullptr) host_->Close();
    Ticking ticking(waker_.get());  // each pair closes off the event loop
    if (FailPairs(transport_.get(),
                  "strata closed this communicator's connections (abort, revoke or shutdown)")) {
      return;
    }
    try {
      ctx_->closeConnections();
    } catch (const std::exception&) {
    }
  }

 private:
  // Runs host-copy collective `f(deadline)`, turning what it throws into an
  // Error.
  template <typename F>
  static Error OnHost(const std::string& what, int64_t timeout_ms, F&& f) {
    const Deadline deadline(timeout_ms);
    return Guard(what, [&] { f(deadline); });
  }

  // Runs `f` (true: done; false: a wait was aborted), turning what Gloo
  // throws into an Error.
  template <typename F>
  static Error Run(const std::string& what, F&& f) {
    bool done = false;
    Error e = Guard(what, [&] { done = f(); });
    if (e.ok() && !done) return {kAborted, what + ": aborted"};
    return e;
  }

  // Every rank's block of `out` to every other rank, in one round: each
  // posts all its receives and sends, nearest peers first (as Gloo's
  // alltoall), then waits. False if a wait was aborted; throws on errors.
  bool ExchangeBlocks(char* out, const Blocks& blocks, size_t elem, uint64_t slot,
                      const Deadline& deadline) {
    const int n = ctx_->size, r = ctx_->rank;
    auto buf = ctx_->createUnboundBuffer(out, blocks.count * elem);
    for (int i = 1; i < n; ++i) {
      const int to = (r + i) % n, from = (r + n - i) % n;
      buf->recv(from, slot, blocks.begin(from) * elem, blocks.len(from) * elem);
      buf->send(to, slot, blocks.begin(r) * elem, blocks.len(r) * elem);
    }
    for (int i = 1; i < n; ++i) {
      if (!buf->waitRecv(deadline.left()) || !buf->waitSend(deadline.left())) return false;
    }
    return true;
  }

  // A ring reduce-scatter in place: at step s, rank r sends its partial
  // sum of block (r - s - 1) to r + 1 and adds the block (r - s - 2) that
  // r - 1 sent into its own; after size - 1 steps block r of `data` holds
  // every rank's contribution. Each rank sends (size - 1) blocks, the least
  // any reduce-scatter can. (Sending blocks in segments, each passed on as
  // soon as it is added, measured slower on 4 ranks sharing 2 cores: the
  // extra transfers cost more wake-ups than the overlap saves.) False if a
  // wait was aborted; throws on errors.
  bool RingReduceScatter(char* data, const Blocks& blocks, size_t elem, const ReduceFn& fn,
                         uint64_t slot, const Deadline& deadline) {
    const int n = ctx_->size, r = ctx_->rank;
    std::vector<char> incoming((blocks.count / static_cast<size_t>(n) + 1) * elem);
    auto data_buf = ctx_->createUnboundBuffer(data, blocks.count * elem);
    auto in_buf = ctx_->createUnboundBuffer(incoming.data(), incoming.size());
    const int next = (r + 1) % n, prev = (r + n - 1) % n;
    for (int s = 0; s < n - 1; ++s) {
      const int out_block = ((r - s - 1) % n + n) % n;
      const int in_block = ((r - s - 2) % n + 2 * n) % n;
      in_buf->recv(prev, slot, 0, blocks.len(in_block) * elem);
      data_buf->send(next, slot, blocks.begin(out_block) * elem, blocks.len(out_block) * elem);
      if (!in_buf->waitRecv(deadline.left())) return false;
      char* target = data + blocks.begin(in_block) * elem;
      fn(target, target, incoming.data(), blocks.len(in_block));
      if (!data_buf->waitSend(deadline.left())) return false;
    }
    return true;
  }

  std::shared_ptr<LoopWaker> waker_;  // destroyed last: the others use its loop
  std::shared_ptr<MeshContext> ctx_;
  std::shared_ptr<::gloo::transport::Context> transport_;
  // Host copies (null when the group does not use them; set before the
  // context is handed out, so CloseConnections may read it from any thread).
  std::unique_ptr<HostGroup> host_;
  std::shared_ptr<HostP2P> p2p_;  // on the same board as host_
};

// ---- connecting -------------------------------------------------------------

// A rank's record: its socket address (with port 0), its host record, and,
// for each rank of the group, the port of its socket for that rank (0 for
// itself).
std::string EncodeRecord(const sockaddr_storage& ss, const HostRecord& host,
                         const std::vector<uint16_t>& ports) {
  std::string out(reinterpret_cast<const char*>(&ss), sizeof(ss));
  out.append(reinterpret_cast<const char*>(&host), sizeof(host));
  out.append(reinterpret_cast<const char*>(ports.data()), ports.size() * sizeof(uint16_t));
  return out;
}

// What rank i learns about each peer j: where to connect, and j's host
// record; after the entries, the name of the group's board (kBoardName
// bytes, zero-padded; empty: none).
constexpr size_t kColumnEntry = sizeof(sockaddr_storage) + sizeof(HostRecord);
constexpr size_t kBoardName = 64;

// Rank 0's board name, unlinked when Connect returns: by then every rank
// has mapped it or given up on host copies (the agreement comes after).
class BoardName {
 public:
  ~BoardName() {
    if (!name.empty()) HostBoard::Unlink(name);
  }
  std::string name;
};

uint16_t PortOf(const sockaddr_storage& ss) {
  if (ss.ss_family == AF_INET6) return reinterpret_cast<const sockaddr_in6*>(&ss)->sin6_port;
  return reinterpret_cast<const sockaddr_in*>(&ss)->sin_port;
}

void SetPort(sockaddr_storage* ss, uint16_t port) {
  if (ss->ss_family == AF_INET6) {
    reinterpret_cast<sockaddr_in6*>(ss)->sin6_port = port;
  } else {
    reinterpret_cast<sockaddr_in*>(ss)->sin_port = port;
  }
}

Error Connect(const std::shared_ptr<Device>& device, const ConnectOptions& options, Rendezvous& rv,
              std::unique_ptr<Context>* out) {
  auto* tcp = dynamic_cast<TcpDevice*>(device.get());
  if (tcp == nullptr) return {kInvalidArgument, "connect: not a device of this plugin"};
  const int n = options.size, me = options.rank;
  const Deadline deadline(options.timeout_ms);
  auto ctx = std::make_shared<MeshContext>(me, n);
  ctx->setTimeout(Ms(options.timeout_ms));
  std::shared_ptr<::gloo::transport::Context> transport;
  sockaddr_storage self{};
  std::vector<uint16_t> ports(static_cast<size_t>(n), 0);
  Error e = Guard("connect: creating sockets", [&] {
    transport = tcp->get()->createContext(me, n);
    transport->setTimeout(Ms(options.timeout_ms));
    for (int i = 0; i < n; ++i) {
      if (i == me) continue;
      auto& pair = transport->createPair(i);
      const auto& addr = dynamic_cast<const ::gloo::transport::tcp::Address&>(pair->address());
      self = addr.getSockaddr();
      ports[static_cast<size_t>(i)] = PortOf(self);
    }
  });
  if (!e.ok()) return e;
  std::vector<int64_t> pids(static_cast<size_t>(n), 0);
  pids[static_cast<size_t>(me)] = static_cast<int64_t>(getpid());
  Error setting;
  bool can_read_peers = HostCopyWanted(&setting) && n <= kOwnAlgorithmRanks;
  if (!setting.ok()) return setting;
  BoardName board_name;
  std::unique_ptr<HostBoard> board;
  // The waits after the store's are Gloo's (a peer's connect, the
  // agreement's messages): the watch ends them when the caller gives up
  // or the deadline passes (connect_watch.h).
  std::unique_ptr<ConnectWatch> watch;
  std::string waiting_for;  // what the waits were for, when the watch ended them
  int waiting_peer = -1;    // the peer whose connection they were for, if one
  auto given_up = [&](const Error& e) -> Error {
    switch (watch == nullptr ? ConnectWatch::Why::kNone : watch->why()) {
      case ConnectWatch::Why::kCancelled:
        // Not the peer's doing: the caller gave up.
        return {kAborted, "connect: gave up " + waiting_for +
                              " (cancelled: the communicator it is made from was"
                              " aborted, or RootOptions::cancelled said so)"};
      case ConnectWatch::Why::kDeadline:
        return {kDeadlineExceeded,
                "connect: " + waiting_for + ": not done within " +
                    std::to_string(options.timeout_ms) + " ms (is that rank alive and reachable?)",
                waiting_peer};
      case ConnectWatch::Why::kNone:
        break;
    }
    if (e.ok()) return e;
    return {e.code, e.message, waiting_peer};
  };
  if (n > 1) {
    SetPort(&self, 0);
    HostRecord host;
    host.pid = static_cast<int64_t>(getpid());
    host.probe = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(&ProbeWord()));
    host.word = ProbeWord();
    e = rv.Set("a/" + std::to_string(me), EncodeRecord(self, host, ports));
    if (!e.ok()) return e;
    if (me == 0) {
      if (can_read_peers) board_name.name = HostBoard::Create(n);
      // Rank 0 turns the records (rows) into per-destination columns.
      std::vector<std::string> columns(static_cast<size_t>(n));
      const size_t record =
          sizeof(sockaddr_storage) + sizeof(HostRecord) + static_cast<size_t>(n) * sizeof(uint16_t);
      for (int j = 0; j < n; ++j) {
        std::string rec;
        e = rv.Get("a/" + std::to_string(j), &rec);
        if (!e.ok()) return e;
        if (rec.size() != record) {
          return {kInvalidArgument, "connect: rank " + std::to_string(j) +
                                        " published a record of " + std::to_string(rec.size()) +
                                        " bytes, expected " + std::to_string(record) +
                                        " (do all ranks agree on the group size?)"};
        }
        const char* host_part = rec.data() + sizeof(sockaddr_storage);
        const char* port_part = host_part + sizeof(HostRecord);
        for (int i = 0; i < n; ++i) {
          if (i == j) continue;
          sockaddr_storage ss;
          std::memcpy(&ss, rec.data(), sizeof(ss));
          uint16_t port;
          std::memcpy(&port, port_part + static_cast<size_t>(i) * sizeof(port), sizeof(port));
          SetPort(&ss, port);
          std::string& column = columns[static_cast<size_t>(i)];
          column.append(reinterpret_cast<const char*>(&ss), sizeof(ss));
          column.append(host_part, sizeof(HostRecord));
        }
      }
      for (int i = 0; i < n; ++i) {
        std::string& column = columns[static_cast<size_t>(i)];
        column.append(board_name.name);
        column.resize(static_cast<size_t>(n - 1) * kColumnEntry + kBoardName, '\0');
        e = rv.Set("c/" + std::to_string(i), column);
        if (!e.ok()) return e;
      }
    }
    std::string column;
    e = rv.Get("c/" + std::to_string(me), &column);
    if (!e.ok()) return e;
    if (column.size() != static_cast<size_t>(n - 1) * kColumnEntry + kBoardName) {
      return {kInternal, "connect: column of " + std::to_string(column.size()) + " bytes"};
    }
    const std::string name(column.c_str() + static_cast<size_t>(n - 1) * kColumnEntry);
    watch = std::make_unique<ConnectWatch>(
        deadline.left().count(), [&rv] { return rv.Cancelled(); },
        [transport, me, n] {
          if (FailPairs(transport.get(), "strata gave up connecting this group")) return;
          for (int j = 0; j < n; ++j) {
            if (j != me) transport->getPair(j)->close();
          }
        });
    e = Guard("connect: connecting to the peers", [&] {
      // A pair that connects as the client first takes its listening
      // socket off the event loop.
      Ticking ticking(tcp->waker().get());
      size_t k = 0;
      for (int j = 0; j < n; ++j) {
        if (j == me) continue;
        const char* entry = column.data() + k++ * kColumnEntry;
        sockaddr_storage ss;
        std::memcpy(&ss, entry, sizeof(ss));
        HostRecord host;
        std::memcpy(&host, entry + sizeof(ss), sizeof(host));
        pids[static_cast<size_t>(j)] = host.pid;
        if (can_read_peers) {
          uint64_t word = 0;
          can_read_peers =
              ReadRemote(host.pid, host.probe, &word, sizeof(word)) && word == host.word;
        }
        ::gloo::transport::tcp::Address peer(ss);
        waiting_for =
            "waiting for rank " + std::to_string(j) + " of " + std::to_string(n) + " to connect";
        waiting_peer = j;
        transport->getPair(j)->connect(peer.bytes());
      }
      waiting_peer = -1;
    });
    e = given_up(e);
    if (!e.ok()) return e;
    if (can_read_peers && !name.empty()) board = HostBoard::Open(name, n);
  }
  ctx->Adopt(tcp->get(), transport);
  std::unique_ptr<HostGroup> host;
  std::shared_ptr<HostP2P> p2p;
  if (can_read_peers && board != nullptr) {
    std::shared_ptr<HostBoard> shared = std::move(board);
    p2p = std::make_shared<HostP2P>(me, n, pids, shared);
    host = std::make_unique<HostGroup>(me, n, std::move(pids), std::move(shared));
  }
  const bool can_share = host != nullptr;
  auto context = std::make_unique<GlooContext>(std::move(ctx), std::move(transport),
                                               std::move(host), std::move(p2p), tcp->waker());
  // Every rank knows n, so all skip the agreement alike.
  if (n > 1 && n <= kOwnAlgorithmRanks) {
    waiting_for = "agreeing with the peers on host copies";
    waiting_peer = -1;
    e = context->AgreeHostCopy(can_share, deadline.left().count());
  }
  if (watch != nullptr) watch->Stop();
  e = given_up(e);
  if (!e.ok()) return e;
  *out = std::move(context);
  return {};
}

Error CreateDevice(const DeviceOptions& options, std::shared_ptr<Device>* out) {
  return Guard("creating the Gloo TCP device", [&] {
    ::gloo::transport::tcp::attr attr;
    attr.iface = options.iface;
    attr.hostname = options.hostname;
    *out = std::make_shared<TcpDevice>(::gloo::transport::tcp::CreateDevice(attr));
  });
}

const Api kApi = [] {
  Api api;
  api.gloo_version = kGlooVersion;
  api.create_device = &CreateDevice;
  api.connect = &Connect;
  return api;
}();

}  // namespace
}  // namespace strata::gloo_plugin

extern "C" __attribute__((visibility("default"))) const strata::gloo_plugin::Api*
strata_gloo_plugin_api(int version) {
  return version == strata::gloo_plugin::kApiVersion ? &strata::gloo_plugin::kApi : nullptr;
}
