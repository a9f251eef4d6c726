// The file store: one file per key in a directory (see strata/comm/store.h).
//
// Layout of the directory:
//   k.<key>        the value of <key>, replaced whole by rename(2)
//   l.<key>        the lock file of <key> (Set, Add and CompareSet hold an
//                  open-file-description lock on it)
//   t.<pid>.<n>    a value being written, renamed to k.<key> when complete
// <key> is the key with every byte outside [A-Za-z0-9_-] written as %XX;
// keys whose encoding would be too long for a file name keep a prefix and end
// in "~" and a hash of the whole key.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "strata/base/status.h"
#include "strata/comm/store.h"
#include "xxhash.h"

namespace strata {
namespace {

// File names stay well below NAME_MAX (255).
constexpr size_t kMaxEncoded = 160;

std::string Encode(absl::string_view key) {
  static constexpr char kHex[] = "0123456789ABCDEF";
  std::string out;
  out.reserve(key.size());
  for (unsigned char c : key) {
    if (std::isalnum(c) || c == '_' || c == '-') {
      out.push_back(static_cast<char>(c));
    } else {
      out.push_back('%');
      out.push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 15]);
    }
  }
  if (out.size() > kMaxEncoded) {
    out.resize(kMaxEncoded - 17);
    absl::StrAppend(&out, "~", absl::Hex(XXH64(key.data(), key.size(), 0), absl::kZeroPad16));
  }
  return out;
}

std::string Errno(int err) { return std::strerror(err); }

// Closes a file descriptor when it goes out of scope.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

class FileStore final : public Store {
 public:
  explicit FileStore(const FileStoreOptions& options) : options_(options) {}

  absl::Status Set(absl::string_view key, absl::string_view value, absl::Time deadline) override {
    STRATA_ASSIGN_OR_RETURN(int lock, Lock(key, deadline, "set"));
    Fd held(lock);
    return WriteValue(key, value);
  }

  absl::StatusOr<std::string> Get(absl::string_view key, absl::Time deadline) override {
    absl::Duration pause = options_.min_poll;
    while (true) {
      STRATA_ASSIGN_OR_RETURN(std::optional<std::string> value, ReadValue(key));
      if (value.has_value()) return *std::move(value);
      if (!Pause(deadline, &pause)) {
        return absl::DeadlineExceededError(
            absl::StrCat(Describe(), ": key '", key, "' did not appear before the deadline (get)"));
      }
    }
  }

  absl::Status Wait(absl::Span<const std::string> keys, absl::Time deadline) override {
    absl::Duration pause = options_.min_poll;
    size_t next = 0;  // keys before `next` exist
    while (next < keys.size()) {
      struct stat st;
      if (::stat(ValuePath(keys[next]).c_str(), &st) == 0) {
        ++next;
        continue;
      }
      if (errno != ENOENT) {
        return absl::UnavailableError(
            absl::StrCat(Describe(), ": cannot check key '", keys[next], "': ", Errno(errno)));
      }
      if (!Pause(deadline, &pause)) {
        std::vector<std::string> missing(keys.begin() + static_cast<ptrdiff_t>(next), keys.end());
        if (missing.size() > 8) {
          missing.resize(8);
          missing.push_back("...");
        }
        return absl::DeadlineExceededError(absl::StrCat(
            Describe(), ": ", keys.size() - next, " of ", keys.size(),
            " keys did not appear before the deadline (wait): ", absl::StrJoin(missing, ", ")));
      }
    }
    return absl::OkStatus();
  }

  absl::StatusOr<int64_t> Add(absl::string_view key, int64_t delta, absl::Time deadline) override {
    STRATA_ASSIGN_OR_RETURN(int lock, Lock(key, deadline, "add"));
    Fd held(lock);
    STRATA_ASSIGN_OR_RETURN(std::optional<std::string> old, ReadValue(key));
    int64_t value = 0;
    if (old.has_value() && !absl::SimpleAtoi(*old, &value)) {
      return absl::InvalidArgumentError(absl::StrCat(
          Describe(), ": add to key '", key, "', which holds '", *old, "', not a decimal integer"));
    }
    if (__builtin_add_overflow(value, delta, &value)) {
      return absl::InvalidArgumentError(
          absl::StrCat(Describe(), ": add of ", delta, " to key '", key, "' overflows int64"));
    }
    STRATA_RETURN_IF_ERROR(WriteValue(key, absl::StrCat(value)));
    return value;
  }

  absl::StatusOr<std::string> CompareSet(absl::string_view key, absl::string_view expected,
                                         absl::string_view desired, absl::Time deadline) override {
    STRATA_ASSIGN_OR_RETURN(int lock, Lock(key, deadline, "compare_set"));
    Fd held(lock);
    STRATA_ASSIGN_OR_RETURN(std::optional<std::string> current, ReadValue(key));
    const bool matches = current.has_value() ? *current == expected : expected.empty();
    if (matches) {
      STRATA_RETURN_IF_ERROR(WriteValue(key, desired));
      return std::string(desired);
    }
    if (!current.has_value()) {
      return absl::NotFoundError(absl::StrCat(Describe(), ": compare_set on key '", key,
                                              "', which does not exist (expected '", expected,
                                              "')"));
    }
    return *std::move(current);
  }

  std::string Describe() const override { return absl::StrCat("file store ", options_.path); }

 private:
  std::string ValuePath(absl::string_view key) const {
    return absl::StrCat(options_.path, "/k.", Encode(key));
  }

  // Sleeps for `*pause` (not past `deadline`) and doubles it up to max_poll.
  // False when the deadline has passed.
  bool Pause(absl::Time deadline, absl::Duration* pause) const {
    const absl::Time now = absl::Now();
    if (now >= deadline) return false;
    absl::SleepFor(std::min(*pause, deadline - now));
    *pause = std::min(*pause * 2, options_.max_poll);
    return true;
  }

