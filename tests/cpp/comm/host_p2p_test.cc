// Point-to-point messages among the ranks of one host (the Gloo plugin's
// host_p2p.h), tested without Gloo: the ranks are threads of this process,
// each with its own mapping of one board.
#include "comm/gloo/plugin/host_p2p.h"

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace strata::gloo_plugin {
namespace {

using ::testing::HasSubstr;

// n ranks on one board; `pids` default to this process for every rank.
struct Ranks {
  explicit Ranks(int n, std::vector<int64_t> pids = {}) {
    if (pids.empty()) pids.assign(static_cast<size_t>(n), static_cast<int64_t>(getpid()));
    const std::string name = HostBoard::Create(n);
    EXPECT_FALSE(name.empty());
    for (int r = 0; r < n; ++r) {
      std::shared_ptr<HostBoard> board = HostBoard::Open(name, n);
      EXPECT_NE(board, nullptr);
      boards.push_back(board);
      p2p.push_back(std::make_shared<HostP2P>(r, n, pids, board));
    }
    HostBoard::Unlink(name);
  }
  std::unique_ptr<HostTransfer> Send(int from, const void* data, size_t bytes, int to,
                                     int64_t timeout_ms = 5000) {
    std::unique_ptr<HostTransfer> t;
    const Error e = p2p[static_cast<size_t>(from)]->Send(data, bytes, to, timeout_ms, &t);
    EXPECT_TRUE(e.ok()) << e.message;
    return t;
  }
  std::unique_ptr<HostTransfer> Recv(int at, void* data, size_t capacity, int from,
                                     int64_t timeout_ms = 5000) {
    std::unique_ptr<HostTransfer> t;
    const Error e = p2p[static_cast<size_t>(at)]->Recv(data, capacity, from, timeout_ms, &t);
    EXPECT_TRUE(e.ok()) << e.message;
    return t;
  }
  std::vector<std::shared_ptr<HostBoard>> boards;
  std::vector<std::shared_ptr<HostP2P>> p2p;
};

void OnThreads(int n, const std::function<void(int)>& body) {
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) threads.emplace_back(body, r);
  for (auto& t : threads) t.join();
}

std::vector<char> Pattern(size_t bytes, int seed) {
  std::vector<char> v(bytes);
  for (size_t i = 0; i < bytes; ++i) v[i] = static_cast<char>((i * 131 + seed * 7) & 0xff);
  return v;
}

int64_t MillisSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() -
                                                               start)
      .count();
}

// Three ranks each send 300 messages of random sizes (some empty, some
// several MiB) to each other rank and to themselves, 48 at a time per
// peer (past the 256th, entries take their second message), finishing
// them in random order; every message arrives whole, in order.
TEST(HostP2PTest, ManyMessagesArriveInOrderWithEntriesReused) {
  constexpr int n = 3, kMessages = 300, kWindow = 48;
  Ranks ranks(n);
  auto size_of = [](int from, int to, int i) {
    std::mt19937 rng(static_cast<unsigned>(from * 1000003 + to * 1009 + i));
    const int kind = static_cast<int>(rng() % 10);
    if (kind == 0) return size_t{0};
    if (kind == 1) return size_t{3} << 20 | (rng() % 4096);
    return static_cast<size_t>(rng() % 70000);
  };
  OnThreads(n, [&](int r) {
    std::mt19937 rng(static_cast<unsigned>(r + 17));
    for (int peer = 0; peer < n; ++peer) {
      // Sends to `peer` and receives from it alternate, window by window.
      std::vector<std::vector<char>> out(kMessages), in(kMessages);
      std::vector<std::unique_ptr<HostTransfer>> sends(kMessages), recvs(kMessages);
      for (int base = 0; base < kMessages; base += kWindow) {
        const int end = std::min(kMessages, base + kWindow);
        for (int i = base; i < end; ++i) {
          out[i] = Pattern(size_of(r, peer, i), r * 1000 + i);
          sends[i] = ranks.Send(r, out[i].data(), out[i].size(), peer);
          in[i].assign(size_of(peer, r, i), 0);
          recvs[i] = ranks.Recv(r, in[i].data(), in[i].size(), peer);
        }
        std::vector<HostTransfer*> open;
        for (int i = base; i < end; ++i) {
          open.push_back(sends[i].get());
          open.push_back(recvs[i].get());
        }
        std::shuffle(open.begin(), open.end(), rng);
        for (HostTransfer* t : open) {
          const Error e = t->Wait(30000);
          ASSERT_TRUE(e.ok()) << e.message;
        }
        for (int i = base; i < end; ++i) {
          ASSERT_EQ(recvs[i]->sent_bytes(), in[i].size());
          ASSERT_TRUE(in[i] == Pattern(in[i].size(), peer * 1000 + i)) << "message " << i;
        }
      }
    }
  });
}

