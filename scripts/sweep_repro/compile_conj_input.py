"""Sweep failure group: compile door, a graph input that is a conjugate view of an activation.

Found by ``make sweep`` (compile door, ``svd_lowrank`` and ``pca_lowrank`` in complex64:
the OpInfo's ``wrapper_set_seed`` breaks the graph, and the next region receives
``b.conj()``-style views as inputs). The backend moves region inputs that are activations;
for an input with the conjugate bit the copy_d2h's source is not the tensor the graph
passes as the wait's keepalive, and the step raises ``TransferMisuseError``
("keepalive ... is not the source of the copy_d2h") in the forward. Plain aot_eager runs.
Exits 1 while the step raises or differs.

    .venv/bin/python scripts/sweep_repro/compile_conj_input.py
"""

from __future__ import annotations

import logging
import warnings

import torch

OPTIONS = {"inner_compiler": "aot_eager", "max_resident_activation_mb": 0}


def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(y @ x.mH).sum()


def grads(backend: str, options: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    p = torch.randn(3, 2, dtype=torch.complex64, generator=g).requires_grad_()
    q = torch.randn(3, 2, dtype=torch.complex64, generator=g).requires_grad_()
    torch._dynamo.reset()
    compiled = torch.compile(f, backend=backend, options=options)
    compiled((p * 2).conj(), q * 2).backward()  # x: a conjugate view of an activation
    return p.grad, q.grad


def main() -> int:
    warnings.simplefilter("ignore")
    logging.getLogger("hyper_offload").setLevel(logging.ERROR)
    plain = grads("aot_eager")
    try:
        got = grads("hyper_offload", OPTIONS)
    except Exception as error:  # noqa: BLE001 - the point of the script
        print(f"hyper_offload raised {type(error).__name__}: {str(error).splitlines()[0]}")
        return 1
    same = all(torch.equal(a, b) for a, b in zip(plain, got))
    print(f"gradients equal: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
