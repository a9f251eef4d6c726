#include "strata/checkpoint/replica_check.h"

#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <memory>
#include <numeric>
#include <set>
#include <thread>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "checkpoint/internal/agreement.h"
#include "strata/base/status.h"

namespace strata {

namespace {

using checkpoint_internal::Agree;
using checkpoint_internal::AgreedFailure;
using checkpoint_internal::BroadcastStatusAndText;

constexpr size_t kDigestChunk = size_t{8} << 20;
// Tensors named, with their ranks, in a mismatch message; and names listed
// after them.
constexpr size_t kDescribed = 4;
constexpr size_t kListed = 8;
// Dimensions of a shape carried in a mismatch record.
constexpr size_t kRecordDims = 8;
// Sets of ranks (holding one version of the keys) whose keys are compared.
constexpr size_t kKeySetsCompared = 4;

// 62 bits, so that -v is an int64 too and (v, -v) min-reduce to (min, -max).
int64_t Bits62(uint64_t v) { return static_cast<int64_t>(v >> 2); }

OpOptions Until(absl::Time deadline) {
  OpOptions op;
  op.timeout = std::max(absl::Milliseconds(1), deadline - absl::Now());
  return op;
}

absl::Status Run(absl::StatusOr<std::unique_ptr<Work>> work, absl::Time deadline,
                 absl::string_view what) {
  if (!work.ok()) return internal::Annotate(work.status(), what);
  return internal::Annotate((*work)->Wait(deadline), what);
}

// (v, -v) for every v, min-reduced in place: v[i] becomes the minimum,
// v[n + i] minus the maximum.
absl::Status MinMax(Communicator& comm, std::vector<int64_t>* v, absl::Time deadline,
                    absl::string_view what) {
  const size_t n = v->size();
  v->resize(2 * n);
  for (size_t i = 0; i < n; ++i) (*v)[n + i] = -(*v)[i];
  Buffer b = Buffer::Of(v->data(), v->size());
  return Run(comm.AllReduce(b, b, ReduceOp::kMin, Until(deadline)), deadline, what);
}

bool Differs(const std::vector<int64_t>& minmax, size_t i) {
  const size_t n = minmax.size() / 2;
  return minmax[i] != -minmax[n + i];
}

// Every rank's `record` (the same length on all): slot r of the result is
// group rank r's. An all-reduce (sum) over zeroed slots, so it needs only
// what every backend has.
absl::StatusOr<std::vector<int64_t>> GatherRecords(Communicator& comm,
                                                   const std::vector<int64_t>& record,
                                                   absl::Time deadline, absl::string_view what) {
  const size_t w = record.size();
  std::vector<int64_t> all(w * static_cast<size_t>(comm.size()), 0);
  std::copy(record.begin(), record.end(), all.begin() + static_cast<ptrdiff_t>(w * comm.rank()));
  Buffer b = Buffer::Of(all.data(), all.size());
  STRATA_RETURN_IF_ERROR(
      Run(comm.AllReduce(b, b, ReduceOp::kSum, Until(deadline)), deadline, what));
  return all;
}

std::string Ranks(const std::vector<int64_t>& world_ranks) {
  return absl::StrCat(world_ranks.size() == 1 ? "world rank " : "world ranks ",
                      absl::StrJoin(world_ranks, ", "));
}

// "world rank 3 holds", "world ranks 0, 2 hold": `plural` or `singular`.
std::string RanksDo(const std::vector<int64_t>& world_ranks, absl::string_view plural,
                    absl::string_view singular) {
  return absl::StrCat(Ranks(world_ranks), " ", world_ranks.size() == 1 ? singular : plural);
}

std::string Quoted(const std::vector<std::string>& keys, size_t limit) {
  std::string s;
  for (size_t i = 0; i < keys.size() && i < limit; ++i) {
    absl::StrAppend(&s, i ? ", " : "", "'", keys[i], "'");
  }
  if (keys.size() > limit) absl::StrAppend(&s, " and ", keys.size() - limit, " more");
  return s;
}

std::string GroupName(const Communicator& comm, int64_t step) {
  return absl::StrCat(step >= 0 ? absl::StrCat("checkpoint step ", step, ": ") : "", "the ",
                      comm.size(), " ranks of group '", comm.name(), "'");
}

uint64_t KeysDigest(const std::vector<const ReplicaDigest*>& sorted) {
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> st(XXH3_createState(), &XXH3_freeState);
  STRATA_CHECK(st != nullptr, "XXH3_createState failed (out of memory)");
  XXH3_64bits_reset(st.get());
  for (const ReplicaDigest* t : sorted)
    XXH3_64bits_update(st.get(), t->key.c_str(), t->key.size() + 1);
  return XXH3_64bits_digest(st.get());
}

uint64_t TensorDigest(const ReplicaDigest& t) {
  std::vector<int64_t> meta;
  meta.reserve(t.shape.size() + 2);
  meta.push_back(static_cast<int64_t>(t.dtype));
  meta.push_back(static_cast<int64_t>(t.shape.size()));
  meta.insert(meta.end(), t.shape.begin(), t.shape.end());
  return XXH3_64bits_withSeed(meta.data(), meta.size() * sizeof(int64_t), t.content);
}

// The ranks of `comm` hold different keys: names the sets of ranks and the
// keys on which they differ. Collective over `comm`; the same text on every
// rank of it.
absl::Status DescribeKeyMismatch(Communicator& comm, const std::vector<const ReplicaDigest*>& mine,
                                 uint64_t keys_digest, int64_t step, absl::Time deadline) {
  const std::string what = absl::StrCat("replica check on group '", comm.name(), "'");
  STRATA_ASSIGN_OR_RETURN(std::vector<int64_t> rec,
                          GatherRecords(comm,
                                        {comm.world_rank(), static_cast<int64_t>(mine.size()),
                                         static_cast<int64_t>(keys_digest)},
                                        deadline, what));
  // Sets of ranks holding one version of the keys, largest first.
  std::map<std::pair<int64_t, int64_t>, std::vector<int>> by_keys;  // -> group ranks
  for (int r = 0; r < comm.size(); ++r) by_keys[{rec[3 * r + 1], rec[3 * r + 2]}].push_back(r);
  std::vector<std::vector<int>> sets;
  for (auto& [unused, ranks] : by_keys) sets.push_back(std::move(ranks));
  std::sort(sets.begin(), sets.end(), [](const auto& a, const auto& b) {
    return a.size() != b.size() ? a.size() > b.size() : a.front() < b.front();
  });
  // The first rank of each compared set sends its keys.
  std::vector<std::set<std::string>> keys;
  for (size_t s = 0; s < sets.size() && s < kKeySetsCompared; ++s) {
    std::string text;
    if (comm.rank() == sets[s].front()) {
      for (const ReplicaDigest* t : mine) absl::StrAppend(&text, t->key, "\n");
    }
    absl::Status ok;
    STRATA_RETURN_IF_ERROR(
        BroadcastStatusAndText(comm, sets[s].front(), &ok, &text, deadline, what));
    std::set<std::string> k;
    for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) k.emplace(line);
    keys.push_back(std::move(k));
  }
  auto world_ranks = [&rec](const std::vector<int>& group_ranks) {
    std::vector<int64_t> w;
    for (int r : group_ranks) w.push_back(rec[3 * r]);
    std::sort(w.begin(), w.end());
    return w;
  };
  std::string msg =
      absl::StrCat(GroupName(comm, step), " should hold the same replicated tensors but do not: ");
  // "world ranks 0, 1 hold 12 tensors; world rank 2 holds 13 tensors"
  for (size_t s = 0; s < sets.size(); ++s) {
    const int64_t count = rec[3 * sets[s].front() + 1];
    absl::StrAppend(&msg, s ? "; " : "", RanksDo(world_ranks(sets[s]), "hold", "holds"), " ", count,
                    count == 1 ? " tensor" : " tensors");
  }
  const std::string ref = Ranks(world_ranks(sets[0]));
  for (size_t s = 1; s < keys.size(); ++s) {
    std::vector<std::string> extra, lacking;
    std::set_difference(keys[s].begin(), keys[s].end(), keys[0].begin(), keys[0].end(),
                        std::back_inserter(extra));
    std::set_difference(keys[0].begin(), keys[0].end(), keys[s].begin(), keys[s].end(),
                        std::back_inserter(lacking));
    const std::vector<int64_t> these = world_ranks(sets[s]);
    absl::StrAppend(&msg, ". ", Ranks(these));
    if (!extra.empty()) {
      absl::StrAppend(&msg, these.size() == 1 ? " has " : " have ", Quoted(extra, kListed),
                      " that ", ref, sets[0].size() == 1 ? " has not" : " have not");
    }
    if (!extra.empty() && !lacking.empty()) absl::StrAppend(&msg, ", and");
    if (!lacking.empty()) {
      absl::StrAppend(&msg, these.size() == 1 ? " lacks " : " lack ", Quoted(lacking, kListed));
    }
  }
  return absl::InvalidArgumentError(msg);
}

// The ranks of `comm` hold the same keys but some tensors differ (`bad`:
// their indices in `mine`): names each, with the sets of ranks holding each
// version. Collective over `comm`; the same text on every rank of it.
absl::Status DescribeTensorMismatch(Communicator& comm,
                                    const std::vector<const ReplicaDigest*>& mine,
                                    const std::vector<size_t>& bad, int64_t step,
                                    absl::Time deadline) {
  const std::string what = absl::StrCat("replica check on group '", comm.name(), "'");
  const size_t described = std::min(bad.size(), kDescribed);
  constexpr size_t kPerTensor = 3 + kRecordDims;  // content, dtype, ndim, dims
  std::vector<int64_t> record(1 + described * kPerTensor, 0);
  record[0] = comm.world_rank();
  for (size_t i = 0; i < described; ++i) {
    const ReplicaDigest& t = *mine[bad[i]];
    int64_t* r = &record[1 + i * kPerTensor];
    r[0] = static_cast<int64_t>(t.content);
    r[1] = static_cast<int64_t>(t.dtype);
    r[2] = static_cast<int64_t>(t.shape.size());
    for (size_t d = 0; d < t.shape.size() && d < kRecordDims; ++d) r[3 + d] = t.shape[d];
  }
  STRATA_ASSIGN_OR_RETURN(std::vector<int64_t> all, GatherRecords(comm, record, deadline, what));
  const size_t width = record.size();
  std::string msg = GroupName(comm, step);
  absl::StrAppend(&msg, " hold replicas of ", bad.size() == 1 ? "a tensor" : "tensors",
                  " that differ (a replicated tensor is written once, so all but one version "
                  "would be lost): ");
  for (size_t i = 0; i < described; ++i) {
    // One version: (content, dtype, ndim, dims) -> world ranks.
    std::map<std::vector<int64_t>, std::vector<int64_t>> versions;
    for (size_t r = 0; r < static_cast<size_t>(comm.size()); ++r) {
      const int64_t* rec = &all[r * width + 1 + i * kPerTensor];
      versions[std::vector<int64_t>(rec, rec + kPerTensor)].push_back(all[r * width]);
    }
    std::vector<std::pair<std::vector<int64_t>, std::vector<int64_t>>> order(versions.begin(),
                                                                             versions.end());
    for (auto& [unused, ranks] : order) std::sort(ranks.begin(), ranks.end());
    std::sort(order.begin(), order.end(),
              [](const auto& a, const auto& b) { return a.second.front() < b.second.front(); });
    absl::StrAppend(&msg, i ? "; " : "", "tensor '", mine[bad[i]]->key, "': ");
    for (size_t v = 0; v < order.size(); ++v) {
      const std::vector<int64_t>& x = order[v].first;
      absl::StatusOr<DataType> dt = DataTypeFromInt(static_cast<int>(x[1]));
      std::vector<int64_t> dims(x.begin() + 3,
                                x.begin() + 3 + std::min<int64_t>(x[2], kRecordDims));
      absl::StrAppend(&msg, v ? ", " : "", RanksDo(order[v].second, "hold", "holds"), " ",
                      dt.ok() ? DataTypeName(*dt) : "?", " [", absl::StrJoin(dims, ", "),
                      x[2] > static_cast<int64_t>(kRecordDims) ? ", ..." : "", "] with content ",
                      absl::Hex(static_cast<uint64_t>(x[0]), absl::kZeroPad16));
    }
  }
  if (bad.size() > described) {
    std::vector<std::string> rest;
    for (size_t i = described; i < bad.size(); ++i) rest.push_back(mine[bad[i]]->key);
    absl::StrAppend(&msg, "; and ", rest.size(), " more tensor(s) differ: ", Quoted(rest, kListed));
  }
  return absl::InvalidArgumentError(msg);
}

absl::Status CheckGroup(const ReplicaGroup& g, int64_t step, absl::Time deadline) {
  if (g.group.empty()) return absl::OkStatus();
  absl::StatusOr<Communicator*> resolved = g.group.Resolve();
  STRATA_RETURN_IF_ERROR_CTX(resolved.status(), "replica check");
  if ((*resolved)->size() <= 1) return absl::OkStatus();
  Communicator& comm = **resolved;
  std::vector<const ReplicaDigest*> mine;
  for (const ReplicaDigest& t : g.tensors) mine.push_back(&t);
  std::sort(mine.begin(), mine.end(),
            [](const ReplicaDigest* a, const ReplicaDigest* b) { return a->key < b->key; });
  const std::string what = absl::StrCat("replica check on group '", comm.name(), "'");
  const uint64_t keys_digest = KeysDigest(mine);
  std::vector<int64_t> head = {static_cast<int64_t>(mine.size()), Bits62(keys_digest)};
  STRATA_RETURN_IF_ERROR(MinMax(comm, &head, deadline, what));
  if (Differs(head, 0) || Differs(head, 1)) {
    return DescribeKeyMismatch(comm, mine, Bits62(keys_digest), step, deadline);
  }
  if (mine.empty()) return absl::OkStatus();
  std::vector<int64_t> v(mine.size());
  for (size_t i = 0; i < mine.size(); ++i) v[i] = Bits62(TensorDigest(*mine[i]));
  STRATA_RETURN_IF_ERROR(MinMax(comm, &v, deadline, what));
  std::vector<size_t> bad;
  for (size_t i = 0; i < mine.size(); ++i) {
    if (Differs(v, i)) bad.push_back(i);
  }
  if (bad.empty()) return absl::OkStatus();
  return DescribeTensorMismatch(comm, mine, bad, step, deadline);
}

}  // namespace

