// Host copies for the Gloo plugin: collectives among ranks of one host that
// read each other's buffers with process_vm_readv (cross-memory attach) and
// meet on a page of POSIX shared memory (HostBoard) instead of exchanging
// messages through Gloo's TCP transport: allreduce, allgather,
// reduce-scatter, broadcast and all-to-all, the operations whose rows in
// benchmarks/RESULTS.md (busbw_torchrun) show what they gain; the board
// also carries the point-to-point channels of host_p2p.h. gloo_plugin.cc
// says when a group uses them (Connect) and docs/launch.md describes the
// algorithms.
//
// Thread-safety: a HostGroup's collectives run on one thread at a time (the
// communicator's worker); Close may be called from any thread.
#pragma once

#include <time.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "comm/gloo/plugin_api.h"

namespace strata::gloo_plugin {

inline std::chrono::milliseconds Ms(int64_t ms) {
  return std::chrono::milliseconds(ms > 0 ? ms : 1);
}

// `count` elements split into `n` contiguous blocks, block b being
// [begin(b), begin(b + 1)).
struct Blocks {
  size_t count;
  int n;
  size_t begin(int b) const { return count * static_cast<size_t>(b) / static_cast<size_t>(n); }
  size_t len(int b) const { return begin(b + 1) - begin(b); }
};

// Milliseconds left until a deadline (at least one), for Gloo's waits.
class Deadline {
 public:
  explicit Deadline(int64_t timeout_ms) : end_(std::chrono::steady_clock::now() + Ms(timeout_ms)) {}
  bool passed() const { return std::chrono::steady_clock::now() >= end_; }
  std::chrono::milliseconds left() const {
    return Ms(std::chrono::duration_cast<std::chrono::milliseconds>(
                  end_ - std::chrono::steady_clock::now())
                  .count());
  }

 private:
  std::chrono::steady_clock::time_point end_;
};

// This process's probe word: random, read by peers to check that they can
// read this process's memory (and that the pid they were given is this
// process, not another one in a different pid namespace).
const uint64_t& ProbeWord();

// What a rank tells the others about itself for host copies.
struct HostRecord {
  int64_t pid = 0;
  uint64_t probe = 0;  // the address of its probe word
  uint64_t word = 0;   // the word's value
};

// STRATA_GLOO_CMA, spelled as the settings registry spells it
// (strata/base/settings.h, which libstrata checks before connecting; the
// plugin cannot link it and reads the variable itself). False, with
// `error` set, for a value that is not a boolean.
bool HostCopyWanted(Error* error);

// A failed host copy or round, with the Error code to report: kUnavailable
// (a peer is gone, or closed the group), kDeadlineExceeded,
// kInvalidArgument (ranks disagree on a size), kInternal (the kernel refused
// a read).
class HostCopyError : public std::runtime_error {
 public:
  HostCopyError(const std::string& what, int code) : std::runtime_error(what), code_(code) {}
  int code() const { return code_; }

 private:
  int code_;
};

// Copies `bytes` at `remote` in process `pid` into `local`; false (errno
// set) when the kernel refuses.
bool ReadRemote(int64_t pid, uint64_t remote, void* local, size_t bytes);
// Copies `bytes` at `local` to `remote` in process `pid`; as ReadRemote.
bool WriteRemote(int64_t pid, const void* local, uint64_t remote, size_t bytes);

// True when process `pid` has exited (gone, or a zombie its parent has not
// reaped yet).
bool ProcessGone(int64_t pid);

// The futex system call on a word of shared memory (not process-private).
long Futex(std::atomic<uint32_t>& word, int op, uint32_t value, const timespec* timeout);

// Messages in flight on one channel of host point-to-point (host_p2p.h).
// A pair's channel takes 16 KiB of the board (pages of shared memory are
// only allocated where a pair exchanges messages).
inline constexpr uint64_t kHostP2PSlots = 256;

// One message of a channel: both sides' buffers, and its state word
// (the message's number << 3 | a HostP2PState); host_p2p.h has the protocol.
struct alignas(64) HostP2PEntry {
  uint64_t send_addr;
  uint64_t send_bytes;
  uint64_t recv_addr;
  uint64_t recv_bytes;
  std::atomic<uint64_t> state;
  // The number + 1 of the last message of this entry each side finished:
  // the entry takes the next message once both moved on.
  std::atomic<uint64_t> sender_done;
  std::atomic<uint64_t> receiver_done;
};

enum HostP2PState : uint32_t {
  kP2POpen = 0,  // (or a number below the message's: not yet touched)
  kP2PSenderCopying = 1,
  kP2PReceiverCopying = 2,
  kP2PCopied = 3,
  kP2PCopyFailed = 4,
  kP2PSenderGaveUp = 5,
  kP2PReceiverGaveUp = 6,
};

// The messages from one rank to another: the counts of messages each side
// posted (`sends` written by the sender only, `recvs` by the receiver
// only, each on a cache line of its own), the posts of either side waiting
// for an entry to be finished (`post_waiters`: a finish rings the bells
// only when there are any) and the entries.
struct HostP2PChannel {
  alignas(64) std::atomic<uint64_t> sends;
  alignas(64) std::atomic<uint64_t> recvs;
  alignas(64) std::atomic<uint32_t> post_waiters;
  HostP2PEntry entries[kHostP2PSlots];
};

// What wakes a rank waiting for point-to-point messages.
struct alignas(64) HostBell {
  std::atomic<uint32_t> rings;     // the futex word
  std::atomic<uint32_t> sleepers;  // threads sleeping on it (no wake-up call without)
};

// The page of shared memory the ranks of a host-local group meet on.
class HostBoard {
 public:
  struct alignas(64) Header {
    std::atomic<uint32_t> closed;  // 1 + the first rank that closed the group, or 0
  };
  struct alignas(64) Slot {
    std::atomic<uint32_t> round;  // the last round this rank reached (a futex word)
    uint64_t in;                  // the addresses it published in that round
    uint64_t out;
    uint64_t bytes;  // and the size of its operation, which must be every rank's
  };

