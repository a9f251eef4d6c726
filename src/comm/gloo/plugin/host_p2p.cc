// Point-to-point messages among the ranks of one host (host_p2p.h).
#include "comm/gloo/plugin/host_p2p.h"

#include <linux/futex.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <utility>

namespace strata::gloo_plugin {
namespace {

// How long a wait sleeps before it checks that the peer's process exists.
constexpr int64_t kSliceMs = 20;

uint64_t Number(uint64_t state) { return state >> 3; }
uint32_t StateOf(uint64_t state) { return static_cast<uint32_t>(state & 7); }
uint64_t Pack(uint64_t number, uint32_t state) { return number << 3 | state; }
// Whether `state` is message `number`'s, claimed or ended (an entry starts
// as message 0 open, and holds an earlier message until one side claims
// or abandons this one).
bool Touched(uint64_t state, uint64_t number) {
  return Number(state) == number && StateOf(state) != kP2POpen;
}

uint64_t Address(const void* p) { return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(p)); }
void* Pointer(uint64_t a) { return reinterpret_cast<void*>(static_cast<uintptr_t>(a)); }

std::string Describe(bool send, int peer) {
  return std::string(send ? "send to" : "recv from") + " rank " + std::to_string(peer);
}

}  // namespace

HostP2P::HostP2P(int rank, int size, std::vector<int64_t> pids, std::shared_ptr<HostBoard> board)
    : rank_(rank), size_(size), pids_(std::move(pids)), board_(std::move(board)) {}

void HostP2P::Ring(int r) {
  HostBell& b = board_->bell(r);
  b.rings.fetch_add(1, std::memory_order_seq_cst);
  if (b.sleepers.load(std::memory_order_seq_cst) > 0) Futex(b.rings, FUTEX_WAKE, INT_MAX, nullptr);
}

uint32_t HostP2P::bell() const { return board_->bell(rank_).rings.load(std::memory_order_seq_cst); }

// A sleeper counts itself before the futex compares the bell, and a ring
// bumps the bell before it reads the count: either the ring sees the
// sleeper and wakes it, or the futex sees the new bell and does not sleep.
bool HostP2P::Sleep(uint32_t seen, int64_t slice_ms) {
  HostBell& b = board_->bell(rank_);
  b.sleepers.fetch_add(1, std::memory_order_seq_cst);
  const int64_t ms = std::max<int64_t>(1, slice_ms);
  const timespec slice{static_cast<time_t>(ms / 1000), static_cast<long>(ms % 1000) * 1000000L};
  const long rc = Futex(b.rings, FUTEX_WAIT, seen, &slice);
  const int err = errno;
  b.sleepers.fetch_sub(1, std::memory_order_seq_cst);
  return !(rc != 0 && err == ETIMEDOUT);
}

Error HostP2P::Health(int peer, bool check_process) const {
  if (const uint32_t closer = board_->header().closed.load(std::memory_order_acquire);
      closer != 0) {
    return {kUnavailable, "rank " + std::to_string(closer - 1) +
                              " closed the group's connections (after a failure or an abort)"};
  }
  const int64_t pid = pids_[static_cast<size_t>(peer)];
  if (check_process && peer != rank_ && ProcessGone(pid)) {
    return {kUnavailable,
            "rank " + std::to_string(peer) + " (pid " + std::to_string(pid) + ") is gone"};
  }
  return {};
}

Error HostP2P::Send(const void* data, size_t bytes, int peer, int64_t timeout_ms,
                    std::unique_ptr<HostTransfer>* out) {
  return Post(true, data, bytes, peer, timeout_ms, out);
}

Error HostP2P::Recv(void* data, size_t capacity, int peer, int64_t timeout_ms,
                    std::unique_ptr<HostTransfer>* out) {
  return Post(false, data, capacity, peer, timeout_ms, out);
}

