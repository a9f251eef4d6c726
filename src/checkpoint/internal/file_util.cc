#include "checkpoint/internal/file_util.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "strata/base/status.h"

namespace strata::checkpoint_internal {

absl::Status ErrnoError(int err, absl::string_view what, absl::string_view path) {
  return absl::Status(absl::ErrnoToStatusCode(err),
                      absl::StrCat(what, " '", path, "': ", strerror(err)));
}

File::File(File&& other) noexcept : fd_(other.fd_), path_(std::move(other.path_)) {
  other.fd_ = -1;
}

File& File::operator=(File&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.fd_;
    path_ = std::move(other.path_);
    other.fd_ = -1;
  }
  return *this;
}

File::~File() {
  if (fd_ >= 0) ::close(fd_);
}

absl::StatusOr<File> File::Create(const std::string& path) {
  const int fd = ::open(path.c_str(), O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoError(errno, "cannot create", path);
  return File(fd, path);
}

absl::StatusOr<File> File::OpenForRead(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoError(errno, "cannot open", path);
  return File(fd, path);
}

absl::Status File::Write(const void* data, size_t size) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    // Linux writes at most ~2 GiB per call; ask for less to keep the loop simple.
    const size_t n = std::min<size_t>(size, size_t{1} << 30);
    const ssize_t w = ::write(fd_, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return ErrnoError(errno, "cannot write", path_);
    }
    p += w;
    size -= static_cast<size_t>(w);
  }
  return absl::OkStatus();
}

absl::Status File::ReadAt(void* data, size_t size, uint64_t offset) const {
  return ReadFully(fd_, path_, data, size, offset);
}

absl::Status ReadFully(int fd, absl::string_view path, void* data, size_t size, uint64_t offset) {
  char* p = static_cast<char*>(data);
  const uint64_t start = offset;
  while (size > 0) {
    const size_t n = std::min<size_t>(size, size_t{1} << 30);
    const ssize_t r = ::pread(fd, p, n, static_cast<off_t>(offset));
    if (r < 0) {
      if (errno == EINTR) continue;
      return ErrnoError(errno, "cannot read", path);
    }
    if (r == 0) {
      return absl::DataLossError(absl::StrCat("file '", path, "' ends at byte ", offset, " but ",
                                              size, " more bytes were expected (reading from byte ",
                                              start, "): the file is truncated"));
    }
    p += r;
    offset += static_cast<uint64_t>(r);
    size -= static_cast<size_t>(r);
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> File::Size() const {
  struct stat st;
  if (::fstat(fd_, &st) != 0) return ErrnoError(errno, "cannot stat", path_);
  return static_cast<uint64_t>(st.st_size);
}

absl::Status File::Sync() {
  if (::fsync(fd_) != 0) return ErrnoError(errno, "cannot fsync", path_);
  return absl::OkStatus();
}

absl::Status File::Close() {
  if (fd_ < 0) return absl::OkStatus();
  const int fd = fd_;
  fd_ = -1;
  // close() may report a deferred write error (NFS); it must not be lost.
  if (::close(fd) != 0) return ErrnoError(errno, "cannot close", path_);
  return absl::OkStatus();
}

bool PathExists(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0;
}

bool IsDirectory(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

absl::Status MakeDirectory(const std::string& path) {
  if (::mkdir(path.c_str(), 0755) != 0) return ErrnoError(errno, "cannot create directory", path);
  return absl::OkStatus();
}

absl::Status MakeDirectories(const std::string& path) {
  if (path.empty() || IsDirectory(path)) return absl::OkStatus();
  const size_t slash = path.find_last_of('/');
  if (slash != std::string::npos && slash > 0) {
    STRATA_RETURN_IF_ERROR(MakeDirectories(path.substr(0, slash)));
  }
  if (::mkdir(path.c_str(), 0755) != 0 && !(errno == EEXIST && IsDirectory(path))) {
    return ErrnoError(errno, "cannot create directory", path);
  }
  return absl::OkStatus();
}

absl::Status SyncDirectory(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return ErrnoError(errno, "cannot open directory", path);
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) return ErrnoError(err, "cannot fsync directory", path);
  return absl::OkStatus();
}

absl::Status RenamePath(const std::string& from, const std::string& to) {
  if (::rename(from.c_str(), to.c_str()) != 0) {
    return ErrnoError(errno, absl::StrCat("cannot rename to '", to, "' from"), from);
  }
  return absl::OkStatus();
}

absl::Status RemoveTree(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return absl::OkStatus();
    return ErrnoError(errno, "cannot stat", path);
  }
  if (S_ISDIR(st.st_mode)) {
    STRATA_ASSIGN_OR_RETURN(std::vector<std::string> names, ListDirectory(path));
    for (const std::string& name : names) {
      STRATA_RETURN_IF_ERROR(RemoveTree(JoinPath(path, name)));
    }
    if (::rmdir(path.c_str()) != 0 && errno != ENOENT) {
      return ErrnoError(errno, "cannot remove directory", path);
    }
    return absl::OkStatus();
  }
  if (::unlink(path.c_str()) != 0 && errno != ENOENT)
    return ErrnoError(errno, "cannot remove", path);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> ListDirectory(const std::string& path) {
  DIR* dir = ::opendir(path.c_str());
  if (dir == nullptr) return ErrnoError(errno, "cannot list directory", path);
  std::vector<std::string> names;
  errno = 0;
  while (struct dirent* e = ::readdir(dir)) {
    const absl::string_view name(e->d_name);
    if (name != "." && name != "..") names.emplace_back(name);
  }
  const int err = errno;
  ::closedir(dir);
  if (err != 0) return ErrnoError(err, "cannot list directory", path);
  std::sort(names.begin(), names.end());
  return names;
}

absl::StatusOr<std::string> ReadSmallFile(const std::string& path, uint64_t max_bytes) {
  STRATA_ASSIGN_OR_RETURN(File f, File::OpenForRead(path));
  STRATA_ASSIGN_OR_RETURN(uint64_t size, f.Size());
  if (size > max_bytes) {
    return absl::DataLossError(
        absl::StrCat("file '", path, "' is ", size, " bytes, more than the limit of ", max_bytes));
  }
  std::string out(size, '\0');
  STRATA_RETURN_IF_ERROR(f.ReadAt(out.data(), size, 0));
  return out;
}

absl::Status WriteNewFile(const std::string& path, absl::string_view contents) {
  STRATA_ASSIGN_OR_RETURN(File f, File::Create(path));
  STRATA_RETURN_IF_ERROR(f.Write(contents.data(), contents.size()));
  STRATA_RETURN_IF_ERROR(f.Sync());
  return f.Close();
}

absl::Status WriteFileAtomically(const std::string& path, absl::string_view contents) {
  const std::string tmp = absl::StrCat(path, ".tmp");
  STRATA_RETURN_IF_ERROR(RemoveTree(tmp));  // left over from a crash
  STRATA_RETURN_IF_ERROR(WriteNewFile(tmp, contents));
  STRATA_RETURN_IF_ERROR(RenamePath(tmp, path));
  const size_t slash = path.rfind('/');
  return SyncDirectory(slash == std::string::npos ? "." : path.substr(0, slash == 0 ? 1 : slash));
}

std::string JoinPath(absl::string_view a, absl::string_view b) {
  if (a.empty()) return std::string(b);
  if (absl::EndsWith(a, "/")) return absl::StrCat(a, b);
  return absl::StrCat(a, "/", b);
}

}  // namespace strata::checkpoint_internal
