#include "strata/checkpoint/reshard.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "strata/base/status.h"

namespace strata {

namespace {

std::string Dims(absl::Span<const int64_t> d) {
  return absl::StrCat("[", absl::StrJoin(d, ", "), "]");
}

absl::Status CheckBox(const TensorBox& b, absl::Span<const int64_t> global,
                      absl::string_view what) {
  if (b.offset.size() != global.size() || b.shape.size() != global.size()) {
    return absl::InvalidArgumentError(absl::StrCat(what, " box offset ", Dims(b.offset), " shape ",
                                                   Dims(b.shape), " does not match the rank of ",
                                                   Dims(global)));
  }
  for (size_t d = 0; d < global.size(); ++d) {
    if (b.offset[d] < 0 || b.shape[d] < 0 || b.offset[d] > global[d] ||
        b.shape[d] > global[d] - b.offset[d]) {
      return absl::InvalidArgumentError(absl::StrCat(what, " box at offset ", Dims(b.offset),
                                                     " of shape ", Dims(b.shape),
                                                     " does not fit in ", Dims(global)));
    }
  }
  return absl::OkStatus();
}

// Row-major strides in elements.
std::vector<uint64_t> Strides(const std::vector<int64_t>& shape) {
  std::vector<uint64_t> s(shape.size(), 1);
  for (size_t d = shape.size(); d-- > 1;) s[d - 1] = s[d] * static_cast<uint64_t>(shape[d]);
  return s;
}

uint64_t Volume(const std::vector<int64_t>& shape) {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

}  // namespace

absl::StatusOr<std::vector<CopySegment>> PlanReshard(DataType dtype,
                                                     absl::Span<const int64_t> global_shape,
                                                     absl::Span<const TensorBox> sources,
                                                     const TensorBox& target) {
  STRATA_RETURN_IF_ERROR(CheckBox(target, global_shape, "target"));
  const size_t nd = global_shape.size();
  const uint64_t esize = DataTypeSize(dtype);
  const std::vector<uint64_t> tstride = Strides(target.shape);
  std::vector<CopySegment> out;
  uint64_t covered = 0;
  std::vector<int64_t> lo(nd), len(nd);
  for (size_t si = 0; si < sources.size(); ++si) {
    const TensorBox& src = sources[si];
    STRATA_RETURN_IF_ERROR(CheckBox(src, global_shape, absl::StrCat("source ", si)));
    bool empty = false;
    for (size_t d = 0; d < nd; ++d) {
      lo[d] = std::max(src.offset[d], target.offset[d]);
      const int64_t hi = std::min(src.offset[d] + src.shape[d], target.offset[d] + target.shape[d]);
      len[d] = hi - lo[d];
      if (len[d] <= 0) empty = true;
    }
    if (empty) continue;
    const std::vector<uint64_t> sstride = Strides(src.shape);
    uint64_t volume = 1;
    for (size_t d = 0; d < nd; ++d) volume *= static_cast<uint64_t>(len[d]);
    covered += volume;
    if (nd == 0) {
      out.push_back(CopySegment{si, 0, 0, esize, 1, 0, 0});
      continue;
    }
    // The run covers dims r.. where every dim after r is whole in both boxes.
    size_t r = nd - 1;
    while (r > 0 && len[r] == src.shape[r] && len[r] == target.shape[r]) --r;
    uint64_t run = 1;
    for (size_t d = r; d < nd; ++d) run *= static_cast<uint64_t>(len[d]);
    // The dim before the run becomes the strided loop; dims before it are
    // enumerated, one segment each.
    const size_t loop_dim = r == 0 ? nd : r - 1;  // nd: no loop dim
    const uint64_t count = loop_dim == nd ? 1 : static_cast<uint64_t>(len[loop_dim]);
    const size_t outer = loop_dim == nd ? 0 : loop_dim;  // dims [0, outer) enumerated
    std::vector<int64_t> idx(outer, 0);
    while (true) {
      uint64_t so = 0, to = 0;
      for (size_t d = 0; d < nd; ++d) {
        const int64_t c = lo[d] + (d < outer ? idx[d] : 0);
        so += static_cast<uint64_t>(c - src.offset[d]) * sstride[d];
        to += static_cast<uint64_t>(c - target.offset[d]) * tstride[d];
      }
      CopySegment seg;
      seg.source = si;
      seg.source_offset = so * esize;
      seg.target_offset = to * esize;
      seg.length = run * esize;
      seg.count = count;
      seg.source_stride = loop_dim == nd ? 0 : sstride[loop_dim] * esize;
      seg.target_stride = loop_dim == nd ? 0 : tstride[loop_dim] * esize;
      if (seg.count > 1 && seg.source_stride == seg.length && seg.target_stride == seg.length) {
        // Contiguous in both: one run.
        seg.length *= seg.count;
        seg.count = 1;
        seg.source_stride = seg.target_stride = 0;
      }
      out.push_back(seg);
      // Next index over the enumerated dims, odometer style.
      bool done = true;
      for (size_t d = outer; d-- > 0;) {
        if (++idx[d] < len[d]) {
          done = false;
          break;
        }
        idx[d] = 0;
      }
      if (done) break;
    }
  }
  const uint64_t want = Volume(target.shape);
  if (covered != want) {
    if (covered > want) {
      return absl::InvalidArgumentError(
          absl::StrCat("saved boxes overlap inside the target at offset ", Dims(target.offset),
                       " of shape ", Dims(target.shape)));
    }
    return absl::NotFoundError(absl::StrCat("the saved shards cover ", covered, " of the ", want,
                                            " elements of the box at offset ", Dims(target.offset),
                                            " of shape ", Dims(target.shape)));
  }
  std::stable_sort(out.begin(), out.end(), [](const CopySegment& a, const CopySegment& b) {
    return a.source != b.source ? a.source < b.source : a.source_offset < b.source_offset;
  });
  return out;
}

void ApplyCopySegments(absl::Span<const CopySegment> segments,
                       absl::Span<const void* const> sources, void* target) {
  char* t = static_cast<char*>(target);
  for (const CopySegment& s : segments) {
    const char* src = static_cast<const char*>(sources[s.source]);
    for (uint64_t i = 0; i < s.count; ++i) {
      std::memcpy(t + s.target_offset + i * s.target_stride,
                  src + s.source_offset + i * s.source_stride, s.length);
    }
  }
}

}  // namespace strata
