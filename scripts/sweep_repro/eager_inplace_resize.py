"""Sweep failure group: the eager door refuses an in-place op that grows its output.

Found by ``make sweep --variant inplace`` (eager door, ``addbmm_`` in float32, bfloat16
and complex64). ``addbmm_`` on a 0-dim activation resizes that tensor's storage to the
result's size (plain eager accepts it). The session's warmup runs; its replay (step 2)
raises ``ResidencyMisuseError: copy_d2h(storage 0): the storage was resized outside the
manager (4 B at bind, 200 B now)``. Exits 1 while it raises.

    .venv/bin/python scripts/sweep_repro/eager_inplace_resize.py
"""

from __future__ import annotations

import warnings

import torch

from hyper_offload import OffloadConfig, OffloadSession


def main() -> int:
    warnings.simplefilter("ignore")
    g = torch.Generator().manual_seed(0)
    x, b1, b2 = torch.randn((), generator=g), torch.randn(5, 5, 5, generator=g), torch.randn(5, 5, 10, generator=g)
    p, q1, q2 = (torch.ones(t.shape, requires_grad=True) for t in (x, b1, b2))
    q = torch.ones((), requires_grad=True)
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=0))
    for step in range(2):
        p.grad = q1.grad = q2.grad = q.grad = None
        try:
            with session:
                a = x * p  # a 0-dim activation
                a.addbmm_(b1 * q1, b2 * q2, beta=0.6, alpha=0.2)  # grows it to (5, 10)
                (a * q).sum().backward()  # saves the grown tensor for q's gradient
        except Exception as error:  # noqa: BLE001 - the point of the script
            print(f"step {step + 1} ({session.phase}): {type(error).__name__}: {str(error).splitlines()[0]}")
            return 1
        print(f"step {step + 1}: ok")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
