"""Where gradients (and, under ZeRO-1, parameters) sit in the flat buffers
of strata.nn.DataParallel (private; pure arithmetic, no communication).

One flat buffer per dtype. Parameters are laid out in bucket order (the
order their gradients became ready in the first backward, or reverse
registration order before it); each bucket is a contiguous range of one
buffer, closed once it holds ``bucket_bytes`` (at least one parameter), its
length padded to a multiple of ``pad`` (the dp size under ZeRO-1, so that
it reduce-scatters in equal blocks). Buckets are numbered in the order they
close, which is the order every rank reduces them in.

Under ZeRO-1 dp rank r of n owns block r of every bucket: elements
``[start + r * L / n, start + (r + 1) * L / n)`` of a bucket of padded
length L. Its *shard* is those blocks concatenated in bucket order (one
contiguous buffer per dtype); a parameter's part of it, if any, is one
contiguous range of the parameter's flattened elements (a *piece*).
"""

import hashlib
import struct

import torch


class Entry:
    """One parameter of the layout. ``index``: its position among the
    wrapped module's parameters that require grad (registration order)."""

    __slots__ = ("index", "name", "param", "dtype", "shape", "numel", "tail")

    def __init__(self, index, name, param, tail):
        self.index, self.name, self.param = index, name, param
        self.dtype, self.shape, self.numel = param.dtype, tuple(param.shape), param.numel()
        self.tail = tail  # reduced over tp first (Megatron's sequence_parallel mark)


class Bucket:
    """A contiguous range [start, start + length) of one dtype's buffer."""

    __slots__ = ("index", "dtype", "start", "length", "entries", "tail", "shard_offset")

    def __init__(self, index, dtype, start, length, entries, tail, shard_offset):
        self.index, self.dtype, self.start, self.length = index, dtype, start, length
        self.entries, self.tail, self.shard_offset = entries, tail, shard_offset

    @property
    def nbytes(self):
        return self.length * _itemsize(self.dtype)

    def __repr__(self):
        names = ", ".join(e.name for e in self.entries[:3])
        more = f" and {len(self.entries) - 3} more" if len(self.entries) > 3 else ""
        return (f"<bucket {self.index}: {self.dtype} [{self.start}, {self.start + self.length}), "
                f"{len(self.entries)} parameter(s): {names}{more}>")


def _itemsize(dtype):
    return torch.empty((), dtype=dtype).element_size()


class Layout:
    """The buckets and offsets of ``entries`` (a list of Entry) laid out in
    ``order`` (entry indices; every entry exactly once)."""

    def __init__(self, entries, order, bucket_bytes, pad):
        if sorted(order) != list(range(len(entries))):
            raise AssertionError(f"order {order} is not a permutation of {len(entries)} entries")
        self.entries, self.order = entries, list(order)
        self.bucket_bytes, self.pad = int(bucket_bytes), int(pad)
        self.buckets = []
        self.offset = {}       # entry index -> offset in its dtype's buffer
        self.bucket_of = {}    # entry index -> Bucket
        self.sizes = {}        # dtype -> padded buffer length
        self.shard_sizes = {}  # dtype -> this layout's shard length (sum of L / pad)
        self.dtypes = []
        # Tail entries (summed over tp after backward) go last, in order: the
        # end of each dtype's buffer.
        for tail in (False, True):
            open_ = {}  # dtype -> [entries, bytes]
            for i in self.order:
                e = entries[i]
                if e.tail != tail:
                    continue
                if e.dtype not in self.dtypes:
                    self.dtypes.append(e.dtype)
                cur = open_.setdefault(e.dtype, [[], 0])
                cur[0].append(e)
                cur[1] += e.numel * _itemsize(e.dtype)
                if cur[1] >= self.bucket_bytes:
                    self._close(e.dtype, tail, open_.pop(e.dtype)[0])
            for dtype in self.dtypes:  # what remains open, in dtype order
                if dtype in open_:
                    self._close(dtype, tail, open_.pop(dtype)[0])

    def _close(self, dtype, tail, members):
        start = self.sizes.get(dtype, 0)
        offset = start
        for e in members:
            self.offset[e.index] = offset
            offset += e.numel
        used = offset - start
        length = -(-used // self.pad) * self.pad if used else self.pad
        b = Bucket(len(self.buckets), dtype, start, length, list(members), tail,
                   self.shard_sizes.get(dtype, 0))
        for e in members:
            self.bucket_of[e.index] = b
        self.buckets.append(b)
        self.sizes[dtype] = start + length
        self.shard_sizes[dtype] = b.shard_offset + length // self.pad

    def describe(self):
        """What every rank must agree on: the buckets' dtypes, ranges and
        members (by index, shape) and the options that shape them."""
        return [(str(b.dtype), b.start, b.length, b.tail,
                 [(e.index, e.shape) for e in b.entries]) for b in self.buckets]

    def digest(self, extra=()):
        """A 62-bit digest of describe() and ``extra`` (the same on every
        rank with the same layout and options)."""
        h = hashlib.blake2b(repr((self.bucket_bytes, self.pad, tuple(extra),
                                  self.describe())).encode(), digest_size=8)
        return struct.unpack("<q", h.digest())[0] >> 2

    def pieces(self, rank, size):
        """This layout's ZeRO-1 pieces of dp rank ``rank`` of ``size`` (the
        layout's pad): [(entry, lo, hi, buffer offset, shard offset)] where
        elements [lo, hi) of the entry's flattened parameter sit at
        ``buffer offset`` of its dtype's buffer and ``shard offset`` of the
        rank's shard, in bucket order."""
        if size != self.pad:
            raise AssertionError(f"layout padded for {self.pad} ranks, asked for {size}")
        out = []
        for b in self.buckets:
            block = b.length // size
            own_lo = b.start + rank * block
            own_hi = own_lo + block
            for e in b.entries:
                start = self.offset[e.index]
                lo, hi = max(start, own_lo), min(start + e.numel, own_hi)
                if lo < hi:
                    out.append((e, lo - start, hi - start, lo, b.shard_offset + lo - own_lo))
        return out


def intersect_pieces(mine, theirs):
    """[(entry index, lo, hi)] where two piece lists ({entry index: (lo,
    hi)}) overlap, in entry-index order."""
    out = []
    for i in sorted(mine):
        if i in theirs:
            lo = max(mine[i][0], theirs[i][0])
            hi = min(mine[i][1], theirs[i][1])
            if lo < hi:
                out.append((i, lo, hi))
    return out