  // Rank 0: creates the page of an `n`-rank group; its name, or empty.
  static std::string Create(int n);
  // Maps the page `name`; null on failure.
  static std::unique_ptr<HostBoard> Open(const std::string& name, int n);
  // Removes the name (mappings stay valid).
  static void Unlink(const std::string& name);
  // Removes this user's boards whose creating process is gone (Create
  // calls it).
  static void RemoveOrphans();
  ~HostBoard();
  HostBoard(const HostBoard&) = delete;
  HostBoard& operator=(const HostBoard&) = delete;

  // The pages are zero-filled when created, which is every field's start.
  // After the collectives' slots come each rank's bell and the n x n
  // point-to-point channels (only the pages a job touches take memory).
  Header& header() { return *static_cast<Header*>(base_); }
  Slot& slot(int rank) {
    return reinterpret_cast<Slot*>(static_cast<char*>(base_) + sizeof(Header))[rank];
  }
  HostBell& bell(int rank) {
    return reinterpret_cast<HostBell*>(static_cast<char*>(base_) + BellsAt(n_))[rank];
  }
  HostP2PChannel& channel(int from, int to) {
    return reinterpret_cast<HostP2PChannel*>(static_cast<char*>(base_) +
                                             ChannelsAt(n_))[static_cast<size_t>(from) * n_ + to];
  }

 private:
  HostBoard(void* base, size_t bytes, int n) : base_(base), bytes_(bytes), n_(n) {}
  static size_t BellsAt(int n) { return sizeof(Header) + static_cast<size_t>(n) * sizeof(Slot); }
  static size_t ChannelsAt(int n) {
    const size_t end = BellsAt(n) + static_cast<size_t>(n) * sizeof(HostBell);
    return (end + alignof(HostP2PChannel) - 1) / alignof(HostP2PChannel) * alignof(HostP2PChannel);
  }
  static size_t Bytes(int n) {
    return ChannelsAt(n) + static_cast<size_t>(n) * static_cast<size_t>(n) * sizeof(HostP2PChannel);
  }
  void* base_;
  size_t bytes_;
  int n_;
};

// The collectives of one group whose ranks share a host. Each throws
// HostCopyError (or returns normally); sizes are as in plugin_api.h's
// Context, none zero.
class HostGroup {
 public:
  HostGroup(int rank, int size, std::vector<int64_t> pids, std::shared_ptr<HostBoard> board);

  void AllReduce(char* data, size_t count, size_t elem, const ReduceFn& fn,
                 const Deadline& deadline);
  void Broadcast(void* data, size_t bytes, int root, const Deadline& deadline);
  // `out` holds this rank's block already.
  void AllGather(char* out, size_t block_bytes, const Deadline& deadline);
  void ReduceScatter(const char* send, char* recv, size_t count, size_t elem, const ReduceFn& fn,
                     const Deadline& deadline);
  void AllToAll(const char* send, char* recv, size_t block_bytes, const Deadline& deadline);
  // Marks the group closed and wakes every rank waiting in a round (here
  // and in the peers): their operations fail, naming this rank.
  void Close();

 private:
  // Where a rank's buffers are.
  struct Region {
    uint64_t in = 0;
    uint64_t out = 0;
  };

  void Round(const Deadline& deadline);
  void ShareRegions(const void* in, const void* out, size_t bytes, const Deadline& deadline,
                    std::vector<Region>* at);
  // Returns once every rank reached its fence (one round): until then no
  // rank's buffers may change, because peers may still be reading them.
  void Fence(const Deadline& deadline) { Round(deadline); }
  void Pull(int peer, uint64_t remote, void* local, size_t bytes);
  void ReduceFromPeers(char* out, const char* mine, const std::vector<Region>& at, size_t offset,
                       size_t count, size_t elem, const ReduceFn& fn, std::vector<char>& scratch);

  const int rank_;
  const int size_;
  const std::vector<int64_t> pids_;  // each rank's process id
  const std::shared_ptr<HostBoard> board_;
  uint32_t round_ = 0;  // the last round this rank entered
};

}  // namespace strata::gloo_plugin
