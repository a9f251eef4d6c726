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
from strata.errors import ElasticError


class Done:
    """The Work of an async_op transfer that completed when posted."""

    def wait(self, timeout=None):
        return True


class Loopback:
    """send(tensor, dst) queues a copy of its bytes; recv(tensor, src) takes
    the oldest and checks its size (as a real group's matched recv does).
    With async_op both complete at once and return a Work."""

    def __init__(self):
        self.queue = collections.deque()
        self.sent_bytes = 0

    def send(self, t, dst, async_op=False):
        assert t.is_contiguous()
        self.queue.append((dst, t.reshape(-1).view(torch.uint8).clone()))
        self.sent_bytes += t.numel() * t.element_size()
        return Done() if async_op else None

    def recv(self, t, src, async_op=False):
        dst, data = self.queue.popleft()
        view = t.reshape(-1).view(torch.uint8)
        assert view.numel() == data.numel(), (view.numel(), data.numel())
        view.copy_(data)
        return Done() if async_op else None


class Network:
    """Several ranks: ``at(rank)`` is that rank's group, with a queue per
    (sender, receiver) channel, as a real group matches messages."""

    def __init__(self):
        self.channels = collections.defaultdict(collections.deque)

    def at(self, rank):
        net = self

        class View:
            def send(self, t, dst, async_op=False):
                net.channels[rank, dst].append(t.reshape(-1).view(torch.uint8).clone())
                return Done() if async_op else None

            def recv(self, t, src, async_op=False):
                data = net.channels[src, rank].popleft()
                view = t.reshape(-1).view(torch.uint8)
                assert view.numel() == data.numel(), (src, view.numel(), data.numel())
                view.copy_(data)
                return Done() if async_op else None
        return View()

    def sent(self, src, dst):
        return sum(d.numel() for d in self.channels[src, dst])


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
        def recv(self, t, src, async_op=False):
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
    from strata._elastic_transfer import unsaved_buffers as _unsaved_buffers
    m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    m[0].register_buffer("table", torch.arange(4.0), persistent=False)
    m[1].register_buffer("kept", torch.ones(1))
    assert sorted(_unsaved_buffers(m)) == ["0.table"]
    assert _unsaved_buffers(m)["0.table"] is m[0].table


def _trained(seed=0, steps=2, reverse=False):
    """A model (three parameters and their momentum travel raw) and its SGD
    optimizer after ``steps`` steps on the same data:
    equal, bit for bit, for every ``seed``-alike call (as data-parallel
    replicas are). ``reverse``: the optimizer holds the parameters in the
    other order (its state laid out otherwise)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.BatchNorm1d(256),
                                torch.nn.Linear(256, 256), torch.nn.Linear(256, 256),
                                torch.nn.Linear(256, 8))
    params = list(model.parameters())
    opt = torch.optim.SGD(params[::-1] if reverse else params, lr=0.1, momentum=0.9)
    x = torch.randn(32, 256, generator=torch.Generator().manual_seed(5))
    for _ in range(steps):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    return model, opt


def _shared(model, opt):
    return list(model.parameters()) + [t for st in opt.state.values() for t in st.values()]


def test_members_share_the_sending_and_the_rest_comes_from_the_first():
    net = Network()
    senders = [_trained() for _ in range(3)]
    for i, (model, _) in enumerate(senders):
        model[1].running_mean.add_(i)  # a buffer: not the same on every replica
    states = [{"values": {"mine": torch.full((20000,), float(i))},
               "optimizers": [opt.state_dict()], "models": [model.state_dict()]}
              for i, (model, opt) in enumerate(senders)]
    for part, (state, (model, opt)) in enumerate(zip(states, senders)):
        T.send_state(net.at(part + 1), [0], state, part=part, parts=3, shared=_shared(model, opt))
    # Each member sent a share of the parameters and momentum; the first
    # also the skeleton, the per-rank values and the buffer.
    assert all(net.sent(src, 0) > 256 * 256 * 4 for src in (1, 2, 3))
    own = _trained(seed=1, steps=0)[0].state_dict()
    got = T.recv_state(net.at(0), [1, 2, 3], [own])
    assert not any(net.channels.values())
    assert _equal(got, states[0])
    assert torch.equal(got["values"]["mine"], torch.zeros(20000))
    assert got["models"][0]["0.weight"] is own["0.weight"]


def test_a_member_whose_state_is_laid_out_otherwise_is_refused_by_name():
    net = Network()
    (m0, o0), (m1, o1) = _trained(), _trained(reverse=True)
    for part, (model, opt) in enumerate(((m0, o0), (m1, o1))):
        T.send_state(net.at(part + 4), [0], {"optimizers": [opt.state_dict()],
                                              "models": [model.state_dict()]},
                     part=part, parts=2, shared=_shared(model, opt))
    with pytest.raises(ElasticError, match="from group rank 5 are not those group rank 4 "
                       "assigned it"):
        T.recv_state(net.at(0), [4, 5])


def test_members_with_nothing_to_share_still_agree_with_the_newcomer():
    """A small model travels whole inside the skeleton: the other members
    send the fingerprint of an empty share, which the newcomer takes."""
    net = Network()
    small = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(small.parameters(), lr=0.1, momentum=0.9)
    state = {"optimizers": [opt.state_dict()], "models": [small.state_dict()]}
    for part in range(3):
        T.send_state(net.at(part + 1), [0], state, part=part, parts=3,
                     shared=list(small.parameters()))
    assert _equal(T.recv_state(net.at(0), [1, 2, 3]), state)
    assert not any(net.channels.values())


def test_a_state_shared_among_more_members_than_the_newcomer_knows_is_refused():
    net = Network()
    model, opt = _trained()
    T.send_state(net.at(1), [0], {"models": [model.state_dict()]}, part=0, parts=2,
                 shared=_shared(model, opt))
    with pytest.raises(ElasticError, match="shared among 2 senders, this rank expects 1"):
        T.recv_state(net.at(0), [1])
