// The file store (every operation, deadlines, many clients in threads and in
// processes), prefixed views, stores made of functions, and OpenStore.
#include "strata/comm/store.h"

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace strata {
namespace {

absl::Time Soon(absl::Duration d = absl::Seconds(30)) { return absl::Now() + d; }

class FileStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/strata_store_test.XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // A new client of the same directory, as another rank would open it.
  std::shared_ptr<Store> Client() {
    FileStoreOptions options;
    options.path = dir_ + "/store";
    absl::StatusOr<std::shared_ptr<Store>> s = OpenFileStore(options);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *s : nullptr;
  }

  std::string dir_;
};

TEST_F(FileStoreTest, SetGetRoundTripsAnyKeyAndValue) {
  auto store = Client();
  const std::string binary("a\0b\xff\n", 5);
  const std::vector<std::string> keys = {"plain", "with/slash",         "sp ace",
                                         "%41",   "\xc3\xa9t\xc3\xa9",  ".hidden",
                                         "",      std::string(400, 'x')};
  for (size_t i = 0; i < keys.size(); ++i) {
    ASSERT_TRUE(store->Set(keys[i], absl::StrCat(binary, i), Soon()).ok()) << i;
  }
  auto other = Client();
  for (size_t i = 0; i < keys.size(); ++i) {
    absl::StatusOr<std::string> v = other->Get(keys[i], Soon());
    ASSERT_TRUE(v.ok()) << v.status();
    EXPECT_EQ(*v, absl::StrCat(binary, i)) << "key " << i;
  }
  // Keys that differ only past the encoded length limit stay distinct.
  ASSERT_TRUE(store->Set(std::string(400, 'x') + "y", "other", Soon()).ok());
  EXPECT_EQ(*other->Get(std::string(400, 'x'), Soon()), absl::StrCat(binary, 7));
  // Set replaces.
  ASSERT_TRUE(store->Set("plain", "new", Soon()).ok());
  EXPECT_EQ(*other->Get("plain", Soon()), "new");
}

TEST_F(FileStoreTest, GetWaitsForAKeySetLater) {
  auto reader = Client();
  auto writer = Client();
  std::thread t([&] {
    absl::SleepFor(absl::Milliseconds(50));
    EXPECT_TRUE(writer->Set("late", "here", Soon()).ok());
  });
  absl::StatusOr<std::string> v = reader->Get("late", Soon());
  t.join();
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, "here");
}