// With both ranks posting a receive and then a send, and each waiting for
// its send first, each send completes without the peer's receive being
// waited for: whichever side waits copies. (Finishing in posting order
// would deadlock here if a copy needed the peer's finish.)
TEST(HostP2PTest, WaitingSideCopiesSoLaterMessagesFinishFirst) {
  Ranks ranks(2);
  OnThreads(2, [&](int r) {
    const int peer = 1 - r;
    std::vector<char> out = Pattern(1 << 20, r), in(1 << 20);
    auto recv = ranks.Recv(r, in.data(), in.size(), peer);
    auto send = ranks.Send(r, out.data(), out.size(), peer);
    const Error s = send->Wait(10000);
    ASSERT_TRUE(s.ok()) << s.message;
    const Error v = recv->Wait(10000);
    ASSERT_TRUE(v.ok()) << v.message;
    EXPECT_TRUE(in == Pattern(in.size(), peer));
  });
  // One side alone finishes a message both posted: the sender pushes...
  std::vector<char> a = Pattern(4096, 7), b(4096);
  auto send = ranks.Send(0, a.data(), a.size(), 1);
  auto recv = ranks.Recv(1, b.data(), b.size(), 0);
  ASSERT_TRUE(send->Wait(1000).ok());
  EXPECT_TRUE(b == a);
  ASSERT_TRUE(recv->Wait(0).ok());  // already copied: no wait needed
  // ... or the receiver pulls.
  std::vector<char> c = Pattern(4096, 8), d(4096);
  send = ranks.Send(0, c.data(), c.size(), 1);
  recv = ranks.Recv(1, d.data(), d.size(), 0);
  ASSERT_TRUE(recv->Wait(1000).ok());
  EXPECT_TRUE(d == c);
  ASSERT_TRUE(send->Wait(0).ok());
}

// A receive shorter or longer than the message gets what fits and learns
// the size sent; the next message is unaffected.
TEST(HostP2PTest, ReceiverLearnsTheSizeSent) {
  Ranks ranks(2);
  std::vector<char> ten = Pattern(10, 1), six(6, 0), twenty(20, 0), next = Pattern(5, 2), got(5, 0);
  auto s1 = ranks.Send(0, ten.data(), ten.size(), 1);
  auto s2 = ranks.Send(0, ten.data(), ten.size(), 1);
  auto s3 = ranks.Send(0, next.data(), next.size(), 1);
  auto r1 = ranks.Recv(1, six.data(), six.size(), 0);
  auto r2 = ranks.Recv(1, twenty.data(), twenty.size(), 0);
  auto r3 = ranks.Recv(1, got.data(), got.size(), 0);
  for (auto* t : {r1.get(), r2.get(), r3.get(), s1.get(), s2.get(), s3.get()}) {
    ASSERT_TRUE(t->Wait(1000).ok());
  }
  EXPECT_EQ(r1->sent_bytes(), 10u);
  EXPECT_EQ(0, std::memcmp(six.data(), ten.data(), 6));
  EXPECT_EQ(r2->sent_bytes(), 10u);
  EXPECT_EQ(0, std::memcmp(twenty.data(), ten.data(), 10));
  EXPECT_EQ(twenty[10], 0);
  EXPECT_EQ(r3->sent_bytes(), 5u);
  EXPECT_TRUE(got == next);
}

