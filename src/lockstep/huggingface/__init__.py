"""Hugging Face integrations, at the paths Ray Train uses (``ray.train.huggingface.X`` ->
``lockstep.huggingface.X``).

``lockstep.huggingface.transformers`` holds :class:`RayTrainReportCallback` and
:func:`prepare_trainer` for the ``transformers.Trainer``. Importing this package alone imports
nothing from Hugging Face.
"""

__all__: list[str] = []  # the integration is the submodule lockstep.huggingface.transformers
