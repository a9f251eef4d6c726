"""The tensor-parallel layers of :mod:`strata.nn` (column/row-parallel
linear, vocab-parallel embedding and cross-entropy) and the sharded
parameter they hold. Re-exported by strata.nn, which documents them; the
composite modules built from them are in _tp_models.py.
"""

import math

import torch
import torch.nn.functional as F

from . import _tp_comm as C
from .axes import Axis
from .errors import InvalidArgument

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy",
    "tp_group",
    "tensor_sharding",
    "ShardedParameter",
]


def tp_group(group):
    """The tensor-parallel group of ``group``: a World's "tp" group, a
    Group itself, or None (one rank)."""
    if group is None:
        return None
    if hasattr(group, "group") and hasattr(group, "mesh"):  # strata.World
        return group.group(Axis.TP)
    if hasattr(group, "all_reduce") and hasattr(group, "size"):  # strata.Group
        return group
    raise InvalidArgument(f"group must be a strata.World, a strata.Group or None, got "
                          f"{type(group).__module__}.{type(group).__qualname__}")


# What a ShardedParameter's layout carries onto: functions whose result is
# the parameter's data or a tensor laid out like it. ``model.state_dict()``
# detaches; torch's optimizers make their per-parameter states (Adam's
# exp_avg, exp_avg_sq, RMSprop's square_avg, ...) with ``torch.zeros_like``.
_CARRIES_LAYOUT = frozenset({
    torch.Tensor.detach, torch.detach, torch.Tensor.clone, torch.clone,
    torch.Tensor.data.__get__,
    torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like,
    torch.rand_like, torch.randn_like, torch.randint_like,
})


_NO_SUBCLASS = torch._C.DisableTorchFunctionSubclass


def _check_sharding(sharding, shape):
    ok = (isinstance(sharding, tuple) and len(sharding) == 3
          and all(isinstance(v, int) and not isinstance(v, bool) for v in sharding))
    if ok:
        dim, index, count = sharding
        ok = 0 <= dim < len(shape) and 0 <= index < count
    if not ok:
        raise InvalidArgument(f"ShardedParameter: sharding must be (dim, index, count) with "
                              f"0 <= dim < {len(shape)} (the parameter's shape is "
                              f"{tuple(shape)}) and 0 <= index < count, got {sharding!r}")
    return sharding


class ShardedParameter(torch.nn.Parameter):
    """A parameter that is this rank's contiguous shard of a larger tensor:
    ``tensor_parallel_sharding = (dim, index, count)`` says that the global
    tensor is ``count`` shards of this shape concatenated along ``dim``, and
    that this rank holds shard ``index``. strata.nn's tensor-parallel layers
    make their split parameters ShardedParameters; a tensor-parallel layer of
    your own can too (``ShardedParameter(local, sharding=(0, tp.rank,
    tp.size))``).

    The layout travels to the tensors a checkpoint is taken from, as a
    DTensor's does for torch.distributed.checkpoint: ``detach()``,
    ``clone()``, ``.data`` and the ``*_like`` functions return plain tensors
    that carry ``tensor_parallel_sharding``, so ``model.state_dict()`` and
    the states torch's optimizers create with ``torch.zeros_like(param)``
    (``optimizer.state_dict()``'s ``exp_avg``, ``exp_avg_sq``) save as boxes
    of the global tensor. Every other operation returns a plain tensor:
    activations and gradients are not ShardedParameters, and a forward pays
    one Python call per operation that takes the parameter.

    Pickling (``torch.save(model)``) gives back a plain Parameter with the
    ``tensor_parallel_sharding`` attribute; ``copy.deepcopy`` a
    ShardedParameter.
    """

    def __new__(cls, data, requires_grad=True, *, sharding):
        if not isinstance(data, torch.Tensor):
            raise InvalidArgument(f"ShardedParameter: data must be a tensor, got "
                                  f"{type(data).__name__}")
        sharding = _check_sharding(sharding, data.shape)
        with _NO_SUBCLASS():
            data = data.detach()
        p = torch.Tensor._make_subclass(cls, data, requires_grad)
        p.tensor_parallel_sharding = sharding
        return p

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # Called for every operation that takes the parameter (its .grad
        # too): kept to the least work.
        with _NO_SUBCLASS():
            out = func(*args, **kwargs) if kwargs else func(*args)
        if func in _CARRIES_LAYOUT and isinstance(out, torch.Tensor):
            src = args[0] if args else kwargs.get("input")
            sharding = getattr(src, "tensor_parallel_sharding", None)
            if sharding is not None:
                out.tensor_parallel_sharding = sharding
        return out

    def __deepcopy__(self, memo):
        if id(self) in memo:
            return memo[id(self)]
        with _NO_SUBCLASS():
            data = self.data.clone(memory_format=torch.preserve_format)
        out = type(self)(data, self.requires_grad, sharding=self.tensor_parallel_sharding)
        memo[id(self)] = out
        return out

    def __repr__(self):
        dim, index, count = self.tensor_parallel_sharding
        with _NO_SUBCLASS():
            body = repr(self.detach().requires_grad_(self.requires_grad))
        return f"ShardedParameter (dim {dim}, shard {index} of {count}) containing:\n{body}"