// A channel holds 256 unfinished messages; the 257th post waits for the
// first to finish on both sides, and says so when its deadline passes.
TEST(HostP2PTest, PostWaitsWhileTheChannelIsFull) {
  Ranks ranks(2);
  int32_t v[kHostP2PSlots + 1] = {}, w[kHostP2PSlots + 1] = {};
  std::vector<std::unique_ptr<HostTransfer>> sends, recvs;
  for (uint64_t i = 0; i <= kHostP2PSlots; ++i) v[i] = static_cast<int32_t>(i);
  for (uint64_t i = 0; i < kHostP2PSlots; ++i) {
    sends.push_back(ranks.Send(0, &v[i], sizeof(int32_t), 1));
  }
  std::unique_ptr<HostTransfer> t;
  const auto start = std::chrono::steady_clock::now();
  Error e = ranks.p2p[0]->Send(&v[kHostP2PSlots], sizeof(int32_t), 1, 60, &t);
  EXPECT_EQ(e.code, kDeadlineExceeded);
  EXPECT_GE(MillisSince(start), 55);
  EXPECT_THAT(e.message, HasSubstr("send to rank 1"));
  EXPECT_THAT(e.message, HasSubstr("256 messages between the two ranks were unfinished"));
  // The receiver takes the first; once both finished it, the post goes
  // through (the failed post took no number).
  recvs.push_back(ranks.Recv(1, &w[0], sizeof(int32_t), 0));
  ASSERT_TRUE(recvs[0]->Wait(1000).ok());
  std::thread later([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    EXPECT_TRUE(sends[0]->Wait(1000).ok());
  });
  e = ranks.p2p[0]->Send(&v[kHostP2PSlots], sizeof(int32_t), 1, 5000, &t);
  later.join();
  ASSERT_TRUE(e.ok()) << e.message;
  sends.push_back(std::move(t));
  for (uint64_t i = 1; i <= kHostP2PSlots; ++i) {
    recvs.push_back(ranks.Recv(1, &w[i], sizeof(int32_t), 0));
  }
  for (auto& r : recvs) ASSERT_TRUE(r->Wait(1000).ok());
  for (auto& s : sends) ASSERT_TRUE(s->Wait(1000).ok());
  for (uint64_t i = 0; i <= kHostP2PSlots; ++i) EXPECT_EQ(w[i], static_cast<int32_t>(i));
}

// A bell rings for what its rank may wait for: the peer's post and the
// peer's copy, not for a finish (which only a post waiting for the entry
// needs). Waking a rank costs a system call and wakes every sleeper.
TEST(HostP2PTest, BellsRingOnlyForWhatARankMayWaitFor) {
  Ranks ranks(2);
  auto rings = [&](int r) { return ranks.boards[0]->bell(r).rings.load(); };
  const uint32_t before0 = rings(0), before1 = rings(1);
  int32_t x = 7, y = 0;
  auto recv = ranks.Recv(1, &y, sizeof(y), 0);  // rings rank 0
  auto send = ranks.Send(0, &x, sizeof(x), 1);  // rings rank 1
  ASSERT_TRUE(recv->Wait(1000).ok());           // copies, rings rank 0
  ASSERT_TRUE(send->Wait(1000).ok());           // sees the copy: no ring
  EXPECT_EQ(y, 7);
  EXPECT_EQ(rings(0) - before0, 2u);
  EXPECT_EQ(rings(1) - before1, 1u);
}

