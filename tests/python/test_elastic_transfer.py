"""The state a member sends a newcomer (strata._elastic_transfer): a pickled
skeleton plus large tensors as raw bytes. Over a loopback group (each send
queued, each recv filled from the queue), what arrives equals what was
sent, for every dtype, 0-dim and empty tensors, non-contiguous sources,
nested containers and a module's state_dict metadata; a model's tensors
arrive in the newcomer's own parameters; an optimizer and a model load it
and then step exactly as the sender does; a Prefetch receives what comes
before the models while they are built, then the models' tensors in place."""

import collections
import time

import pytest
import torch

from strata import _elastic_transfer as T


class Loopback:
    """send(tensor, dst) queues a copy of its bytes; recv(tensor, src) takes
    the oldest and checks its size (as a real group's matched recv does)."""

    def __init__(self):
        self.queue = collections.deque()
        self.sent_bytes = 0

    def send(self, t, dst):
        assert t.is_contiguous()
        self.queue.append((dst, t.reshape(-1).view(torch.uint8).clone()))
        self.sent_bytes += t.numel() * t.element_size()

    def recv(self, t, src):
        dst, data = self.queue.popleft()
        view = t.reshape(-1).view(torch.uint8)
        assert view.numel() == data.numel(), (view.numel(), data.numel())
        view.copy_(data)


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and \
            torch.equal(a, b)
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_equal, a, b))
    return a == b


def test_every_kind_of_tensor_and_container_arrives_equal():
    g = torch.Generator().manual_seed(3)
    big = torch.randn(300, 200, generator=g)
    state = {
        "f32": big,
        "transposed": big.t(),  # not contiguous: sent from a contiguous copy
        "bf16": torch.randn(70000, generator=g).to(torch.bfloat16),
        "bool": torch.rand(100000, generator=g) > 0.5,
        "i64": torch.arange(20000, dtype=torch.int64),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 5),
        "small": torch.ones(3),
        "nested": [(1, "a", torch.zeros(40000)), {"k": [None, 2.0]}],
        "step": 17,
    }
    link = Loopback()
    T.send_state(link, [1], state)
    got = T.recv_state(link, 0)
    assert not link.queue
    assert _equal(state, got)
    # Only the large tensors travel raw; the skeleton holds the small ones.
    raw = sum(t.numel() * t.element_size() for t in
              (big, big, state["bf16"], state["bool"], state["i64"], state["nested"][0][2]))
    assert raw <= link.sent_bytes < raw + 10000


def test_two_newcomers_each_get_everything():
    link = Loopback()
    state = {"w": torch.randn(50000)}
    T.send_state(link, [2, 5], state)
    assert [d for d, _ in link.queue] == [2, 2, 2, 5, 5, 5]
    assert _equal(T.recv_state(link, 0), state)
    assert _equal(T.recv_state(link, 0), state)


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.LayerNorm(256),
                               torch.nn.BatchNorm1d(256), torch.nn.Linear(256, 8))


