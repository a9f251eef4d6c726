// Point-to-point messages among the ranks of one host for the Gloo plugin
// (host copies, host_copy.h): each message is copied once, directly from
// the sender's buffer into the receiver's, by whichever of the two ranks
// finishes it first (process_vm_readv by the receiver, process_vm_writev by
// the sender), and the ranks meet on the group's page of shared memory
// instead of exchanging messages through Gloo's TCP transport.
//
// The k-th message from rank s to rank d uses entry k % kHostP2PSlots of
// the channel s -> d on the board:
//   post    each side writes its buffer's address and size into the entry,
//           then counts the message (the channel's `sends` or `recvs`) and
//           rings the peer's bell. A post waits only while the entry still
//           holds message k - kHostP2PSlots, which both sides must have
//           finished first (kHostP2PSlots messages in flight on one
//           channel).
//   finish  (HostMessage::Wait, on either side) once both sides posted, the
//           first to get there claims the entry (a compare-and-swap of its
//           state word) and copies min(sent, capacity) bytes; the other
//           waits until the state says copied. A finish depends only on
//           the peer's post, never on the peer's finish, so the ranks may
//           finish their messages in any order without a deadlock.
//   give up a wait that fails for good (its deadline, a closed group, a
//           peer gone, an interrupt) marks the entry abandoned unless the
//           peer claimed it first, in which case it waits for that copy to
//           end: once it returns, no rank touches this side's buffer. The
//           peer's wait then fails, naming this rank.
// Waits sleep on the rank's bell (a futex word on the board) in slices of
// 20 ms, checking that the peer's process still exists and that nobody
// closed the group. A bell rings for what its rank may wait for: a post,
// a copy done, a message abandoned, and a message finished only while a
// post of the channel waits for its entry (a ring wakes every sleeper of
// the rank, and the wake-up call is the costly part of a small message).
//
// Thread-safety: HostP2P is thread-safe. A HostMessage's Wait runs on one
// thread at a time; Suspend and Interrupt may be called from any thread.
// Messages may be finished in any order.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/gloo/plugin/host_copy.h"
#include "comm/gloo/plugin_api.h"

namespace strata::gloo_plugin {

class HostP2P;

// One posted message (either side), as plugin_api.h's HostTransfer.
class HostMessage final : public HostTransfer {
 public:
  HostMessage(std::shared_ptr<HostP2P> p2p, bool send, int peer, uint64_t number);
  Error Wait(int64_t timeout_ms) override;
  void Suspend() override;
  void Interrupt() override;
  bool finished() const override { return finished_; }
  uint64_t sent_bytes() const override { return sent_bytes_; }

 private:
  // Ends the wait for good with `e` (this side moves on from the entry,
  // which takes the next message once both sides did).
  Error Finish(Error e);
  // Gives the message up after `e` (see the file comment).
  Error GiveUp(Error e);
  // Copies the message after claiming it; the state it leaves.
  uint32_t Copy(Error* e);
  // The state that says this side abandoned the message.
  uint32_t GaveUp() const { return send_ ? kP2PSenderGaveUp : kP2PReceiverGaveUp; }
  std::string What() const;

  const std::shared_ptr<HostP2P> p2p_;
  const bool send_;
  const int peer_;
  const uint64_t number_;
  std::atomic<bool> suspend_{false};
  std::atomic<bool> interrupt_{false};
  bool finished_ = false;
  Error final_;
  uint64_t sent_bytes_ = 0;
};

// The point-to-point side of one host-local group.
class HostP2P : public std::enable_shared_from_this<HostP2P> {
 public:
  HostP2P(int rank, int size, std::vector<int64_t> pids, std::shared_ptr<HostBoard> board);

  // Post a message to / from `peer` (which may be this rank). A post waits
  // (until `timeout_ms`) only while kHostP2PSlots messages of the channel
  // are unfinished.
  Error Send(const void* data, size_t bytes, int peer, int64_t timeout_ms,
             std::unique_ptr<HostTransfer>* out);
  Error Recv(void* data, size_t capacity, int peer, int64_t timeout_ms,
             std::unique_ptr<HostTransfer>* out);

 private:
  friend class HostMessage;
  Error Post(bool send, const void* data, size_t bytes, int peer, int64_t timeout_ms,
             std::unique_ptr<HostTransfer>* out);
  HostP2PChannel& channel(bool send, int peer) {
    return send ? board_->channel(rank_, peer) : board_->channel(peer, rank_);
  }
  // Bumps rank r's bell and wakes its sleepers.
  void Ring(int r);
  // Sleeps on this rank's bell while it still reads `seen`, at most
  // `slice_ms`; false when the slice ran out.
  bool Sleep(uint32_t seen, int64_t slice_ms);
  uint32_t bell() const;
  // kUnavailable when the group was closed or `peer`'s process is gone
  // (`check_process`: only after a slice ran out; the check reads /proc).
  Error Health(int peer, bool check_process) const;

  const int rank_;
  const int size_;
  const std::vector<int64_t> pids_;
  const std::shared_ptr<HostBoard> board_;
  std::mutex post_mu_;  // serialises posts (each side's counts)
};

}  // namespace strata::gloo_plugin
