"""The trainers people use, with either door: Hugging Face ``Trainer`` and Lightning.

* :class:`OffloadArguments` — the settings, a dataclass ``HfArgumentParser`` reads beside
  ``TrainingArguments`` (door, budget, inner compiler);
* :class:`OffloadDoor` — one trainer's offload: the compile door's backend (models compiled
  in place, ``nn.Module.compile``) or the eager door's session, its step report and the
  metrics the trainers log;
* :class:`HyperOffloadTrainer` / :class:`OffloadTrainerMixin` — ``transformers.Trainer``
  with either door (the ``hf`` extra: ``pip install "hyper-offload[hf]"``);
* :class:`HyperOffloadCallback` — a Lightning ``Callback`` for either door, automatic and
  manual optimization (the ``lightning`` extra: ``pip install "hyper-offload[lightning]"``).

torchtitan needs no code here: it takes a registered backend name
(:func:`hyper_offload.register_backend`, ``docs/torchtitan.md``).

Invariant: importing this package imports neither torch nor a trainer; each name loads its
module on first access, and a missing trainer package raises
:class:`~hyper_offload.errors.OptionalDependencyError` naming the extra to install.
"""

from __future__ import annotations

from .._lazy import lazy_getattr

_LAZY = {
    "HyperOffloadCallback": ".lightning_callback",
    "HyperOffloadTrainer": ".hf_trainer",
    "OffloadArguments": ".door",
    "OffloadDoor": ".door",
    "OffloadTrainerMixin": ".hf_trainer",
}

__all__ = sorted(_LAZY)

__getattr__ = lazy_getattr(__name__, _LAZY)
