// Host copies for the Gloo plugin (host_copy.h).
#include "comm/gloo/plugin/host_copy.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <random>
#include <utility>

#include "base/bool_setting.h"

namespace strata::gloo_plugin {
namespace {

// Reduced blocks are read in pieces of this many bytes, each added while it
// is still in cache.
constexpr size_t kHostReduceChunk = size_t{128} << 10;

uint64_t Address(const void* p) { return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(p)); }

}  // namespace

// torchrun's agent reaps its workers only every so often: a zombie counts.
bool ProcessGone(int64_t pid) {
  if (kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) return true;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%lld/stat", static_cast<long long>(pid));
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return false;
  char buf[512];
  const size_t got = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[got] = '\0';
  // "pid (comm) S ...": the state follows the last ')'.
  const char* close_paren = std::strrchr(buf, ')');
  return close_paren != nullptr && close_paren[1] == ' ' &&
         (close_paren[2] == 'Z' || close_paren[2] == 'X');
}

long Futex(std::atomic<uint32_t>& word, int op, uint32_t value, const timespec* timeout) {
  static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t));
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), op, value, timeout, nullptr, 0);
}

const uint64_t& ProbeWord() {
  static const uint64_t word = [] {
    std::random_device rd;
    const uint64_t v = (static_cast<uint64_t>(rd()) << 32) ^ rd();
    return v == 0 ? uint64_t{1} : v;
  }();
  return word;
}

bool HostCopyWanted(Error* error) {
  const char* env = std::getenv("STRATA_GLOO_CMA");
  if (env == nullptr || *env == '\0') return true;
  const std::optional<bool> wanted = settings_internal::ParseBool(env);
  if (!wanted) {
    *error = {kInvalidArgument, std::string("STRATA_GLOO_CMA='") + env +
                                    "' is not a boolean (0/1/true/false); see docs/launch.md"};
    return false;
  }
  return *wanted;
}

namespace {

// process_vm_readv or process_vm_writev (same signature) over one range,
// until all of it moved.
using CrossMemoryFn = ssize_t (*)(pid_t, const iovec*, unsigned long, const iovec*, unsigned long,
                                  unsigned long);

bool CrossMemory(CrossMemoryFn fn, int64_t pid, char* local, uint64_t remote, size_t bytes) {
  while (bytes > 0) {
    iovec l{local, bytes};
    iovec r{reinterpret_cast<void*>(static_cast<uintptr_t>(remote)), bytes};
    const ssize_t moved = fn(static_cast<pid_t>(pid), &l, 1, &r, 1, 0);
    if (moved < 0 && errno == EINTR) continue;
    if (moved <= 0) {
      if (moved == 0) errno = EFAULT;
      return false;
    }
    local += moved;
    remote += static_cast<uint64_t>(moved);
    bytes -= static_cast<size_t>(moved);
  }
  return true;
}

}  // namespace

bool ReadRemote(int64_t pid, uint64_t remote, void* local, size_t bytes) {
  return CrossMemory(&process_vm_readv, pid, static_cast<char*>(local), remote, bytes);
}

bool WriteRemote(int64_t pid, const void* local, uint64_t remote, size_t bytes) {
  // process_vm_writev only reads the local range.
  return CrossMemory(&process_vm_writev, pid, const_cast<char*>(static_cast<const char*>(local)),
                     remote, bytes);
}

// Boards whose creator died between creating and unlinking them (a rank 0
// killed while its group connected) stay in /dev/shm until the host
// reboots; every Create removes those of this user whose creator is gone
// (ProcessGone: no such pid, or a zombie). A board of a process in another
// pid namespace that shares /dev/shm can look orphaned; removing it only
// makes that group's late ranks give up host copies, which the connect
// agrees on.
void HostBoard::RemoveOrphans() {
  DIR* dir = opendir("/dev/shm");
  if (dir == nullptr) return;
  constexpr char kPrefix[] = "strata-gloo-";
  while (struct dirent* entry = readdir(dir)) {
    const char* name = entry->d_name;
    if (std::strncmp(name, kPrefix, sizeof(kPrefix) - 1) != 0) continue;
    char* end = nullptr;
    const long pid = std::strtol(name + sizeof(kPrefix) - 1, &end, 10);
    if (end == nullptr || *end != '-' || pid <= 0) continue;
    struct stat st;
    if (fstatat(dirfd(dir), name, &st, AT_SYMLINK_NOFOLLOW) != 0 || st.st_uid != geteuid()) {
      continue;
    }
    if (ProcessGone(pid)) shm_unlink((std::string("/") + name).c_str());
  }
  closedir(dir);
}

std::string HostBoard::Create(int n) {
  RemoveOrphans();
  std::random_device rd;
  char name[64];
  std::snprintf(name, sizeof(name), "/strata-gloo-%ld-%08x%08x", static_cast<long>(getpid()), rd(),
                rd());
  const int fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) return {};
  const bool sized = ftruncate(fd, static_cast<off_t>(Bytes(n))) == 0;
  close(fd);
  if (!sized) {
    shm_unlink(name);
    return {};
  }
  return name;
}