std::vector<uint64_t> ContentDigests(absl::Span<const HostBytes> buffers, int threads) {
  // (buffer, first byte) of every chunk; each chunk's digest in its slot.
  std::vector<std::pair<size_t, size_t>> chunks;
  std::vector<size_t> first_chunk(buffers.size() + 1, 0);
  for (size_t b = 0; b < buffers.size(); ++b) {
    first_chunk[b] = chunks.size();
    for (size_t off = 0; off < buffers[b].size; off += kDigestChunk) chunks.emplace_back(b, off);
  }
  first_chunk[buffers.size()] = chunks.size();
  std::vector<uint64_t> digests(chunks.size());
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i = next.fetch_add(1); i < chunks.size(); i = next.fetch_add(1)) {
      const HostBytes& b = buffers[chunks[i].first];
      const size_t off = chunks[i].second;
      digests[i] =
          XXH3_64bits(static_cast<const char*>(b.data) + off, std::min(kDigestChunk, b.size - off));
    }
  };
  const size_t n = std::min(static_cast<size_t>(std::max(threads, 1)), chunks.size());
  std::vector<std::thread> pool;  // joined below, before anything it reads goes away
  for (size_t t = 1; t < n; ++t) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
  std::vector<uint64_t> out(buffers.size());
  for (size_t b = 0; b < buffers.size(); ++b) {
    out[b] = XXH3_64bits_withSeed(digests.data() + first_chunk[b],
                                  (first_chunk[b + 1] - first_chunk[b]) * sizeof(uint64_t),
                                  buffers[b].size);
  }
  return out;
}