Error HostP2P::Post(bool send, const void* data, size_t bytes, int peer, int64_t timeout_ms,
                    std::unique_ptr<HostTransfer>* out) {
  if (peer < 0 || peer >= size_) {
    return {kInvalidArgument,
            Describe(send, peer) + ": no such rank in a group of " + std::to_string(size_)};
  }
  std::lock_guard<std::mutex> lock(post_mu_);
  HostP2PChannel& c = channel(send, peer);
  std::atomic<uint64_t>& count = send ? c.sends : c.recvs;
  const uint64_t k = count.load(std::memory_order_relaxed);  // only this side writes it
  HostP2PEntry& entry = c.entries[k % kHostP2PSlots];
  if (k >= kHostP2PSlots) {
    // The entry's previous message must be finished on both sides. This
    // post counts itself before it reads the entry, and a finish stores
    // its side's count before it reads the waiters (all sequentially
    // consistent): either the finish sees the waiter and rings, or the
    // waiter sees the finish.
    const uint64_t previous = k - kHostP2PSlots + 1;
    const Deadline deadline(timeout_ms);
    c.post_waiters.fetch_add(1, std::memory_order_seq_cst);
    struct Uncount {
      std::atomic<uint32_t>& waiters;
      ~Uncount() { waiters.fetch_sub(1, std::memory_order_seq_cst); }
    } uncount{c.post_waiters};
    for (;;) {
      const uint32_t seen = bell();
      if (entry.sender_done.load(std::memory_order_seq_cst) >= previous &&
          entry.receiver_done.load(std::memory_order_seq_cst) >= previous) {
        break;
      }
      Error e = Health(peer, false);
      if (e.ok() && deadline.passed()) {
        e = {kDeadlineExceeded,
             "waited for message " + std::to_string(previous - 1) +
                 " to finish: " + std::to_string(kHostP2PSlots) +
                 " messages between the two ranks were unfinished (the most in flight "
                 "between two ranks); does the peer post its side?"};
      }
      if (e.ok() && !Sleep(seen, std::min<int64_t>(kSliceMs, deadline.left().count()))) {
        e = Health(peer, true);
      }
      if (!e.ok()) return {e.code, Describe(send, peer) + ": " + e.message};
    }
  }
  if (send) {
    entry.send_addr = Address(data);
    entry.send_bytes = bytes;
  } else {
    entry.recv_addr = Address(data);
    entry.recv_bytes = bytes;
  }
  count.store(k + 1, std::memory_order_release);
  Ring(peer);
  *out = std::make_unique<HostMessage>(shared_from_this(), send, peer, k);
  return {};
}

HostMessage::HostMessage(std::shared_ptr<HostP2P> p2p, bool send, int peer, uint64_t number)
    : p2p_(std::move(p2p)), send_(send), peer_(peer), number_(number) {}

std::string HostMessage::What() const {
  return Describe(send_, peer_) + " (message " + std::to_string(number_) + ")";
}

void HostMessage::Suspend() {
  suspend_.store(true, std::memory_order_release);
  p2p_->Ring(p2p_->rank_);
}

// Abandons the message at once, so that no copy starts after this returns
// (FailAll interrupts operations that nobody waits for afterwards); a copy
// the peer already started is waited for, as in GiveUp. The wait in
// progress, or the next, then fails.
void HostMessage::Interrupt() {
  interrupt_.store(true, std::memory_order_release);
  HostP2P& p = *p2p_;
  HostP2PEntry& entry = p.channel(send_, peer_).entries[number_ % kHostP2PSlots];
  const uint32_t peer_copying = send_ ? kP2PReceiverCopying : kP2PSenderCopying;
  for (;;) {
    const uint32_t seen = p.bell();
    uint64_t state = entry.state.load(std::memory_order_acquire);
    // A later message in the entry: this one finished long ago.
    if (Number(state) > number_) break;
    if (!Touched(state, number_)) {
      if (entry.state.compare_exchange_strong(state, Pack(number_, GaveUp()),
                                              std::memory_order_acq_rel)) {
        p.Ring(peer_);
        break;
      }
      continue;
    }
    if (StateOf(state) != peer_copying) break;
    if (!p.Sleep(seen, kSliceMs) && ProcessGone(p.pids_[static_cast<size_t>(peer_)])) break;
  }
  p.Ring(p.rank_);
}

Error HostMessage::Wait(int64_t timeout_ms) {
  if (finished_) return final_;
  HostP2P& p = *p2p_;
  HostP2PChannel& c = p.channel(send_, peer_);
  HostP2PEntry& entry = c.entries[number_ % kHostP2PSlots];
  const uint32_t claim = send_ ? kP2PSenderCopying : kP2PReceiverCopying;
  const Deadline deadline(timeout_ms);
  for (;;) {
    const uint32_t seen = p.bell();
    if (interrupt_.load(std::memory_order_acquire)) {
      return GiveUp({kAborted, What() + ": interrupted"});
    }
    if (suspend_.exchange(false, std::memory_order_acq_rel)) {
      return {kAborted, What() + ": suspended"};
    }
    uint64_t state = entry.state.load(std::memory_order_acquire);
    if (Touched(state, number_)) {
      const uint32_t now = StateOf(state);
      if (now == kP2PCopied) return Finish({});
      if (now == kP2PCopyFailed) {
        return Finish({kInternal, What() + ": rank " + std::to_string(peer_) +
                                      " could not copy the message (see its error)"});
      }
      if (now == GaveUp()) return Finish({kAborted, What() + ": interrupted"});
      if (now == kP2PSenderGaveUp || now == kP2PReceiverGaveUp) {
        return Finish({kUnavailable, What() + ": rank " + std::to_string(peer_) +
                                         " gave up on the message (its operation failed: timed "
                                         "out, interrupted, or its group was closed)"});
      }
      // Otherwise the peer is copying it.
    } else if (c.sends.load(std::memory_order_acquire) > number_ &&
               c.recvs.load(std::memory_order_acquire) > number_ && p.Health(peer_, false).ok()) {
      // Both sides posted and nobody claimed the message yet: copy it.
      if (entry.state.compare_exchange_strong(state, Pack(number_, claim),
                                              std::memory_order_acq_rel)) {
        Error e;
        const uint32_t end = Copy(&e);
        entry.state.store(Pack(number_, end), std::memory_order_release);
        p.Ring(peer_);
        return Finish(e);
      }
      continue;  // the peer claimed it first
    }
    Error e = p.Health(peer_, false);
    if (e.ok() && deadline.passed()) {
      e = {kDeadlineExceeded, "timed out (the peer " +
                                  std::string(c.sends.load() > number_ && c.recvs.load() > number_
                                                  ? "is copying the message"
                                                  : "has not posted its side") +
                                  ")"};
    }
    if (e.ok() && !p.Sleep(seen, std::min<int64_t>(kSliceMs, deadline.left().count()))) {
      e = p.Health(peer_, true);
    }
    if (!e.ok()) return GiveUp({e.code, What() + ": " + e.message});
  }
}