  // The value of `key`, or nullopt when it does not exist.
  absl::StatusOr<std::optional<std::string>> ReadValue(absl::string_view key) const {
    const std::string path = ValuePath(key);
    Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (fd.get() < 0) {
      if (errno == ENOENT) return std::optional<std::string>();
      return absl::UnavailableError(
          absl::StrCat(Describe(), ": cannot read key '", key, "' (", path, "): ", Errno(errno)));
    }
    std::string out;
    char buf[16384];
    while (true) {
      const ssize_t n = ::read(fd.get(), buf, sizeof(buf));
      if (n == 0) break;
      if (n < 0) {
        if (errno == EINTR) continue;
        return absl::UnavailableError(
            absl::StrCat(Describe(), ": cannot read key '", key, "': ", Errno(errno)));
      }
      out.append(buf, static_cast<size_t>(n));
    }
    return std::optional<std::string>(std::move(out));
  }

  // Writes a temporary file and renames it over the key's file, so readers
  // see the old value or the new one, never part of one.
  absl::Status WriteValue(absl::string_view key, absl::string_view value) {
    const std::string tmp = absl::StrCat(options_.path, "/t.", ::getpid(), ".", Unique());
    {
      Fd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644));
      if (fd.get() < 0) {
        return absl::UnavailableError(
            absl::StrCat(Describe(), ": cannot write key '", key, "' (", tmp, "): ", Errno(errno)));
      }
      size_t done = 0;
      while (done < value.size()) {
        const ssize_t n = ::write(fd.get(), value.data() + done, value.size() - done);
        if (n < 0) {
          if (errno == EINTR) continue;
          const int err = errno;
          ::unlink(tmp.c_str());
          return absl::UnavailableError(
              absl::StrCat(Describe(), ": cannot write key '", key, "': ", Errno(err)));
        }
        done += static_cast<size_t>(n);
      }
    }
    if (::rename(tmp.c_str(), ValuePath(key).c_str()) != 0) {
      const int err = errno;
      ::unlink(tmp.c_str());
      return absl::UnavailableError(
          absl::StrCat(Describe(), ": cannot publish key '", key, "': ", Errno(err)));
    }
    return absl::OkStatus();
  }

  // Takes the key's lock (an OFD lock, owned by the returned descriptor,
  // released when it is closed). DeadlineExceeded when another holder keeps
  // it past `deadline`.
  absl::StatusOr<int> Lock(absl::string_view key, absl::Time deadline, absl::string_view op) {
    const std::string path = absl::StrCat(options_.path, "/l.", Encode(key));
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) {
      return absl::UnavailableError(absl::StrCat(Describe(), ": cannot open the lock of key '", key,
                                                 "' (", path, "): ", Errno(errno)));
    }
    // A lock is held for a read and a rename: retry soon.
    absl::Duration pause = std::min(options_.min_poll, absl::Microseconds(20));
    while (true) {
      struct flock lk;
      std::memset(&lk, 0, sizeof(lk));
      lk.l_type = F_WRLCK;
      lk.l_whence = SEEK_SET;
      if (::fcntl(fd, F_OFD_SETLK, &lk) == 0) return fd;
      const int err = errno;
      if (err != EAGAIN && err != EACCES && err != EINTR) {
        ::close(fd);
        return absl::UnavailableError(
            absl::StrCat(Describe(), ": cannot lock key '", key, "' (", path, "): ", Errno(err)));
      }
      if (!Pause(deadline, &pause)) {
        ::close(fd);
        return absl::DeadlineExceededError(
            absl::StrCat(Describe(), ": ", op, " on key '", key,
                         "': its lock stayed held by another client until the deadline"));
      }
    }
  }

  uint64_t Unique() { return (static_cast<uint64_t>(counter_.fetch_add(1)) << 32) ^ random_; }

  const FileStoreOptions options_;
  std::atomic<uint32_t> counter_{0};
  const uint64_t random_ = (static_cast<uint64_t>(std::random_device()()) << 1) & 0xffffffffu;
};

}  // namespace

absl::StatusOr<std::shared_ptr<Store>> OpenFileStore(const FileStoreOptions& options) {
  if (options.version != FileStoreOptions::kVersion) {
    return absl::InvalidArgumentError(
        absl::StrCat("FileStoreOptions version ", options.version,
                     " is not supported (this build: ", FileStoreOptions::kVersion, ")"));
  }
  if (options.path.empty()) return absl::InvalidArgumentError("file store: the path is empty");
  if (options.min_poll <= absl::ZeroDuration() || options.max_poll < options.min_poll) {
    return absl::InvalidArgumentError(
        absl::StrCat("file store ", options.path, ": min_poll ",
                     absl::FormatDuration(options.min_poll), " must be positive and max_poll ",
                     absl::FormatDuration(options.max_poll), " at least min_poll"));
  }
  std::error_code ec;
  std::filesystem::create_directories(options.path, ec);
  if (ec) {
    return absl::UnavailableError(
        absl::StrCat("file store ", options.path, ": cannot create the directory: ", ec.message()));
  }
  if (!std::filesystem::is_directory(options.path, ec)) {
    return absl::InvalidArgumentError(
        absl::StrCat("file store ", options.path, ": not a directory"));
  }
  if (::access(options.path.c_str(), W_OK | X_OK) != 0) {
    return absl::UnavailableError(absl::StrCat("file store ", options.path,
                                               ": the directory is not writable: ", Errno(errno)));
  }
  return std::shared_ptr<Store>(std::make_shared<FileStore>(options));
}

}  // namespace strata