# torch's optimizers pick their multi-tensor (foreach) or fused kernels on
# CUDA only for parameters whose type is listed here (torch.distributed.tensor
# registers DTensor the same way); unlisted, a ShardedParameter would send
# them to the per-parameter loop. A ShardedParameter computes as a plain
# tensor, so those kernels apply unchanged. The list is torch's, private:
# without it the loop is used, which is correct, only slower.
try:
    from torch.optim import optimizer as _torch_optimizer

    if ShardedParameter not in _torch_optimizer._foreach_supported_types:
        _torch_optimizer._foreach_supported_types.append(ShardedParameter)
except (ImportError, AttributeError):  # pragma: no cover: another torch
    pass


def _divisible(what, value, n, layer):
    if value % n:
        raise InvalidArgument(f"{layer}: {what} {value} is not divisible by the tensor-parallel "
                              f"size {n}")


def _receiving():
    """Whether this layer's values will be overwritten by a member's (it is
    made by a placed spare or a joiner, strata.elastic.receiving_state)."""
    from ._elastic_transfer import receiving_state
    return receiving_state()


def _linear_init(out_features, in_features, bias):
    """The unsharded weight and bias as torch.nn.Linear(in, out) draws them
    on the CPU: kaiming_uniform_(a=sqrt(5)) then U(-1/sqrt(in), 1/sqrt(in)).
    Not drawn (left uninitialised) where a member's values will arrive."""
    w = torch.empty(out_features, in_features)
    if _receiving():
        return w, torch.empty(out_features) if bias else None
    torch.nn.init.kaiming_uniform_(w, a=math.sqrt(5))
    b = None
    if bias:
        bound = 1.0 / math.sqrt(in_features) if in_features > 0 else 0.0
        b = torch.empty(out_features).uniform_(-bound, bound)
    return w, b


def _param(t, dtype, device, shard_dim=None, group=None):
    """A parameter of ``t`` in ``dtype`` on ``device``; with ``shard_dim``, a
    ShardedParameter: this rank's contiguous shard of a tensor split along
    that dim over ``group``."""
    data = t.to(device=device, dtype=dtype or torch.get_default_dtype()).contiguous()
    if shard_dim is None:
        return torch.nn.Parameter(data)
    return ShardedParameter(data, sharding=(shard_dim, C.rank_of(group), C.size_of(group)))


def tensor_sharding(module):
    """{local parameter name: (dim, index, count)} for the parameters of
    ``module`` (and its children) that are shards of a larger tensor: the
    global tensor is the ``count`` shards concatenated along ``dim``, this
    rank holding shard ``index``. Parameters not listed are whole (and
    replicated over tp). Names are those of ``module.named_parameters()``."""
    return {name: p.tensor_parallel_sharding
            for name, p in module.named_parameters(remove_duplicate=False)
            if getattr(p, "tensor_parallel_sharding", None) is not None}


def _rows2d(t):
    return t.reshape(-1, t.shape[-1])


