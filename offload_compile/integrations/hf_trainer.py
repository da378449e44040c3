"""Hugging Face ``Trainer`` with either door: :class:`HyperOffloadTrainer`.

``TrainingArguments(torch_compile_backend="hyper_offload")`` cannot work: Trainer hands
the name to accelerate's ``TorchDynamoPlugin``, whose ``backend`` is a ``DynamoBackend``
enum of accelerate's own names (``DynamoBackend(name.upper())``: ``'HYPER_OFFLOAD' is not a
valid DynamoBackend``, a name registered with ``register_backend`` too), and its
``to_kwargs()`` passes no ``options=`` anyway. So this Trainer does the compiling itself:

* compile door: the model is compiled in place with the door's backend once Trainer has
  placed it (``nn.Module.compile``: Trainer still sees the model's class and ``forward``
  signature, so it scales the loss and drops unused columns as it would uncompiled, and
  ``save_pretrained`` writes the same keys). ``TrainingArguments.torch_compile`` must stay
  False (accelerate would compile the model a second time, with its backend);
* eager door: each ``training_step`` (forward, loss, backward of one micro-batch) runs
  inside the door's ``OffloadSession``, made for ``TrainingArguments.device``.

The step report is ``trainer.offload_report`` (the backend's ``step_report``, predicted;
or the session's last ``StepStats``, measured) and its figures join every training log
line (``offload_budget_mb``, ``offload_predicted_peak_mb`` / ``offload_measured_peak_mb``,
...), so they reach whatever ``report_to`` writes.

For a Trainer subclass of your own (TRL's, ...), put :class:`OffloadTrainerMixin` first:
``class MyTrainer(OffloadTrainerMixin, SFTTrainer)``.
"""

from __future__ import annotations

from typing import Any

import torch

from hyper_offload.errors import ConfigurationError

from .door import OffloadDoor, require

_FEATURE = "hyper_offload.integrations.HyperOffloadTrainer"
transformers = require("transformers", extra="hf", feature=_FEATURE)
require("accelerate", extra="hf", feature=_FEATURE)  # Trainer's own dependency

__all__ = ["HyperOffloadTrainer", "OffloadTrainerMixin"]


class OffloadTrainerMixin:
    """Adds ``offload=`` to a ``transformers.Trainer`` class (module docstring).

    ``offload``: :class:`~.door.OffloadArguments`, a ``hyper_offload.backend(...)`` or
    an ``OffloadSession`` (default: ``OffloadArguments()``, the compile door at 1024 MiB).
    Invariant: the model is compiled (compile door) or the session made (eager door) once,
    in ``__init__``, after Trainer placed the model on its device.
    """

    offload: OffloadDoor

    def __init__(self, *args: Any, offload: Any = None, **kwargs: Any) -> None:
        door = offload if isinstance(offload, OffloadDoor) else OffloadDoor(offload)
        super().__init__(*args, **kwargs)
        trainer: Any = self
        if trainer.args.torch_compile:
            raise ConfigurationError(
                f"{type(self).__name__}: TrainingArguments.torch_compile=True would compile the "
                "model again with accelerate's backend; leave it False (the compile door "
                "compiles the model with hyper_offload, the eager door needs it uncompiled)"
            )
        if trainer.model is None:
            raise ConfigurationError(
                f"{type(self).__name__}: needs model= (model_init makes the model inside "
                "train(), after the door was set up)"
            )
        self.offload = door
        if door.door == "compile":
            door.compile(trainer.model)
        else:
            door.start(trainer.args.device)

    @property
    def offload_report(self) -> Any:
        """The step report in force (:attr:`OffloadDoor.report`)."""
        return self.offload.report

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any], *args: Any,
                      **kwargs: Any) -> torch.Tensor:
        with self.offload.step():
            return super().training_step(model, inputs, *args, **kwargs)  # type: ignore[misc]

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if "loss" in logs:  # a training log line: the step's figures go with it
            logs = {**logs, **self.offload.metrics()}
        super().log(logs, *args, **kwargs)  # type: ignore[misc]


class HyperOffloadTrainer(OffloadTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` with ``offload=`` (:class:`OffloadTrainerMixin`)."""