uint32_t HostMessage::Copy(Error* e) {
  HostP2P& p = *p2p_;
  const HostP2PEntry& entry = p.channel(send_, peer_).entries[number_ % kHostP2PSlots];
  const size_t bytes = static_cast<size_t>(std::min(entry.send_bytes, entry.recv_bytes));
  if (bytes == 0) return kP2PCopied;
  if (peer_ == p.rank_) {
    std::memmove(Pointer(entry.recv_addr), Pointer(entry.send_addr), bytes);
    return kP2PCopied;
  }
  const int64_t pid = p.pids_[static_cast<size_t>(peer_)];
  const bool ok = send_ ? WriteRemote(pid, Pointer(entry.send_addr), entry.recv_addr, bytes)
                        : ReadRemote(pid, entry.send_addr, Pointer(entry.recv_addr), bytes);
  if (ok) return kP2PCopied;
  const int err = errno;
  *e = {err == ESRCH ? kUnavailable : kInternal,
        What() + ": " + (send_ ? "writing " : "reading ") + std::to_string(bytes) + " bytes " +
            (send_ ? "to" : "from") + " rank " + std::to_string(peer_) + " (pid " +
            std::to_string(pid) + ") failed: " + std::strerror(err)};
  return kP2PCopyFailed;
}

Error HostMessage::Finish(Error e) {
  HostP2P& p = *p2p_;
  HostP2PEntry& entry = p.channel(send_, peer_).entries[number_ % kHostP2PSlots];
  // The sender's size stays in the entry until this side moves on.
  if (!send_ && e.ok()) sent_bytes_ = entry.send_bytes;
  (send_ ? entry.sender_done : entry.receiver_done).store(number_ + 1, std::memory_order_seq_cst);
  finished_ = true;
  final_ = e;
  // A post on either side may be waiting for the entry (see Post). Only
  // then the bells ring: a ring wakes every thread sleeping on the bell,
  // and on a virtual machine the wake-up call alone costs microseconds.
  if (p.channel(send_, peer_).post_waiters.load(std::memory_order_seq_cst) > 0) {
    p.Ring(peer_);
    if (peer_ != p.rank_) p.Ring(p.rank_);
  }
  return e;
}

Error HostMessage::GiveUp(Error e) {
  HostP2P& p = *p2p_;
  HostP2PEntry& entry = p.channel(send_, peer_).entries[number_ % kHostP2PSlots];
  const uint32_t gave_up = GaveUp();
  const uint32_t peer_copying = send_ ? kP2PReceiverCopying : kP2PSenderCopying;
  for (;;) {
    const uint32_t seen = p.bell();
    uint64_t state = entry.state.load(std::memory_order_acquire);
    if (!Touched(state, number_)) {
      if (entry.state.compare_exchange_strong(state, Pack(number_, gave_up),
                                              std::memory_order_acq_rel)) {
        p.Ring(peer_);
        return Finish(e);
      }
      continue;
    }
    const uint32_t now = StateOf(state);
    if (now == kP2PCopied) return Finish({});  // it went through after all
    if (now != peer_copying) return Finish(e);
    // The peer is copying into or out of this side's buffer: a copy waits
    // for nothing, so it ends soon unless the peer's process is gone.
    if (!p.Sleep(seen, kSliceMs) && ProcessGone(p.pids_[static_cast<size_t>(peer_)])) {
      return Finish(e);
    }
  }
}

}  // namespace strata::gloo_plugin
