"""A lockstep run on a Ray cluster of two hosts (tests/test_two_hosts.py):

    python two_host_ray_job.py RAY_ADDRESS STORAGE_PATH [--nodes 2] [--forward-env NAME,...]

Waits until the cluster has ``--nodes`` live nodes, then runs two workers spread over them
(ScalingConfig(placement_strategy="SPREAD")). Each rank all-reduces ``rank + 1`` (3 when both
took part), gathers every rank's Ray node IP, and reports twice with a checkpoint holding
``rank<r>.txt``. ``--forward-env`` hands these variables of the driver to the workers (Ray's
``runtime_env``), e.g. the S3 endpoint and credentials. Prints one line "RESULT {...}" (JSON) describing the Result, or
"FAILED <type>: <message>" when fit() raised.
"""

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import ray
import torch
import torch.distributed as dist

import lockstep
from lockstep import Checkpoint, RunConfig, ScalingConfig
from lockstep.torch import TorchTrainer


def train_func() -> None:
    rank = lockstep.get_context().get_world_rank()
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    hosts = [None] * lockstep.get_context().get_world_size()
    dist.all_gather_object(hosts, ray.util.get_node_ip_address())
    for step in range(2):
        with tempfile.TemporaryDirectory() as folder:
            Path(folder, f"rank{rank}.txt").write_text(str(step))
            lockstep.report(
                {"step": step, "sum": total.item(), "hosts": hosts, "ifname": os.environ.get("GLOO_SOCKET_IFNAME")},
                checkpoint=Checkpoint.from_directory(folder),
            )


def wait_for_nodes(count: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while sum(node["Alive"] for node in ray.nodes()) < count:
        if time.monotonic() > deadline:
            sys.exit(f"the Ray cluster did not reach {count} nodes within {timeout_s} s")
        time.sleep(0.2)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("address")
    parser.add_argument("storage_path")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--forward-env", default="")
    args = parser.parse_args()
    forwarded = {name: os.environ[name] for name in args.forward_env.split(",") if name}
    ray.init(address=args.address, log_to_driver=False, runtime_env={"env_vars": forwarded} if forwarded else None)
    wait_for_nodes(args.nodes)
    trainer = TorchTrainer(
        train_func,
        scaling_config=ScalingConfig(num_workers=2, placement_strategy="SPREAD", placement_timeout_s=120),
        run_config=RunConfig(name="two_hosts", storage_path=args.storage_path, verbose=0),
    )
    try:
        result = trainer.fit()
    except Exception as error:  # noqa: BLE001 - the test reads the line
        print(f"FAILED {type(error).__name__}: {error}", flush=True)
        sys.exit(1)
    files = None
    if result.checkpoint is not None:
        with result.checkpoint.as_directory() as folder:
            files = {name: Path(folder, name).read_text() for name in sorted(os.listdir(folder))}
    print(
        "RESULT " + json.dumps({"metrics": result.metrics, "checkpoint_files": files, "path": result.path}), flush=True
    )