class _ColumnLinear(torch.autograd.Function):
    """y = x W^T + b with W split by rows. Forward: all-gather of the token
    shards under sequence parallelism. Backward: grad_input's all-reduce
    (reduce-scatter) runs while the weight gradient is computed; the input
    is gathered again rather than kept, as Megatron-Core does."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, sequence_parallel):
        total = C.all_gather_rows(x, group) if sequence_parallel else x
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.sp, ctx.has_bias = group, sequence_parallel, bias is not None
        return F.linear(total, weight, bias)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        group, sp = ctx.group, ctx.sp
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        g = g.contiguous()
        total, gather = x, None
        if sp and need_w:
            total, gather = C.all_gather_rows(x, group, async_op=True)
        grad_x = comm = None
        if need_x:
            gx = g.matmul(weight)
            if sp:
                grad_x, comm = C.reduce_scatter_rows(gx, group, async_op=True)
            else:
                grad_x, comm = gx, C.all_reduce(gx, group, async_op=True)
        grad_w = grad_b = None
        if need_w:
            if gather is not None:
                gather.wait()
            grad_w = _rows2d(g).t().matmul(_rows2d(total))
        if need_b and ctx.has_bias:
            grad_b = _rows2d(g).sum(0)
        if comm is not None:
            comm.wait()
        return grad_x, grad_w, grad_b, None, None


class _RowLinear(torch.autograd.Function):
    """y = sum over ranks of x_r W_r^T, + b, with W split by columns.
    Forward: all-reduce (reduce-scatter by tokens under sequence
    parallelism) of the partial products; the bias is added after it.
    Backward: all-gather of grad_output under sequence parallelism (which
    makes the bias gradient complete on every rank); when the input was not
    already split, grad_input's all-gather runs while the weight gradient is
    computed."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, sequence_parallel, input_is_parallel):
        xl = x if input_is_parallel else C.split_last(x, group)
        out = F.linear(xl, weight).contiguous()
        if sequence_parallel:
            out = C.reduce_scatter_rows(out, group)
        else:
            C.all_reduce(out, group)
        if bias is not None:
            out.add_(bias)  # `out` is this function's own tensor: no second one
        ctx.save_for_backward(xl, weight)
        ctx.group, ctx.sp, ctx.parallel_in = group, sequence_parallel, input_is_parallel
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    def backward(ctx, g):
        xl, weight = ctx.saved_tensors
        group = ctx.group
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        g = g.contiguous()
        if ctx.sp:
            g = C.all_gather_rows(g, group)
        grad_x = gather = None
        if need_x:
            gxl = g.matmul(weight)
            if ctx.parallel_in:
                grad_x = gxl
            else:
                # All-gather along the last dim, as rows of the transposed gradient.
                gathered, gather = C.all_gather_rows(gxl.movedim(-1, 0).contiguous(), group,
                                                     async_op=True)
        grad_w = _rows2d(g).t().matmul(_rows2d(xl)) if need_w else None
        grad_b = _rows2d(g).sum(0) if need_b and ctx.has_bias else None
        if gather is not None:
            gather.wait()
            grad_x = gathered.movedim(0, -1).contiguous()
        return grad_x, grad_w, grad_b, None, None, None


