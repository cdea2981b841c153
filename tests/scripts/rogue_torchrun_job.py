"""A lockstep script for torchrun in which rank 1 starts rogue peers (tests/test_channel_trust.py):

    python -m torch.distributed.run --nproc_per_node=2 rogue_torchrun_job.py STORAGE_PATH OUT_DIR

Rank 1 runs ``rogue_peer.py store`` (it knows only the rendezvous store) and ``rogue_peer.py env``
with rank 1's own credential (which, under torchrun, a rank derives from the secret rank 0 put in
the run folder), writing their outcomes to OUT_DIR/store.json and OUT_DIR/env.json; then every
rank reports, and rank 0 broadcasts an object through ``lockstep.collective``. Each rank prints
"RANK r RESULT {...}" with what its fit() returned.
"""

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import lockstep
from lockstep import RunConfig, ScalingConfig
from lockstep.collective import broadcast_from_rank_zero
from lockstep.torch import TorchTrainer

ROGUE = str(Path(__file__).with_name("rogue_peer.py"))
STORE_VARIABLES = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "PATH",
    "PYTHONPATH",
    "LOCKSTEP_TEST_TAG",
)


def rank_1_channel_env() -> dict[str, str]:
    """What rank 1 itself uses to open its channel: the address and its own credential."""
    from torch.distributed import TCPStore

    from lockstep._internal.executors.torchrun_store import Launch, await_channel

    launch = Launch.from_environ()
    store = TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=30),
    )
    return await_channel(launch, store, lockstep.get_context().get_storage())


def run_rogues(out_dir: str) -> None:
    marker = str(Path(out_dir, "MARKER"))
    only_store = {name: os.environ[name] for name in STORE_VARIABLES if name in os.environ}
    only_store["ROGUE_DRIVER_ADDRESS"] = rank_1_channel_env()["LOCKSTEP_DRIVER_ADDRESS"]
    subprocess.run(
        [sys.executable, ROGUE, "store", str(Path(out_dir, "store.json")), marker],
        env=only_store,
        check=True,
        timeout=90,
    )
    with_credential = {**os.environ, **rank_1_channel_env()}
    subprocess.run(
        [sys.executable, ROGUE, "env", str(Path(out_dir, "env.json")), marker],
        env=with_credential,
        check=True,
        timeout=90,
    )


def train_func(config: dict) -> str:
    if lockstep.get_context().get_world_rank() == 1:
        run_rogues(config["out_dir"])
    lockstep.report({"reported": 1})
    shared = broadcast_from_rank_zero({"from": "rank 0"})
    lockstep.report({"broadcast": shared["from"]})
    return "rank 0's own value"


if __name__ == "__main__":
    storage_path, out_dir = sys.argv[1:3]
    trainer = TorchTrainer(
        train_func,
        train_loop_config={"out_dir": out_dir},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="rogue", storage_path=storage_path, verbose=0),
    )
    result = trainer.fit()
    rank = int(os.environ["RANK"])
    summary = {
        "metrics": result.metrics,
        "return_value": result.return_value,
        "error": result.error and str(result.error),
    }
    sys.stdout.write(f"RANK {rank} RESULT {json.dumps(summary)}\n")
    sys.stdout.flush()
