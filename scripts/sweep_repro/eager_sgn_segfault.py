"""Sweep failure group: the eager door crashes the process on ``torch.sgn``'s backward.

Found by ``make sweep`` (eager door, ``sgn`` in float32 and bfloat16: signal 11, the
worker process dies). For a real input, ``sgn``'s derivative is
``at::_efficientzerotensor``: a ZeroTensor, whose storage holds no bytes. The session
at budget 0 crashes inside torch's CPU kernels (a read at address 0x20) during the
backward; plain eager and a no-op ``TorchDispatchMode`` run. Run it in a subprocess to
see the exit code: 139 (SIGSEGV) while the bug is there, 0 once fixed.

    .venv/bin/python scripts/sweep_repro/eager_sgn_segfault.py; echo $?
"""

from __future__ import annotations

import warnings

import torch

from hyper_offload import OffloadConfig, OffloadSession


def main() -> int:
    warnings.simplefilter("ignore")
    x = torch.randn(4)
    p = torch.ones(4, requires_grad=True)
    with OffloadSession(OffloadConfig(max_resident_activation_mb=0)):
        torch.sgn(x * p).sum().backward()
    print("no crash; p.grad =", p.grad)
    return 0 if torch.equal(p.grad, torch.zeros(4)) else 1


if __name__ == "__main__":
    raise SystemExit(main())
