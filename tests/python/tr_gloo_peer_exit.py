"""Under torchrun (4 processes): a rank that exits in the middle of a job
fails the others' next collective promptly, with an error, not a hang, on
both of the Gloo backend's paths: the host-copy path (ranks of one host
meet on shared memory, where nothing closes a socket when a rank dies; the
survivors find its process gone) and Gloo's transport (STRATA_GLOO_CMA=0,
run as its own test).

Rank 1 leaves with os._exit(0) (so torchrun, seeing a clean exit, lets the
others finish); ranks 2 and 3 check their collective's error and how long
it took, rank 0 the same for a receive from rank 1 (on the host-copy path
a point-to-point wait, too, finds the peer's process gone).
"""

import os
import time

import pytest
import torch

import strata

RANK = int(os.environ["RANK"])
HOST_COPY = os.environ.get("STRATA_GLOO_CMA", "1") != "0"


def test_a_rank_that_exits_fails_the_survivors_collective_within_seconds():
    world = strata.init(backend="gloo", timeout=120)
    g = world.group()
    x = torch.ones(1 << 16)
    g.all_reduce(x)  # everyone is here and connected
    assert x[0].item() == g.size
    if RANK == 1:
        os._exit(0)
    start = time.monotonic()
    with pytest.raises(strata.CommError) as err:
        if RANK == 0:
            g.recv(x, 1)  # rank 1 never sends
        else:
            for _ in range(100):  # one of the first fails; a loop in case one got through
                g.all_reduce(x)
    elapsed = time.monotonic() - start
    print(f"rank {RANK}: the {'receive' if RANK == 0 else 'collective'} failed after {elapsed:.2f} s: {err.value}")
    # Far below the 120 s timeout: the survivors notice the exit itself.
    assert elapsed < 30, (elapsed, str(err.value))
    if HOST_COPY:
        # Found by this rank, or by a survivor that closed the group on
        # finding it (which wakes the others).
        msg = str(err.value)
        assert "rank 1 (pid" in msg and "is gone" in msg or "closed the group's" in msg, msg
