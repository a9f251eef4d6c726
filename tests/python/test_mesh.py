"""strata.Mesh from Python: the exact API other code relies on, errors, and
agreement with an independent implementation of Megatron-Core's rule."""

import itertools

import pytest

import strata


def reference_groups(sizes, mask):
    """Groups from the definition: ranks agreeing on unmasked coordinates,
    members ordered by masked coordinates (first axis fastest)."""
    world = 1
    for s in sizes:
        world *= s
    groups = {}
    for r in range(world):
        coords, stride = [], 1
        for s in sizes:
            coords.append((r // stride) % s)
            stride *= s
        gkey = tuple(reversed([c for c, m in zip(coords, mask) if not m]))
        mkey = tuple(reversed([c for c, m in zip(coords, mask) if m]))
        groups.setdefault(gkey, {})[mkey] = r
    return [[members[k] for k in sorted(members)] for _, members in sorted(groups.items())]


def dense_sizes(mesh):
    size = {"tp": mesh.tp, "cp": mesh.cp, "ep": 1, "dp": mesh.dp, "pp": mesh.pp}
    return [size[a] for a in mesh.order.split("-")]


def test_signature_and_attributes():
    m = strata.Mesh(8, tp=2, pp=2)
    assert (m.world_size, m.tp, m.pp, m.cp, m.dp, m.ep, m.etp, m.edp) == (8, 2, 2, 1, 2, 1, 2, 2)
    assert m.order == "tp-cp-ep-dp-pp"
    assert m.ranks_per_node is None
    with pytest.raises(TypeError):
        strata.Mesh(8, 2)  # sizes are keyword-only


def test_groups_dp2_tp2_pp2():
    m = strata.Mesh(8, tp=2, pp=2)
    assert m.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert m.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert m.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert m.groups("tp-pp") == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert m.group_of(5, "tp") == [4, 5]
    assert m.coords(5) == {"tp": 1, "cp": 0, "dp": 0, "pp": 1}
    assert m.rank(tp=1, dp=0, pp=1) == 5
    assert m.embedding_group(2) == [2, 6]
    assert m.pipeline_next(2) == 6 and m.pipeline_prev(2) == 6


@pytest.mark.parametrize(
    "world,kw",
    [
        (16, dict(tp=2, pp=4)),
        (16, dict(tp=2, cp=2, pp=2)),
        (32, dict(tp=2, cp=2, pp=2, order="tp-cp-dp-pp")),
        (24, dict(tp=3, pp=2)),
        (16, dict(tp=4, order="tp-pp-dp")),
        (64, dict(tp=2, cp=2, pp=4, order="tp-dp-cp-pp")),
    ],
)
def test_dense_groups_match_reference(world, kw):
    m = strata.Mesh(world, **kw)
    order = m.order.split("-")
    for k in range(1, 5):
        for combo in itertools.combinations(["tp", "cp", "dp", "pp"], k):
            mask = [a in combo for a in order]
            assert m.groups("-".join(combo)) == reference_groups(dense_sizes(m), mask), combo


def test_expert_groups_match_reference():
    m = strata.Mesh(32, tp=2, cp=2, pp=2, ep=4, etp=1)
    assert m.edp == 32 // (1 * 4 * 2)
    size = {"tp": 1, "cp": 1, "ep": 4, "dp": m.edp, "pp": 2}
    order = m.order.split("-")
    sizes = [size[a] for a in order]
    for axes in ["ep", "tp", "dp", "pp", "tp-ep", "tp-ep-pp", "ep-dp"]:
        mask = [a in axes.split("-") for a in order]
        assert m.expert_groups(axes) == reference_groups(sizes, mask), axes
    assert m.expert_groups("pp") == m.groups("pp")
    c = m.coords(13)
    assert {"etp", "ep", "edp"} <= set(c)
    assert m.rank(etp=c["etp"], ep=c["ep"], edp=c["edp"], pp=c["pp"]) == 13


def test_describe_and_topology():
    m = strata.Mesh(16, tp=4, order="dp-tp-pp", ranks_per_node=4)
    text = m.describe()
    assert "16 ranks = tp 4 x cp 1 x dp 4 x pp 1" in text
    assert "warning:" in text
    (w,) = m.check_topology()
    assert w["axis"] == "tp" and w["groups_spanning"] == 4
    assert "keeps every tp group inside a node" in w["suggestion"]
    assert strata.Mesh(16, tp=4, ranks_per_node=4).check_topology() == []


@pytest.mark.parametrize(
    "world,kw,message",
    [
        (12, dict(tp=4, pp=2), "world size 12 is not divisible by tp*cp*pp = 8"),
        (8, dict(tp=0), "mesh axis tp has size 0"),
        (8, dict(dp=0), "mesh axis dp has size 0"),
        (8, dict(etp=0, ep=2), "mesh axis etp has size 0"),
        (8, dict(tp=2, dp=2), "dp 2 does not fit"),
        (8, dict(tp=2, order="tp-xx-dp"), "unknown axis 'xx'"),
        (8, dict(tp=2, order="tp-dp-tp"), "appears twice"),
        (8, dict(tp=2, pp=2, order="tp-dp"), "axis pp has size 2 but is missing"),
        (12, dict(tp=2, ep=4), "ep 4 does not divide dp*cp = 6"),
        (16, dict(tp=2, pp=2, ep=2, order="tp-pp-ep-dp-cp"), "does not end with pp"),
        (8, dict(ranks_per_node=0), "ranks_per_node 0 < 1"),
    ],
)
def test_invalid_specs_raise_mesh_error(world, kw, message):
    with pytest.raises(strata.MeshError, match=message.replace("*", r"\*")) as info:
        strata.Mesh(world, **kw)
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, strata.Error)
    assert info.value.code == "INVALID_ARGUMENT"


def test_bad_queries_raise_mesh_error():
    m = strata.Mesh(8, tp=2, ep=2)
    with pytest.raises(strata.MeshError, match="axis of the expert mesh"):
        m.groups("ep")
    with pytest.raises(strata.MeshError, match="rank 9 is not in"):
        m.group_of(9, "tp")
    with pytest.raises(strata.MeshError, match="coordinate tp=5"):
        m.rank(tp=5)
    with pytest.raises(strata.MeshError, match="unknown coordinate 'zz'"):
        m.rank(zz=0)