// A post waiting for a full channel's entry is rung by the finish that
// frees it (not left to find out when its sleep runs out).
TEST(HostP2PTest, FinishRingsForAWaitingPost) {
  Ranks ranks(2);
  int32_t v[kHostP2PSlots + 1] = {}, w = 0;
  std::vector<std::unique_ptr<HostTransfer>> sends;
  for (uint64_t i = 0; i < kHostP2PSlots; ++i) {
    sends.push_back(ranks.Send(0, &v[i], sizeof(int32_t), 1));
  }
  auto first = ranks.Recv(1, &w, sizeof(w), 0);
  ASSERT_TRUE(first->Wait(1000).ok());
  std::unique_ptr<HostTransfer> t;
  Error e;
  std::thread poster([&] { e = ranks.p2p[0]->Send(&v[kHostP2PSlots], 4, 1, 5000, &t); });
  HostP2PChannel& channel = ranks.boards[0]->channel(0, 1);
  while (channel.post_waiters.load() == 0) std::this_thread::yield();
  const uint32_t before = ranks.boards[0]->bell(0).rings.load();
  ASSERT_TRUE(sends[0]->Wait(1000).ok());  // frees the entry the post waits for
  EXPECT_GT(ranks.boards[0]->bell(0).rings.load(), before);
  poster.join();
  ASSERT_TRUE(e.ok()) << e.message;
  EXPECT_EQ(channel.post_waiters.load(), 0u);
}

// Suspend makes a wait return kAborted, not finished; the next wait
// completes the message.
TEST(HostP2PTest, SuspendedWaitResumes) {
  Ranks ranks(2);
  int32_t x = 42, y = 0;
  auto recv = ranks.Recv(1, &y, sizeof(y), 0);
  std::thread suspender([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    recv->Suspend();
  });
  const auto start = std::chrono::steady_clock::now();
  Error e = recv->Wait(5000);
  suspender.join();
  EXPECT_EQ(e.code, kAborted);
  EXPECT_FALSE(recv->finished());
  EXPECT_LT(MillisSince(start), 2000);
  recv->Suspend();  // before a wait: the next one returns at once
  EXPECT_EQ(recv->Wait(5000).code, kAborted);
  auto send = ranks.Send(0, &x, sizeof(x), 1);
  e = recv->Wait(1000);
  ASSERT_TRUE(e.ok()) << e.message;
  EXPECT_TRUE(recv->finished());
  EXPECT_EQ(y, 42);
  ASSERT_TRUE(send->Wait(1000).ok());
}

// A wait that fails for good abandons the message: the peer's wait fails
// naming the rank, and the buffer is never written afterwards.
TEST(HostP2PTest, FailedWaitsAbandonTheMessage) {
  Ranks ranks(2);
  int32_t x = 7, y = -1;
  // Deadline: the receiver gives up before the sender posts.
  auto recv = ranks.Recv(1, &y, sizeof(y), 0);
  const auto start = std::chrono::steady_clock::now();
  Error e = recv->Wait(40);
  EXPECT_EQ(e.code, kDeadlineExceeded);
  EXPECT_GE(MillisSince(start), 35);
  EXPECT_THAT(e.message, HasSubstr("recv from rank 0 (message 0)"));
  EXPECT_THAT(e.message, HasSubstr("has not posted its side"));
  EXPECT_TRUE(recv->finished());
  EXPECT_EQ(recv->Wait(1000).code, kDeadlineExceeded);  // final: repeated
  auto send = ranks.Send(0, &x, sizeof(x), 1);
  e = send->Wait(1000);
  EXPECT_EQ(e.code, kUnavailable);
  EXPECT_THAT(e.message, HasSubstr("rank 1 gave up on the message"));
  EXPECT_EQ(y, -1);
  // Interrupt: the sender abandons message 1 before the receiver posts.
  send = ranks.Send(0, &x, sizeof(x), 1);
  send->Interrupt();
  recv = ranks.Recv(1, &y, sizeof(y), 0);
  EXPECT_EQ(recv->Wait(1000).code, kUnavailable);
  e = send->Wait(1000);
  EXPECT_EQ(e.code, kAborted);
  EXPECT_THAT(e.message, HasSubstr("interrupted"));
  EXPECT_EQ(y, -1);
  // An interrupt after the copy changes nothing.
  send = ranks.Send(0, &x, sizeof(x), 1);
  recv = ranks.Recv(1, &y, sizeof(y), 0);
  ASSERT_TRUE(recv->Wait(1000).ok());
  send->Interrupt();
  EXPECT_TRUE(send->Wait(1000).ok());
  EXPECT_EQ(y, 7);
  // The entries taken by failed messages are reused like any other.
  for (int i = 0; i < 2 * static_cast<int>(kHostP2PSlots); ++i) {
    x = i;
    send = ranks.Send(0, &x, sizeof(x), 1);
    recv = ranks.Recv(1, &y, sizeof(y), 0);
    ASSERT_TRUE(recv->Wait(1000).ok());
    ASSERT_TRUE(send->Wait(1000).ok());
    ASSERT_EQ(y, i);
  }
}

