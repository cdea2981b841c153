"""A peer that tries to speak on a run's channel as someone it is not (tests/test_channel_trust.py).

``rogue_peer.py env OUT MARKER``: run from a rank's train function with the rank's environment
(its own credential): connect as a rank that does not exist, as itself a second time, and as
rank 0 with its own credential. ``rogue_peer.py store OUT MARKER``: knowing only torchrun's
rendezvous store (MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RUN_ID) and the channel's address (as a
port scan finds it: ROGUE_DRIVER_ADDRESS): read the channel's entry and connect with whatever it
holds.

Every channel it gets (none, if the driver is right) carries a pickled ``Finished`` and a pickled
broadcast claimed for rank 0, whose unpickling would create MARKER. OUT gets one JSON object:
attempt -> "refused" | "accepted", and for ``store`` the entry's keys.
"""

from __future__ import annotations

import json
import os
import pickle
import secrets
import sys
from typing import Any

from lockstep._internal.rank.rank_env import ENV_DRIVER_ADDRESS
from lockstep._internal.wire import channel, protocol


class CreatesMarker:
    """Unpickling this calls ``open(MARKER, "w")``: proof that a peer's pickle was loaded."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.path, "w"))


def attempt(rank: int, env: dict[str, str], marker: str) -> str:
    """Connect as ``rank``; on success send the pickled payloads and say so."""
    try:
        rogue = channel.connect_to_driver(rank, env)
    except (OSError, EOFError) as error:  # ChannelRefused is an OSError
        return "refused" if isinstance(error, (channel.ChannelRefused, EOFError, ConnectionError)) else repr(error)
    payload = pickle.dumps(CreatesMarker(marker))
    rogue.send(protocol.Finished(0, payload))
    rogue.send(protocol.Collective(0, 0, "broadcast", payload))
    rogue.close()
    return "accepted"


def from_env(marker: str) -> dict[str, Any]:
    env = dict(os.environ)
    own = int(env["RANK"])
    return {
        "fake rank 7": attempt(7, env, marker),
        f"rank {own} again": attempt(own, env, marker),
        "rank 0 with another rank's credential": attempt(0, env, marker),
    }


def from_store(marker: str) -> dict[str, Any]:
    import datetime

    from torch.distributed import TCPStore

    store = TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=30),
    )
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    key = f"lockstep/{run_id}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/channel"
    store.wait([key], datetime.timedelta(seconds=30))
    entry = json.loads(store.get(key).decode())
    found = {name: str(value) for name, value in entry.items()}
    guesses = [value for value in found.values() if len(value) == 64] or [secrets.token_hex(32)]
    outcome: dict[str, Any] = {"entry keys": sorted(entry)}
    # the store names no address (it comes from the run folder): take the one a port scan would find
    address = entry.get("address") or os.environ["ROGUE_DRIVER_ADDRESS"]
    for rank in (0, 1):
        for number, guess in enumerate(guesses):
            env = {ENV_DRIVER_ADDRESS: address, channel.ENV_AUTHKEY: guess}
            outcome[f"rank {rank} guess {number}"] = attempt(rank, env, marker)
    return outcome


def main() -> None:
    mode, out, marker = sys.argv[1:4]
    outcome = from_env(marker) if mode == "env" else from_store(marker)
    with open(out, "w", encoding="utf-8") as handle:
        json.dump(outcome, handle)


if __name__ == "__main__":
    main()
