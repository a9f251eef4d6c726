// POSIX file helpers for the checkpoint layer: whole writes and reads that
// retry on EINTR and short counts, fsync of files and directories, atomic
// replacement of small files, and directory listing and removal.
//
// Every error names the path and the system error; the code follows errno
// (ENOENT -> NotFound, EACCES -> PermissionDenied, ENOSPC ->
// ResourceExhausted, ...). Reads that hit the end of a file early are
// DataLoss (a truncated file).
//
// Thread-safety: free functions without shared state; a File is
// thread-compatible.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace strata::checkpoint_internal {

// An owned file descriptor, closed on destruction.
class File {
 public:
  File() = default;
  File(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  File(File&& other) noexcept;
  File& operator=(File&& other) noexcept;
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  ~File();

  // A new file for writing; AlreadyExists if `path` exists.
  static absl::StatusOr<File> Create(const std::string& path);
  static absl::StatusOr<File> OpenForRead(const std::string& path);

  int fd() const { return fd_; }
  const std::string& path() const { return path_; }
  bool is_open() const { return fd_ >= 0; }

  absl::Status Write(const void* data, size_t size);
  // Reads exactly `size` bytes at `offset`; DataLoss if the file ends first.
  absl::Status ReadAt(void* data, size_t size, uint64_t offset) const;
  absl::StatusOr<uint64_t> Size() const;
  // fdatasync is not enough: the size of a new file is metadata.
  absl::Status Sync();
  absl::Status Close();

 private:
  int fd_ = -1;
  std::string path_;
};

// Reads exactly `size` bytes at `offset` of `fd` (named `path` in errors);
// DataLoss if the file ends first.
absl::Status ReadFully(int fd, absl::string_view path, void* data, size_t size, uint64_t offset);

// Status for a failed system call: "<what> '<path>': <strerror>".
absl::Status ErrnoError(int err, absl::string_view what, absl::string_view path);

bool PathExists(const std::string& path);
bool IsDirectory(const std::string& path);
absl::Status MakeDirectory(const std::string& path);
// mkdir -p: creates `path` and missing parents; an existing directory is fine.
absl::Status MakeDirectories(const std::string& path);
// Flushes a directory's entries (new, renamed or removed names) to disk.
absl::Status SyncDirectory(const std::string& path);
absl::Status RenamePath(const std::string& from, const std::string& to);
// Removes a file or a directory tree; a missing path is not an error.
absl::Status RemoveTree(const std::string& path);
// Names in a directory (without "." and ".."), sorted.
absl::StatusOr<std::vector<std::string>> ListDirectory(const std::string& path);
// Reads a whole small file; InvalidArgument-free: DataLoss if it is larger
// than `max_bytes` (a hostile or corrupt file must not make us allocate).
absl::StatusOr<std::string> ReadSmallFile(const std::string& path, uint64_t max_bytes);
// Writes `contents` to path.tmp, syncs it, renames it over `path` and syncs
// the directory: readers see the old or the new file, never a mix.
absl::Status WriteFileAtomically(const std::string& path, absl::string_view contents);
// Writes a new file and syncs it (not atomic: for files inside a staging
// directory that is itself renamed into place).
absl::Status WriteNewFile(const std::string& path, absl::string_view contents);

std::string JoinPath(absl::string_view a, absl::string_view b);

}  // namespace strata::checkpoint_internal
