"""Lightning with either door: :class:`HyperOffloadCallback`.

``Trainer(callbacks=[HyperOffloadCallback(OffloadArguments(...))])``; the LightningModule is
unchanged, automatic optimization included.

* compile door: at ``setup("fit")`` the callback compiles the LightningModule (its
  ``forward``: ``self(x)`` in ``training_step``), or the submodules named in
  ``compile_modules``, in place with the door's backend (``nn.Module.compile``: the
  module's class, hooks and ``state_dict`` keys stay, so checkpoints are the plain
  ones).
* eager door: the session is entered in ``on_train_batch_start`` (the last hook before
  Lightning's closure runs ``training_step``, the optional ``zero_grad`` and
  ``backward``) and left in ``on_after_backward`` (called by the precision plugin right
  after ``backward``, before gradient clipping and the optimizer's update, which stay
  outside). Each batch, accumulating or stepping, is one session step of the same ops:
  what differs between them (the optimizer's ``step()`` calling the closure, and
  ``zero_grad`` between forward and backward, on some batches only) is profiler
  annotations, which the session does not trace (:mod:`hyper_offload.eager.dispatch_mode`).
  A batch whose ``training_step`` returned None (no backward) ends its step in
  ``on_train_batch_end``; a step that raised is aborted in ``on_exception`` (the session
  returns every host buffer; Lightning re-raises). Manual optimization: the session
  covers ``training_step`` up to the end of its first ``manual_backward``;
  ``optimizer.step()`` after it runs outside, and a second forward and backward in the
  same ``training_step`` run without offload.

The step report is ``callback.report`` (compile door: the backend's ``step_report``,
predicted; eager door: the session's last ``StepStats``, measured); its figures are
logged every batch with ``log_dict`` (``offload_budget_mb``, ``offload_*_peak_mb``, ...).

Lightning's ``torch.compile`` wrapper (``lightning.fabric.wrappers``, installed at
``import lightning``) deep-copies the keyword arguments of every compile of a module:
backend objects deep-copy as a fresh backend with the same options, so
``torch.compile(model, backend=hyper_offload.backend(...))`` works beside this callback.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .door import OffloadDoor, require

pl = require("lightning.pytorch", extra="lightning",
             feature="hyper_offload.integrations.HyperOffloadCallback")

__all__ = ["HyperOffloadCallback"]


class HyperOffloadCallback(pl.Callback):
    """Either door for a Lightning ``Trainer`` (module docstring).

    ``offload``: :class:`~.door.OffloadArguments`, a ``hyper_offload.backend(...)`` or
    an ``OffloadSession`` (default: ``OffloadArguments()``). ``compile_modules``: dotted
    names of the submodules the compile door compiles (``""``: the LightningModule).
    ``log_metrics``: log the step report's figures every batch.

    Invariants: a module is compiled once per callback; an eager step is open only from
    ``on_train_batch_start`` to the end of that batch's first backward (or the batch's
    end, or the error that ended it).
    """

    def __init__(self, offload: Any = None, *, compile_modules: Sequence[str] = ("",),
                 log_metrics: bool = True) -> None:
        self.offload = offload if isinstance(offload, OffloadDoor) else OffloadDoor(offload)
        self.compile_modules = tuple(compile_modules)
        self.log_metrics = log_metrics
        self._compiled: set[int] = set()

    @property
    def report(self) -> Any:
        """The step report in force (:attr:`OffloadDoor.report`)."""
        return self.offload.report

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit" or self.offload.door != "compile":
            return
        for name in self.compile_modules:
            module = pl_module.get_submodule(name)
            if id(module) not in self._compiled:
                self.offload.compile(module)
                self._compiled.add(id(module))

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self.offload.start(pl_module.device)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any,
                             batch_idx: int) -> None:
        self.offload.enter_step()

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self.offload.exit_step()  # a batch whose on_train_batch_start hook skipped the epoch

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self.offload.exit_step()

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        self.offload.exit_step()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.offload.exit_step()  # a batch without backward (training_step returned None)
        metrics = self.offload.metrics()
        if self.log_metrics and metrics:
            pl_module.log_dict(metrics, on_step=True, on_epoch=False)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.offload.exit_step(exception)