def test_a_models_tensors_arrive_in_its_own_parameters_and_it_then_trains_identically():
    sender, newcomer = _model(0), _model(1)
    opt_s = torch.optim.SGD(sender.parameters(), lr=0.1, momentum=0.9)
    opt_n = torch.optim.SGD(newcomer.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(32, 256)
    for _ in range(2):  # momentum buffers and BatchNorm statistics exist
        opt_s.zero_grad()
        sender(x).square().mean().backward()
        opt_s.step()
    link = Loopback()
    T.send_state(link, [1], {"models": [sender.state_dict()],
                             "optimizers": [opt_s.state_dict()]})
    own = newcomer.state_dict()
    pointers = {k: v.data_ptr() for k, v in own.items()}
    got = T.recv_state(link, 0, [own])
    sd = got["models"][0]
    assert getattr(sd, "_metadata", None) == getattr(sender.state_dict(), "_metadata", None)
    # 0.weight (256 KiB) travels raw, into the newcomer's own parameter;
    # 3.weight (8 KiB) inside the skeleton, copied by load_state_dict.
    assert sd["0.weight"] is own["0.weight"] and own["0.weight"].data_ptr() == pointers["0.weight"]
    assert sd["3.weight"] is not own["3.weight"]
    newcomer.load_state_dict(sd)
    opt_n.load_state_dict(got["optimizers"][0])
    for p, q in zip(sender.parameters(), newcomer.parameters()):
        assert torch.equal(p, q)
    for opt, m in ((opt_s, sender), (opt_n, newcomer)):
        opt.zero_grad()
        m(x).square().mean().backward()
        opt.step()
    for p, q in zip(sender.parameters(), newcomer.parameters()):
        assert torch.equal(p, q)
    assert torch.equal(sender[2].running_mean, newcomer[2].running_mean)


def test_a_mismatched_place_gets_new_tensors_and_load_state_dict_names_the_difference():
    sender = torch.nn.Linear(300, 300)
    newcomer = torch.nn.Linear(300, 200)  # another model: its place is not the sender's
    link = Loopback()
    T.send_state(link, [1], {"models": [sender.state_dict()]})
    own = newcomer.state_dict()
    got = T.recv_state(link, 0, [own])
    assert got["models"][0]["weight"] is not own["weight"]
    assert torch.equal(got["models"][0]["weight"], sender.weight.detach())
    with pytest.raises(RuntimeError, match="size mismatch for weight"):
        newcomer.load_state_dict(got["models"][0])


def test_a_prefetch_takes_what_precedes_the_models_then_waits_for_them():
    sender = _model(0)
    opt = torch.optim.SGD(sender.parameters(), lr=0.1, momentum=0.9)
    sender(torch.randn(8, 256)).mean().backward()
    opt.step()
    link = Loopback()
    T.send_state(link, [1], {"optimizers": [opt.state_dict()], "models": [sender.state_dict()]})
    arriving = T.Prefetch(link, 0)
    # The models' one raw tensor (0.weight) waits for the models; the rest
    # (size, skeleton, the momentum of 0.weight) is taken meanwhile.
    deadline = time.monotonic() + 10
    while len(link.queue) > 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    assert len(link.queue) == 1
    newcomer = _model(1)
    own = newcomer.state_dict()
    arriving.built([own])
    got = arriving.result()
    assert not link.queue
    assert got["models"][0]["0.weight"] is own["0.weight"]
    newcomer.load_state_dict(got["models"][0])
    for p, q in zip(sender.parameters(), newcomer.parameters()):
        assert torch.equal(p, q)
    momentum = got["optimizers"][0]["state"][0]["momentum_buffer"]
    assert torch.equal(momentum, opt.state[sender[0].weight]["momentum_buffer"])


def test_a_prefetch_whose_build_failed_still_takes_everything():
    link = Loopback()
    state = {"models": [{"w": torch.randn(300, 300)}]}
    T.send_state(link, [1], state)
    arriving = T.Prefetch(link, 0)
    arriving.built([])  # what stand_by does when build raised
    assert _equal(arriving.result(), state)
    assert not link.queue


def test_a_prefetch_raises_what_its_receive_raised():
    class Broken(Loopback):
        def recv(self, t, src):
            raise ConnectionError("peer gone")
    arriving = T.Prefetch(Broken(), 0)
    with pytest.raises(ConnectionError, match="peer gone"):
        arriving.result()


def test_strata_layers_skip_their_initial_draw_only_while_receiving_state():
    import strata.elastic as elastic
    import strata.nn as snn
    assert not elastic.receiving_state()
    torch.manual_seed(7)
    layer = snn.ColumnParallelLinear(300, 200, group=None)
    emb = snn.VocabParallelEmbedding(50, 8, group=None)
    after = torch.rand(3)
    torch.manual_seed(7)
    ref = torch.nn.Linear(300, 200)
    ref_emb = torch.nn.Embedding(50, 8)
    assert torch.equal(layer.weight, ref.weight) and torch.equal(layer.bias, ref.bias)
    assert torch.equal(emb.weight, ref_emb.weight)
    assert torch.equal(after, torch.rand(3))
    # A newcomer's layers: shaped alike, nothing drawn (its state arrives).
    torch.manual_seed(7)
    with T.Receiving():
        assert elastic.receiving_state()
        layer = snn.ColumnParallelLinear(300, 200, group=None)
        emb = snn.VocabParallelEmbedding(50, 8, group=None)
    assert not elastic.receiving_state()
    assert layer.weight.shape == ref.weight.shape and emb.weight.shape == ref_emb.weight.shape
    drawn_next = torch.rand(3)
    torch.manual_seed(7)
    assert torch.equal(drawn_next, torch.rand(3))


def test_buffers_outside_the_state_dict_are_found_for_the_newcomer():
    from strata.elastic import _unsaved_buffers
    m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    m[0].register_buffer("table", torch.arange(4.0), persistent=False)
    m[1].register_buffer("kept", torch.ones(1))
    assert sorted(_unsaved_buffers(m)) == ["0.table"]
    assert _unsaved_buffers(m)["0.table"] is m[0].table
