"""The strata demo, launched on 8 CPU ranks by `make demo`.

Shows every capability that exists so far:
  0. what this machine looks like to NCCL, the NCCL profile for it and the
     lint of the NCCL settings in force (rank 0, before anything else);
  1. the launch environment each rank detects;
  2. the dp2 x tp2 x pp2 mesh: its groups, and each rank's coordinates.
"""

import strata


def show_topology(env):
    """Rank 0 prints the detected topology, its class and NCCL profile, and the
    lint of the NCCL settings in this environment (strata-topo's report)."""
    if env.rank != 0:
        return
    topo = strata.topology.detect()
    gpus = f"{len(topo.gpus)} GPU(s)" if topo.gpus else "no GPU"
    rdma = [n["name"] for n in topo.nics if n["kind"] != "Ethernet"]
    net = f"RDMA via {', '.join(rdma)}" if rdma else "TCP only (no InfiniBand, RoCE or EFA)"
    print(f"This machine: {gpus}, {net}. Topology class: {topo.cls}.", flush=True)
    print(topo.text(), flush=True)
    errors = sum(f.severity == "error" for f in topo.lint)
    print(f"NCCL settings lint: {errors} error(s), {len(topo.lint) - errors} other finding(s)\n",
          flush=True)


def main():
    env = strata.launch_env()
    show_topology(env)
    mesh = strata.Mesh(env.world_size, tp=2, pp=2, ranks_per_node=env.local_world_size)
    if env.rank == 0:
        print(f"strata {strata.__version__} on {env.world_size} ranks via {env.launcher}", flush=True)
        print(mesh.describe(), flush=True)
    coords = mesh.coords(env.rank)
    print(f"[rank {env.rank}] {env} coords {coords} tp group {mesh.group_of(env.rank, 'tp')}",
          flush=True)


if __name__ == "__main__":
    try:
        main()
    except strata.Error as e:
        raise SystemExit(f"demo: {type(e).__name__}: {e}")