absl::Status CheckReplicasMatch(absl::Span<const ReplicaGroup> groups,
                                const ReplicaCheckOptions& options) {
  if (options.version != ReplicaCheckOptions::kVersion) {
    return absl::InvalidArgumentError(absl::StrCat("ReplicaCheckOptions version ", options.version,
                                                   " is not ", ReplicaCheckOptions::kVersion));
  }
  // Resolved before any collective: a handle that cannot be followed fails
  // here, on every rank alike.
  Communicator* all = nullptr;
  if (!options.all.empty()) {
    absl::StatusOr<Communicator*> resolved = options.all.Resolve();
    STRATA_RETURN_IF_ERROR_CTX(resolved.status(), "replica check");
    all = *resolved;
  }
  // Every group is checked even after one failed: the ranks of a later
  // group wait for this rank there.
  absl::Status local;
  for (const ReplicaGroup& g : groups) {
    absl::Status s = CheckGroup(g, options.step, options.deadline);
    if (local.ok()) local = std::move(s);
  }
  if (all == nullptr) return local;
  STRATA_ASSIGN_OR_RETURN(checkpoint_internal::Agreement a,
                          Agree(all, local, options.deadline, "replica check"));
  return AgreedFailure(a, all->rank(), "checking replicas");
}

}  // namespace strata