TEST_F(FileStoreTest, GetAndWaitFailAtTheirDeadlineNamingTheKeys) {
  auto store = Client();
  absl::StatusOr<std::string> v = store->Get("never", Soon(absl::Milliseconds(30)));
  EXPECT_EQ(v.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(absl::StrContains(v.status().message(), "'never'")) << v.status();
  EXPECT_TRUE(absl::StrContains(v.status().message(), dir_)) << v.status();

  ASSERT_TRUE(store->Set("a", "1", Soon()).ok());
  std::vector<std::string> keys = {"a", "b", "c"};
  absl::Status w = store->Wait(keys, Soon(absl::Milliseconds(30)));
  EXPECT_EQ(w.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(absl::StrContains(w.message(), "2 of 3 keys")) << w;
  EXPECT_TRUE(absl::StrContains(w.message(), "b, c")) << w;
  // A deadline already passed still succeeds for keys that exist.
  EXPECT_TRUE(store->Wait({"a"}, absl::InfinitePast()).ok());
  EXPECT_EQ(*store->Get("a", absl::InfinitePast()), "1");
}

TEST_F(FileStoreTest, WaitReturnsOnceEveryKeyExists) {
  auto store = Client();
  std::thread t([&] {
    auto w = Client();
    for (const char* k : {"x", "y", "z"}) {
      absl::SleepFor(absl::Milliseconds(10));
      EXPECT_TRUE(w->Set(k, "v", Soon()).ok());
    }
  });
  EXPECT_TRUE(store->Wait({"x", "y", "z"}, Soon()).ok());
  t.join();
}

TEST_F(FileStoreTest, AddCountsFromZeroAndRejectsNonIntegers) {
  auto store = Client();
  EXPECT_EQ(*store->Add("n", 5, Soon()), 5);
  EXPECT_EQ(*store->Add("n", -7, Soon()), -2);
  EXPECT_EQ(*store->Get("n", Soon()), "-2");
  ASSERT_TRUE(store->Set("text", "abc", Soon()).ok());
  absl::StatusOr<int64_t> bad = store->Add("text", 1, Soon());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(bad.status().message(), "'abc'")) << bad.status();
  ASSERT_TRUE(store->Set("big", absl::StrCat(INT64_MAX), Soon()).ok());
  EXPECT_EQ(store->Add("big", 1, Soon()).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(FileStoreTest, CompareSetSwapsOnlyOnMatch) {
  auto store = Client();
  // Absent key, empty expected: set.
  EXPECT_EQ(*store->CompareSet("k", "", "first", Soon()), "first");
  // Mismatch: unchanged, the current value comes back.
  EXPECT_EQ(*store->CompareSet("k", "other", "second", Soon()), "first");
  EXPECT_EQ(*store->Get("k", Soon()), "first");
  // Match: swapped.
  EXPECT_EQ(*store->CompareSet("k", "first", "second", Soon()), "second");
  // Absent key, non-empty expected: NotFound, and still absent.
  absl::StatusOr<std::string> absent = store->CompareSet("none", "x", "y", Soon());
  EXPECT_EQ(absent.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store->Get("none", absl::InfinitePast()).status().code(),
            absl::StatusCode::kDeadlineExceeded);
}

TEST_F(FileStoreTest, ManyThreadsAddAndRaceOnCompareSet) {
  constexpr int kClients = 16, kAdds = 40;
  std::vector<std::thread> threads;
  std::vector<std::string> seen(kClients);
  for (int i = 0; i < kClients; ++i) {
    threads.emplace_back([&, i] {
      auto s = Client();  // each thread its own client, as separate ranks
      for (int j = 0; j < kAdds; ++j) EXPECT_TRUE(s->Add("count", 1, Soon()).ok());
      absl::StatusOr<std::string> won = s->CompareSet("leader", "", absl::StrCat("c", i), Soon());
      EXPECT_TRUE(won.ok()) << won.status();
      if (won.ok()) seen[i] = *won;
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(*Client()->Get("count", Soon()), absl::StrCat(kClients * kAdds));
  // One winner, and every client saw the same one.
  EXPECT_EQ(std::set<std::string>(seen.begin(), seen.end()).size(), 1u) << seen[0];
}

TEST_F(FileStoreTest, ManyProcessesAddAndMeet) {
  constexpr int kProcs = 8, kAdds = 50;
  std::vector<pid_t> kids;
  for (int i = 0; i < kProcs; ++i) {
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      // The child: only async-signal-safe use of the parent's state, then
      // its own client; reports through its exit status.
      auto s = Client();
      int bad = s == nullptr;
      for (int j = 0; j < kAdds && !bad; ++j) bad |= !s->Add("count", 1, Soon()).ok();
      bad |= !s->Set(absl::StrCat("here/", i), "1", Soon()).ok();
      std::vector<std::string> all;
      for (int k = 0; k < kProcs; ++k) all.push_back(absl::StrCat("here/", k));
      bad |= !s->Wait(all, Soon()).ok();
      ::_exit(bad);
    }
    kids.push_back(pid);
  }
  for (pid_t pid : kids) {
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child " << pid;
  }
  EXPECT_EQ(*Client()->Get("count", Soon()), absl::StrCat(kProcs * kAdds));
}

TEST_F(FileStoreTest, ALockHeldPastTheDeadlineIsDeadlineExceeded) {
  auto store = Client();
  ASSERT_TRUE(store->Set("held", "1", Soon()).ok());
  // Another client holds the key's lock (layout: l.<key>).
  const std::string lock = dir_ + "/store/l.held";
  const int fd = ::open(lock.c_str(), O_RDWR | O_CREAT, 0644);
  ASSERT_GE(fd, 0);
  struct flock lk;
  std::memset(&lk, 0, sizeof(lk));
  lk.l_type = F_WRLCK;
  ASSERT_EQ(::fcntl(fd, F_OFD_SETLK, &lk), 0);
  absl::StatusOr<int64_t> r = store->Add("held", 1, Soon(absl::Milliseconds(30)));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(absl::StrContains(r.status().message(), "lock")) << r.status();
  ::close(fd);  // released: the add goes through
  EXPECT_EQ(*store->Add("held", 1, Soon()), 2);
}

TEST_F(FileStoreTest, BadOptionsAreRejected) {
  FileStoreOptions options;
  EXPECT_EQ(OpenFileStore(options).status().code(), absl::StatusCode::kInvalidArgument);
  options.path = dir_ + "/x";
  options.version = 99;
  EXPECT_EQ(OpenFileStore(options).status().code(), absl::StatusCode::kInvalidArgument);
  options.version = FileStoreOptions::kVersion;
  options.max_poll = absl::Microseconds(1);
  absl::Status s = OpenFileStore(options).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "max_poll")) << s;
  // A file where the directory should be.
  const std::string file = dir_ + "/file";
  ::close(::open(file.c_str(), O_CREAT | O_WRONLY, 0644));
  options = FileStoreOptions();
  options.path = file;
  s = OpenFileStore(options).status();
  EXPECT_FALSE(s.ok());
  EXPECT_TRUE(absl::StrContains(s.message(), file)) << s;
}

TEST_F(FileStoreTest, OpenStoreParsesFileUrlsAndRejectsOthers) {
  absl::StatusOr<std::shared_ptr<Store>> a = OpenStore("file:" + dir_ + "/u");
  absl::StatusOr<std::shared_ptr<Store>> b = OpenStore("file://" + dir_ + "/u");
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE((*a)->Set("k", "v", Soon()).ok());
  EXPECT_EQ(*(*b)->Get("k", Soon()), "v");
  absl::Status s = OpenStore("tcp://host:1").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "tcp://host:1")) << s;
}

TEST_F(FileStoreTest, PrefixStoresKeepTheirKeysApart) {
  auto base = Client();
  auto a = MakePrefixStore(base, "a");
  auto b = MakePrefixStore(base, "b");
  ASSERT_TRUE(a->Set("k", "from a", Soon()).ok());
  ASSERT_TRUE(b->Set("k", "from b", Soon()).ok());
  EXPECT_EQ(*a->Get("k", Soon()), "from a");
  EXPECT_EQ(*base->Get("b/k", Soon()), "from b");
  EXPECT_EQ(*a->Add("n", 2, Soon()), 2);
  EXPECT_EQ(*b->Add("n", 3, Soon()), 3);
  EXPECT_TRUE(a->Wait({"k", "n"}, Soon()).ok());
  EXPECT_EQ(*b->CompareSet("k", "from b", "b2", Soon()), "b2");
  EXPECT_EQ(*a->Get("k", Soon()), "from a");
}

// A store that polls keeps the default cancellable wait: slices of its own
// waits, ended by a cancel from another thread within one slice; through a
// prefixed view too, and a key set later ends it.
TEST_F(FileStoreTest, ACancellableWaitEndsOnACancelOrTheKey) {
  auto base = Client();
  auto view = MakePrefixStore(base, "p");
  EXPECT_FALSE(view->waits_without_polling());
  WaitCancel cancel;
  absl::Time cancelled_at;
  std::thread canceller([&] {
    absl::SleepFor(absl::Milliseconds(200));
    cancelled_at = absl::Now();
    cancel.Cancel();
  });
  absl::Status s = view->CancellableWait({"never"}, Soon(), cancel);
  const absl::Time ended = absl::Now();
  canceller.join();
  EXPECT_EQ(s.code(), absl::StatusCode::kCancelled) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "p/never")) << s;
  EXPECT_LT(ended - cancelled_at, absl::Seconds(2));
  cancel.Reset();
  std::thread setter([&] {
    absl::SleepFor(absl::Milliseconds(100));
    EXPECT_TRUE(base->Set("p/k", "v", Soon()).ok());
  });
  EXPECT_TRUE(view->CancellableWait({"k"}, Soon(), cancel).ok());
  setter.join();
  EXPECT_EQ(view->CancellableWait({"never"}, Soon(absl::Milliseconds(120)), cancel).code(),
            absl::StatusCode::kDeadlineExceeded);
}

