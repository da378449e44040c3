"""What the eager door cannot make exact, measured (issue 41): torch changes some
formulas while *any* ``TorchDispatchMode`` is active.

ATen treats every tensor as subclass-like while a dispatch mode is on the stack
(``TensorSubclassLikeUtils.h``: ``isTensorSubclassLike`` is true whenever
``dispatch_mode_enabled()``), and several formulas then take their composite-compliant
branch. The eager door runs every op under its mode, so these ops differ from plain
eager in the last bits (complex ``cumprod``'s backward with zeros) or more (``pinverse``,
``lstsq``, complex ``prod``), at any budget, with nothing moved. The op database sweep
found 13 such cases (docs/exactness.md, "Exactness over torch's op database"); the compile door
is exact on them. This test pins the torch behaviour: if it ever fails, torch changed
and the eager door's limitation may be gone.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hyper_offload import OffloadConfig, OffloadSession


class _NoopMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))


def _cumprod_grad(around: object | None) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(5, 5, 5, dtype=torch.complex64, generator=generator)
    x[torch.rand(5, 5, 5, generator=generator) < 0.1] = 0  # zeros: the other formula
    weights = torch.randn(5, 5, 5, 2, generator=generator)
    p = torch.ones_like(x, requires_grad=True)
    with around if around is not None else torch.enable_grad():
        (torch.view_as_real(torch.cumprod(x * p, 1)) * weights).sum().backward()
    return p.grad


def test_any_dispatch_mode_changes_complex_cumprods_gradient_and_so_does_the_session():
    plain = _cumprod_grad(None)
    under_a_noop_mode = _cumprod_grad(_NoopMode())
    under_the_session = _cumprod_grad(
        OffloadSession(OffloadConfig(max_resident_activation_mb=1000)))  # nothing moves
    assert not torch.equal(plain, under_a_noop_mode)  # torch's own behaviour
    assert torch.equal(under_the_session, under_a_noop_mode)  # the session adds nothing
