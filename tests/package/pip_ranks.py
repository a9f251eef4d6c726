"""One rank of check_pip.sh's 2-rank job: the pip-installed strata, from a
directory outside any source tree, allreduces over the world and checks the
sum against a reference computed here, and that nothing it mapped comes
from a source tree or build directory."""

import os

import numpy as np

import strata

site = os.environ["STRATA_PIP_SITE"]
forbidden = os.environ["STRATA_PIP_FORBIDDEN"]  # the source tree (and its build/)
allowed = os.environ["STRATA_PIP_ALLOWED"]      # the virtual environment inside it
assert strata.__file__.startswith(site + os.sep), strata.__file__

env = strata.launch_env()
assert env.world_size == 2, env
with strata.init(strata.Mesh(env.world_size, tp=2)) as world:
    x = np.arange(1000, dtype=np.float32) * (env.rank + 1)
    world.group("tp").all_reduce(x)
    # The reference: the sum of every rank's contribution, computed here.
    ref = sum(np.arange(1000, dtype=np.float32) * (r + 1) for r in range(env.world_size))
    np.testing.assert_array_equal(x, ref)

mapped = set()
with open("/proc/self/maps") as f:
    for line in f:
        fields = line.split()
        if len(fields) >= 6 and fields[5].startswith("/"):
            mapped.add(os.path.realpath(fields[5]))
bad = sorted(p for p in mapped
             if p.startswith(forbidden + os.sep) and not p.startswith(allowed + os.sep))
assert not bad, f"mapped from the source tree: {bad}"
libstrata = sorted(p for p in mapped if os.path.basename(p).startswith("libstrata.so"))
assert libstrata and all(p.startswith(os.path.realpath(site) + os.sep) for p in libstrata), libstrata
print(f"[rank {env.rank}] ok: allreduce over {env.world_size} ranks with strata from "
      f"{os.path.dirname(strata.__file__)}", flush=True)
