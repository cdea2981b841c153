"""How the benchmark jobs join Ray (for Ray Train, and for lockstep's Ray executor)."""

from __future__ import annotations

import os


def connect_ray(num_workers: int) -> None:
    """Join the cluster named by RAY_ADDRESS (benchmarks/ray_bench.py starts one shared by every
    run), else start a new local one with a CPU per worker plus one for Ray Train's controller."""
    import ray

    if os.environ.get("RAY_ADDRESS"):
        ray.init(log_to_driver=False)
    else:
        # address='local': a new cluster of its own, even when another one runs on this machine
        ray.init(address="local", num_cpus=num_workers + 1, include_dashboard=False, log_to_driver=False)