// Closing the group wakes a waiting rank at once; a peer whose process is
// gone is noticed within a few slices.
TEST(HostP2PTest, ClosedGroupAndGonePeerEndWaits) {
  {
    Ranks ranks(2);
    int32_t y = 0;
    auto recv = ranks.Recv(1, &y, sizeof(y), 0);
    HostGroup closer(0, 2, {getpid(), getpid()}, ranks.boards[0]);
    std::thread t([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      closer.Close();
    });
    const auto start = std::chrono::steady_clock::now();
    const Error e = recv->Wait(10000);
    t.join();
    EXPECT_EQ(e.code, kUnavailable);
    EXPECT_THAT(e.message, HasSubstr("rank 0 closed the group's connections"));
    EXPECT_LT(MillisSince(start), 2000);
  }
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) _exit(0);
  ASSERT_EQ(waitpid(child, nullptr, 0), child);
  Ranks ranks(2, {static_cast<int64_t>(getpid()), static_cast<int64_t>(child)});
  int32_t y = 0;
  auto recv = ranks.Recv(0, &y, sizeof(y), 1);
  const auto start = std::chrono::steady_clock::now();
  const Error e = recv->Wait(10000);
  EXPECT_EQ(e.code, kUnavailable);
  EXPECT_THAT(e.message, HasSubstr("rank 1 (pid " + std::to_string(child) + ") is gone"));
  EXPECT_LT(MillisSince(start), 2000);
}

TEST(HostP2PTest, PeerOutOfRangeIsAnError) {
  Ranks ranks(2);
  int32_t x = 0;
  std::unique_ptr<HostTransfer> t;
  const Error e = ranks.p2p[0]->Send(&x, sizeof(x), 2, 100, &t);
  EXPECT_EQ(e.code, kInvalidArgument);
  EXPECT_THAT(e.message, HasSubstr("no such rank in a group of 2"));
}

}  // namespace
}  // namespace strata::gloo_plugin

namespace strata::gloo_plugin {
namespace {

bool BoardExists(const std::string& name) {
  struct stat st;
  return ::stat(("/dev/shm" + name).c_str(), &st) == 0;
}

// A rank 0 killed while its group connected leaves its board in /dev/shm;
// the next Create on the host removes it, and only boards whose creator is
// gone.
TEST(HostBoardTest, CreateRemovesTheBoardsOfCreatorsThatAreGone) {
  const std::string mine = HostBoard::Create(2);
  ASSERT_FALSE(mine.empty());
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    const std::string name = HostBoard::Create(2);
    (void)!::write(fds[1], name.data(), name.size());
    ::_exit(0);  // without unlinking it
  }
  ::close(fds[1]);
  char buf[128] = {};
  const ssize_t got = ::read(fds[0], buf, sizeof(buf) - 1);
  ::close(fds[0]);
  ASSERT_EQ(::waitpid(child, nullptr, 0), child);
  ASSERT_GT(got, 0);
  const std::string orphan(buf, static_cast<size_t>(got));
  ASSERT_TRUE(BoardExists(orphan)) << orphan;
  const std::string next = HostBoard::Create(2);
  EXPECT_FALSE(BoardExists(orphan)) << orphan << " (its creator, pid " << child << ", is gone)";
  EXPECT_TRUE(BoardExists(mine)) << mine << " (its creator runs)";
  EXPECT_TRUE(BoardExists(next)) << next;
  HostBoard::Unlink(mine);
  HostBoard::Unlink(next);
}

}  // namespace
}  // namespace strata::gloo_plugin