class ColumnParallelLinear(torch.nn.Module):
    """Linear layer with its weight split by rows (output features):
    ``weight`` is this rank's contiguous shard [out / tp, in], ``bias``
    [out / tp]. Input [..., in] (replicated; under sequence parallelism,
    this rank's [seq / tp, ...] token shard); output [..., out / tp], or
    [..., out] with ``gather_output``. With ``skip_bias_add`` returns
    ``(output, bias)`` and does not add the bias (the bias is gathered to
    [out] along with the output under ``gather_output``)."""

    def __init__(self, in_features, out_features, *, group, bias=True, gather_output=False,
                 sequence_parallel=False, skip_bias_add=False, dtype=None, device=None):
        super().__init__()
        self.group = tp_group(group)
        n = C.size_of(self.group)
        _divisible("out_features", out_features, n, "ColumnParallelLinear")
        if gather_output and sequence_parallel:
            raise InvalidArgument("ColumnParallelLinear: gather_output cannot be combined with "
                                  "sequence_parallel")
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.skip_bias_add = skip_bias_add
        w, b = _linear_init(out_features, in_features, bias)
        local = out_features // n
        start = C.rank_of(self.group) * local
        self.weight = _param(w[start:start + local], dtype, device, 0, self.group)
        if bias:
            self.bias = _param(b[start:start + local], dtype, device, 0, self.group)
        else:
            self.register_parameter("bias", None)

    def forward(self, x):
        bias = None if self.skip_bias_add else self.bias
        out = _ColumnLinear.apply(x, self.weight, bias, self.group, self.sequence_parallel)
        if self.gather_output:
            out = C.GatherFromTP.apply(out, self.group)
        if not self.skip_bias_add:
            return out
        bias = self.bias
        if bias is not None and self.gather_output:
            # The output is whole, so the bias returned with it is too.
            bias = C.GatherFromTP.apply(bias, self.group)
        return out, bias

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"(local {self.weight.shape[0]}), gather_output={self.gather_output}, "
                f"sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(torch.nn.Module):
    """Linear layer with its weight split by columns (input features):
    ``weight`` is this rank's contiguous shard [out, in / tp], ``bias``
    [out] (whole; added once after the reduction). Input [..., in / tp]
    with ``input_is_parallel``, else [..., in] (this rank takes its
    columns); output [..., out], or this rank's [seq / tp, ..., out] token
    shard under sequence parallelism (which needs ``input_is_parallel``).
    With ``skip_bias_add`` returns ``(output, bias)``."""

    def __init__(self, in_features, out_features, *, group, bias=True, input_is_parallel=False,
                 sequence_parallel=False, skip_bias_add=False, dtype=None, device=None):
        super().__init__()
        self.group = tp_group(group)
        n = C.size_of(self.group)
        _divisible("in_features", in_features, n, "RowParallelLinear")
        if sequence_parallel and not input_is_parallel:
            raise InvalidArgument("RowParallelLinear: sequence_parallel needs input_is_parallel")
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.skip_bias_add = skip_bias_add
        w, b = _linear_init(out_features, in_features, bias)
        local = in_features // n
        start = C.rank_of(self.group) * local
        self.weight = _param(w[:, start:start + local], dtype, device, 1, self.group)
        if bias:
            self.bias = _param(b, dtype, device)
        else:
            self.register_parameter("bias", None)

    def forward(self, x):
        bias = None if self.skip_bias_add else self.bias
        out = _RowLinear.apply(x, self.weight, bias, self.group, self.sequence_parallel,
                               self.input_is_parallel)
        if not self.skip_bias_add:
            return out
        b = self.bias
        if b is not None and self.sequence_parallel:
            # The caller adds it to its token shard: sum the gradient over tp.
            b = C.CopyToTP.apply(b, self.group)
        return out, b

    def extra_repr(self):
        return (f"in_features={self.in_features} (local {self.weight.shape[1]}), "
                f"out_features={self.out_features}, input_is_parallel={self.input_is_parallel}, "
                f"sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(torch.nn.Module):
    """Embedding with the vocabulary split across tp: ``weight`` is this
    rank's rows [num_embeddings / tp, embedding_dim] (ids
    [rank * V / tp, (rank + 1) * V / tp)). Ids outside the range give zero
    rows, summed over the group (all-reduce, or reduce-scatter by tokens
    under sequence parallelism: ids [seq, batch] give [seq / tp, batch,
    dim])."""

    def __init__(self, num_embeddings, embedding_dim, *, group, sequence_parallel=False,
                 dtype=None, device=None):
        super().__init__()
        self.group = tp_group(group)
        n = C.size_of(self.group)
        _divisible("num_embeddings", num_embeddings, n, "VocabParallelEmbedding")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.sequence_parallel = sequence_parallel
        full = torch.empty(num_embeddings, embedding_dim)
        if not _receiving():
            torch.nn.init.normal_(full)  # as torch.nn.Embedding
        local = num_embeddings // n
        self.vocab_start = C.rank_of(self.group) * local
        self.vocab_end = self.vocab_start + local
        self.weight = _param(full[self.vocab_start:self.vocab_end], dtype, device, 0, self.group)

    def forward(self, ids):
        if ids.dtype not in (torch.int64, torch.int32):
            raise InvalidArgument(f"VocabParallelEmbedding: ids must be int64 or int32, got "
                                  f"{ids.dtype}")
        bad = (ids < 0) | (ids >= self.num_embeddings)
        if bool(bad.any()):
            raise InvalidArgument(f"VocabParallelEmbedding: id {int(ids[bad][0])} is outside the "
                                  f"vocabulary [0, {self.num_embeddings})")
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return C.ReduceScatterToSP.apply(out, self.group)
        return C.ReduceFromTP.apply(out, self.group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, ignore_index, label_smoothing):
        z = logits.float()
        m = z.max(dim=-1).values.contiguous()
        C.all_reduce(m, group, op="max")
        zs = z - m.unsqueeze(-1)
        v_local = z.shape[-1]
        vocab = v_local * C.size_of(group)
        start = C.rank_of(group) * v_local
        ignored = target == ignore_index
        t_local = target - start
        mine = (t_local >= 0) & (t_local < v_local) & ~ignored
        t_idx = t_local.clamp(0, v_local - 1).unsqueeze(-1)
        pred = zs.gather(-1, t_idx).squeeze(-1) * mine
        sums = torch.stack([zs.exp().sum(-1), pred, zs.sum(-1)]).contiguous()
        C.all_reduce(sums, group)
        lse = sums[0].log()
        e = label_smoothing
        loss = lse - (1.0 - e) * sums[1] - e * sums[2] / vocab
        loss = loss.masked_fill(ignored, 0.0)
        ctx.save_for_backward(zs, lse, t_idx, mine, ignored)
        ctx.e, ctx.vocab, ctx.dtype = e, vocab, logits.dtype
        return loss

    @staticmethod
    def backward(ctx, g):
        zs, lse, t_idx, mine, ignored = ctx.saved_tensors
        e = ctx.e
        g = g.float().masked_fill(ignored, 0.0).unsqueeze(-1)
        grad = (zs - lse.unsqueeze(-1)).exp() - e / ctx.vocab
        onehot = torch.zeros_like(grad).scatter_(-1, t_idx, mine.unsqueeze(-1).float())
        grad = (grad - (1.0 - e) * onehot) * g
        return grad.to(ctx.dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits, target, *, group, ignore_index=-100,
                                 label_smoothing=0.0):
    """Per-token cross-entropy over logits split by vocabulary.

    ``logits`` [..., vocab / tp] (this rank's vocabulary columns, e.g. the
    output of a ColumnParallelLinear to the vocabulary), ``target`` [...]
    int64 ids in [0, vocab) or ``ignore_index``. Returns the fp32 loss of
    each token ([...], 0 where ignored): equal to
    ``F.cross_entropy(full_logits.flatten(0, -2), target.flatten(),
    reduction="none", ignore_index=..., label_smoothing=...)``. For torch's
    default mean: ``loss.sum() / (target != ignore_index).sum()``. The max,
    the target logit and the sum of exponentials are reduced across the
    group (two all-reduces); backward is local."""
    group = tp_group(group)
    if not 0.0 <= label_smoothing < 1.0:
        raise InvalidArgument(f"vocab_parallel_cross_entropy: label_smoothing {label_smoothing} "
                              "is outside [0, 1)")
    if tuple(target.shape) != tuple(logits.shape[:-1]):
        raise InvalidArgument(f"vocab_parallel_cross_entropy: target shape {tuple(target.shape)} "
                              f"does not match logits shape {tuple(logits.shape)} without its "
                              "last dimension")
    vocab = logits.shape[-1] * C.size_of(group)
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab))
    if bool(bad.any()):
        raise InvalidArgument(f"vocab_parallel_cross_entropy: target {int(target[bad][0])} is "
                              f"outside the vocabulary [0, {vocab}) and is not ignore_index "
                              f"{ignore_index}")
    return _VocabParallelCrossEntropy.apply(logits, target, group, ignore_index,
                                            float(label_smoothing))


# Public names say where users find them (pickles of a ShardedParameter
# refer to strata.nn.ShardedParameter, which stays importable).
for _name in __all__:
    _obj = globals()[_name]
    if getattr(_obj, "__module__", None) == __name__:
        _obj.__module__ = "strata.nn"
del _name, _obj