std::unique_ptr<HostBoard> HostBoard::Open(const std::string& name, int n) {
  const int fd = shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) return nullptr;
  void* base = mmap(nullptr, Bytes(n), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (base == MAP_FAILED) return nullptr;
  return std::unique_ptr<HostBoard>(new HostBoard(base, Bytes(n), n));
}

void HostBoard::Unlink(const std::string& name) { shm_unlink(name.c_str()); }

HostBoard::~HostBoard() { munmap(base_, bytes_); }

HostGroup::HostGroup(int rank, int size, std::vector<int64_t> pids,
                     std::shared_ptr<HostBoard> board)
    : rank_(rank), size_(size), pids_(std::move(pids)), board_(std::move(board)) {}

void HostGroup::Close() {
  uint32_t open = 0;
  board_->header().closed.compare_exchange_strong(open, static_cast<uint32_t>(rank_) + 1,
                                                  std::memory_order_acq_rel);
  for (int r = 0; r < size_; ++r) {
    Futex(board_->slot(r).round, FUTEX_WAKE, INT_MAX, nullptr);
    // And the ranks' point-to-point waits (host_p2p.h).
    HostBell& bell = board_->bell(r);
    bell.rings.fetch_add(1, std::memory_order_seq_cst);
    Futex(bell.rings, FUTEX_WAKE, INT_MAX, nullptr);
  }
}

// Enters the next round on the board and waits until every rank has
// entered it. Sleeps on each peer's counter in turn (a rank is never more
// than one round ahead of another: a round waits for all), waking every
// 20 ms to check that the peer's process still exists. Throws
// HostCopyError when a peer is gone or closed the group, or at the
// deadline.
void HostGroup::Round(const Deadline& deadline) {
  const int n = size_, r = rank_;
  const uint32_t round = ++round_;
  std::atomic<uint32_t>& mine = board_->slot(r).round;
  mine.store(round, std::memory_order_release);
  Futex(mine, FUTEX_WAKE, INT_MAX, nullptr);
  for (int i = 1; i < n; ++i) {
    const int p = (r + i) % n;
    std::atomic<uint32_t>& theirs = board_->slot(p).round;
    for (;;) {
      const uint32_t seen = theirs.load(std::memory_order_acquire);
      if (static_cast<int32_t>(seen - round) >= 0) break;
      if (const uint32_t closer = board_->header().closed.load(std::memory_order_acquire);
          closer != 0) {
        throw HostCopyError("rank " + std::to_string(closer - 1) +
                                " closed the group's connections (after a failure or an abort)",
                            kUnavailable);
      }
      if (deadline.passed()) {
        throw HostCopyError("timed out waiting for rank " + std::to_string(p), kDeadlineExceeded);
      }
      const timespec slice{0, 20 * 1000 * 1000};
      if (Futex(theirs, FUTEX_WAIT, seen, &slice) != 0 && errno == ETIMEDOUT &&
          ProcessGone(pids_[static_cast<size_t>(p)])) {
        throw HostCopyError("rank " + std::to_string(p) + " (pid " +
                                std::to_string(pids_[static_cast<size_t>(p)]) + ") is gone",
                            kUnavailable);
      }
    }
  }
}

// Tells every rank where this rank's `in` and `out` are and learns
// theirs (one round). A peer overwrites its slot only in a later
// operation, after a fence this rank must pass too. `bytes` is the
// operation's size, which every rank must give alike: a rank that gave
// another would have its peers read past its buffers, so every rank
// checks every other's (each sees a mismatch, so all fail, none waits).
void HostGroup::ShareRegions(const void* in, const void* out, size_t bytes,
                             const Deadline& deadline, std::vector<Region>* at) {
  const int n = size_;
  HostBoard::Slot& mine = board_->slot(rank_);
  mine.in = Address(in);
  mine.out = Address(out);
  mine.bytes = bytes;
  Round(deadline);
  at->resize(static_cast<size_t>(n));
  for (int p = 0; p < n; ++p) {
    const HostBoard::Slot& theirs = board_->slot(p);
    if (theirs.bytes != bytes) {
      throw HostCopyError("rank " + std::to_string(p) + " passed " + std::to_string(theirs.bytes) +
                              " bytes, this rank " + std::to_string(bytes) +
                              " (every rank must pass the same size)",
                          kInvalidArgument);
    }
    (*at)[static_cast<size_t>(p)] = Region{theirs.in, theirs.out};
  }
}

// Copies `bytes` at `remote` in rank `peer` into `local`; throws
// HostCopyError.
void HostGroup::Pull(int peer, uint64_t remote, void* local, size_t bytes) {
  const int64_t pid = pids_[static_cast<size_t>(peer)];
  if (ReadRemote(pid, remote, local, bytes)) return;
  const int err = errno;
  throw HostCopyError("reading " + std::to_string(bytes) + " bytes from rank " +
                          std::to_string(peer) + " (pid " + std::to_string(pid) +
                          ") failed: " + std::strerror(err),
                      err == ESRCH ? kUnavailable : kInternal);
}

