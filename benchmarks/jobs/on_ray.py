"""How the benchmark jobs join Ray (for Ray Train, and for lockstep's Ray executor)."""

from __future__ import annotations

import argparse
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


def add_ray_flags(parser: argparse.ArgumentParser) -> None:
    """The flags every benchmark job takes to run on Ray: ``--ray`` (Ray Train, the script's
    imports swapped) and ``--lockstep-on-ray`` (lockstep's Ray executor)."""
    parser.add_argument("--ray", action="store_true", help="run on Ray Train instead of lockstep")
    parser.add_argument("--lockstep-on-ray", action="store_true", help="lockstep with its Ray executor")


def join_ray_if_asked(args: argparse.Namespace) -> None:
    """Join Ray (:func:`connect_ray`) when ``args`` asks for either way of running on it."""
    if args.ray or args.lockstep_on_ray:
        connect_ray(args.num_workers)
