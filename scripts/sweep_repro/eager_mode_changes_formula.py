"""Sweep failure group: the eager door's backward is not plain eager's for some formulas.

Found by ``make sweep`` (eager door, complex64: ``cumprod``, ``ormqr``, ``pinverse``;
each reproduces with a no-op ``TorchDispatchMode`` in place of the session). torch
treats every tensor as "subclass-like" while *any* ``TorchDispatchMode`` is active
(ATen's ``TensorSubclassLikeUtils.h`` reads the dispatch-mode TLS), and several formulas
then take their composite-compliant branch: ``cumprod``'s backward with zeros in its
input rounds differently (last bits of the gradient), ``pinverse``'s result changes (the
loss by 1.6 on the sweep's sample). ``OffloadSession`` runs every step under its
``ActivationDispatchMode``, so it shows the same difference at any budget, with nothing
moved. Exits 1 while the difference is there.

    .venv/bin/python scripts/sweep_repro/eager_mode_changes_formula.py
"""

from __future__ import annotations

import contextlib
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hyper_offload import OffloadConfig, OffloadSession


class NoopMode(TorchDispatchMode):
    """Runs every op unchanged."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))


def grad(x0: torch.Tensor, w: torch.Tensor, around: contextlib.AbstractContextManager) -> torch.Tensor:
    p = torch.ones_like(x0, requires_grad=True)
    with around:
        (torch.view_as_real(torch.cumprod(x0 * p, 1)) * w).sum().backward()
    return p.grad


def main() -> int:
    warnings.simplefilter("ignore")
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(5, 5, 5, dtype=torch.complex64, generator=g)
    x0[torch.rand(5, 5, 5, generator=g) < 0.1] = 0  # zeros select cumprod's other formula
    w = torch.randn(5, 5, 5, 2, generator=g)
    plain = grad(x0, w, contextlib.nullcontext())
    failed = False
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=1000))
    for name, around in (("no-op TorchDispatchMode", NoopMode()), ("OffloadSession", session)):
        got = grad(x0, w, around)
        same = torch.equal(plain, got)
        failed |= not same
        print(f"{name}: equal={same}, max abs diff {(plain - got).abs().max().item():.3g}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
