"""PyTorch support: ``from lockstep.torch import TorchTrainer, prepare_model, …`` (the names of
``ray.train.torch``). Ray Train's deprecated AMP helpers (``accelerate``, ``backward``,
``prepare_optimizer``) and ``TorchCheckpoint`` import, and raise when used, saying what to use."""

# A driver that imports this module will likely call fit(): warm a process for its workers now,
# before torch is imported here, so that it imports torch while the driver does
# (lockstep._internal.warm.warm_start; LOCKSTEP_WARM_START=0 turns it off; nothing starts in workers,
# under torchrun or in Ray workers).
from lockstep._internal.warm import warm_start as _warm_start

_warm_start.start_in_background()

from lockstep._internal.ray_compat.deprecated import removed_class  # noqa: E402
from lockstep.torch.config import TorchConfig  # noqa: E402
from lockstep.torch.train_loop_utils import (  # noqa: E402
    accelerate,
    backward,
    enable_reproducibility,
    get_device,
    get_devices,
    move_to_device,
    prepare_data_loader,
    prepare_model,
    prepare_optimizer,
)
from lockstep.torch.trainer import TorchTrainer  # noqa: E402

TorchCheckpoint = removed_class(
    "lockstep.torch.TorchCheckpoint",
    "use lockstep.Checkpoint: torch.save(model.state_dict(), os.path.join(folder, 'model.pt')), then "
    "lockstep.report(metrics, checkpoint=lockstep.Checkpoint.from_directory(folder)); to load, "
    "`with checkpoint.as_directory() as folder: torch.load(os.path.join(folder, 'model.pt'))`.",
)

__all__ = [
    "TorchCheckpoint",
    "TorchConfig",
    "TorchTrainer",
    "accelerate",
    "backward",
    "enable_reproducibility",
    "get_device",
    "get_devices",
    "move_to_device",
    "prepare_data_loader",
    "prepare_model",
    "prepare_optimizer",
]
