"""The strata demo, launched on 8 CPU ranks by `make demo`.

Shows every capability that exists so far:
  1. the launch environment each rank detects;
  2. the dp2 x tp2 x pp2 mesh: its groups, and each rank's coordinates.
"""

import strata


def main():
    env = strata.launch_env()
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
