"""PyTorch support: ``from lockstep.torch import TorchTrainer, prepare_model, …`` (the names of
``ray.train.torch``)."""

from lockstep.torch.config import TorchConfig
from lockstep.torch.train_loop_utils import (
    enable_reproducibility,
    get_device,
    get_devices,
    move_to_device,
    prepare_data_loader,
    prepare_model,
)
from lockstep.torch.trainer import TorchTrainer

__all__ = [
    "TorchConfig",
    "TorchTrainer",
    "enable_reproducibility",
    "get_device",
    "get_devices",
    "move_to_device",
    "prepare_data_loader",
    "prepare_model",
]