TEST(CallbackStoreTest, ForwardsEveryOperationAndNeedsEveryFunction) {
  std::vector<std::string> calls;
  StoreCallbacks cb;
  cb.describe = "test callbacks";
  cb.set = [&](absl::string_view k, absl::string_view v, absl::Time) {
    calls.push_back(absl::StrCat("set ", k, "=", v));
    return absl::OkStatus();
  };
  absl::StatusOr<std::shared_ptr<Store>> missing = MakeCallbackStore(cb);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(missing.status().message(), "'get'")) << missing.status();
  cb.get = [&](absl::string_view k, absl::Time) -> absl::StatusOr<std::string> {
    calls.push_back(absl::StrCat("get ", k));
    return std::string("v");
  };
  cb.wait = [&](absl::Span<const std::string> keys, absl::Time) {
    calls.push_back(absl::StrCat("wait ", keys.size()));
    return absl::DeadlineExceededError("late");
  };
  cb.add = [&](absl::string_view k, int64_t d, absl::Time) -> absl::StatusOr<int64_t> {
    calls.push_back(absl::StrCat("add ", k, " ", d));
    return d + 1;
  };
  cb.compare_set = [&](absl::string_view k, absl::string_view e, absl::string_view d,
                       absl::Time) -> absl::StatusOr<std::string> {
    calls.push_back(absl::StrCat("cas ", k, " ", e, " ", d));
    return std::string(d);
  };
  absl::StatusOr<std::shared_ptr<Store>> s = MakeCallbackStore(cb);
  ASSERT_TRUE(s.ok()) << s.status();
  Store& store = **s;
  EXPECT_TRUE(store.Set("a", "1", Soon()).ok());
  EXPECT_EQ(*store.Get("a", Soon()), "v");
  EXPECT_EQ(store.Wait({"a", "b"}, Soon()).code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(*store.Add("n", 4, Soon()), 5);
  EXPECT_EQ(*store.CompareSet("c", "x", "y", Soon()), "y");
  EXPECT_EQ(store.Describe(), "test callbacks");
  EXPECT_EQ(calls,
            (std::vector<std::string>{"set a=1", "get a", "wait 2", "add n 4", "cas c x y"}));
}

}  // namespace
}  // namespace strata