// out (= rank r's block of the reduction) = mine + every peer's block at
// `offset` in their `in`, pulled a piece at a time into `scratch`.
void HostGroup::ReduceFromPeers(char* out, const char* mine, const std::vector<Region>& at,
                                size_t offset, size_t count, size_t elem, const ReduceFn& fn,
                                std::vector<char>& scratch) {
  const int n = size_, r = rank_;
  const size_t piece = std::max<size_t>(1, scratch.size() / elem);
  for (size_t begin = 0; begin < count; begin += piece) {
    const size_t len = std::min(piece, count - begin);
    char* target = out + begin * elem;
    if (target != mine + begin * elem) std::memcpy(target, mine + begin * elem, len * elem);
    for (int i = 1; i < n; ++i) {
      const int p = (r + i) % n;
      Pull(p, at[static_cast<size_t>(p)].in + offset + begin * elem, scratch.data(), len * elem);
      fn(target, target, scratch.data(), len);
    }
  }
}

// In place: each rank reduces its block from every peer's buffer, then,
// after a fence, copies every other block from the rank that reduced it.
// Each block is reduced by one rank, so every rank ends with the same
// bits. While rank p changes its own block p, peers read only their own
// blocks of p's buffer.
void HostGroup::AllReduce(char* data, size_t count, size_t elem, const ReduceFn& fn,
                          const Deadline& deadline) {
  const int n = size_, r = rank_;
  const Blocks blocks{count, n};
  std::vector<Region> at;
  ShareRegions(data, data, count * elem, deadline, &at);
  std::vector<char> scratch(std::min(kHostReduceChunk, blocks.len(r) * elem + elem));
  char* mine = data + blocks.begin(r) * elem;
  ReduceFromPeers(mine, mine, at, blocks.begin(r) * elem, blocks.len(r), elem, fn, scratch);
  Fence(deadline);
  for (int i = 1; i < n; ++i) {
    const int p = (r + i) % n;
    const size_t offset = blocks.begin(p) * elem;
    Pull(p, at[static_cast<size_t>(p)].in + offset, data + offset, blocks.len(p) * elem);
  }
  Fence(deadline);
}

void HostGroup::Broadcast(void* data, size_t bytes, int root, const Deadline& deadline) {
  // Every rank copies the root's buffer (the root's memory is read n - 1
  // times at once, which a host's memory serves better than a tree's
  // dependent steps).
  std::vector<Region> at;
  ShareRegions(data, data, bytes, deadline, &at);
  if (rank_ != root) Pull(root, at[static_cast<size_t>(root)].in, data, bytes);
  Fence(deadline);
}

void HostGroup::AllGather(char* out, size_t block_bytes, const Deadline& deadline) {
  std::vector<Region> at;
  ShareRegions(out, out, block_bytes, deadline, &at);
  for (int i = 1; i < size_; ++i) {
    const int p = (rank_ + i) % size_;
    const size_t offset = static_cast<size_t>(p) * block_bytes;
    Pull(p, at[static_cast<size_t>(p)].out + offset, out + offset, block_bytes);
  }
  Fence(deadline);
}

// recv = block r of every rank's `send`, reduced. `recv` may be part of
// `send` (peers read all of it but block r): then the sum is built aside
// and copied in after the fence.
void HostGroup::ReduceScatter(const char* send, char* recv, size_t count, size_t elem,
                              const ReduceFn& fn, const Deadline& deadline) {
  const int n = size_, r = rank_;
  const size_t block = count * elem, total = block * static_cast<size_t>(n);
  const bool overlaps = recv < send + total && send < recv + block;
  std::vector<char> aside(overlaps ? block : 0);
  char* out = overlaps ? aside.data() : recv;
  std::vector<Region> at;
  ShareRegions(send, recv, block, deadline, &at);
  std::vector<char> scratch(std::min(kHostReduceChunk, block + elem));
  const size_t offset = static_cast<size_t>(r) * block;
  ReduceFromPeers(out, send + offset, at, offset, count, elem, fn, scratch);
  Fence(deadline);
  if (overlaps) std::memcpy(recv, aside.data(), block);
}

void HostGroup::AllToAll(const char* send, char* recv, size_t block_bytes,
                         const Deadline& deadline) {
  std::memcpy(recv + static_cast<size_t>(rank_) * block_bytes,
              send + static_cast<size_t>(rank_) * block_bytes, block_bytes);
  std::vector<Region> at;
  ShareRegions(send, recv, block_bytes, deadline, &at);
  for (int i = 1; i < size_; ++i) {
    const int p = (rank_ + i) % size_;
    Pull(p, at[static_cast<size_t>(p)].in + static_cast<size_t>(rank_) * block_bytes,
         recv + static_cast<size_t>(p) * block_bytes, block_bytes);
  }
  Fence(deadline);
}

}  // namespace strata::gloo_plugin
