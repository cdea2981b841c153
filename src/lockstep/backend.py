"""The hook a framework plugs into the worker: set-up before the train function, tear-down after."""

from __future__ import annotations

from lockstep.context import TrainContext

__all__ = ["BackendConfig"]


class BackendConfig:
    """Worker-side set-up and tear-down around the train function (no-op by default).

    :class:`lockstep.torch.TorchConfig` is the one that matters: it creates the
    ``torch.distributed`` process group before the train function and destroys it after.
    """

    def on_worker_start(self, context: TrainContext, use_gpu: bool) -> None:
        """Run in each worker before the train function."""

    def on_worker_shutdown(self) -> None:
        """Run in each worker after the train function (also when it raised)."""
