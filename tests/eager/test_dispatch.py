"""ActivationDispatchMode + BaseExecutor: the dispatch template and its helpers."""

from __future__ import annotations

from typing import Any

import torch

from hyper_offload import OffloadConfig, OffloadSession
from hyper_offload.eager.dispatch_mode import (
    ActivationDispatchMode,
    flat_tensors,
    owns_storage,
    result_tensors,
    tensor_leaves,
    written_arguments,
)
from hyper_offload.eager.executor_base import ACCUMULATE_GRAD, BaseExecutor
from hyper_offload.eager.opaque import run_opaque_region
from hyper_offload.runtime import PinnedMemoryPool, ResidencyManager, TransferEngine


class Recording(BaseExecutor):
    def __init__(self) -> None:
        super().__init__(ResidencyManager(TransferEngine("cpu"), PinnedMemoryPool(1 << 20)), torch.device("cpu"))
        self.events: list[tuple[str, str]] = []

    def on_op_begin(self, func: Any, args: Any, kwargs: Any) -> None:
        self.events.append(("begin", str(func)))

    def on_op_end(self, result: Any) -> Any:
        self.events.append(("end", type(result).__name__))
        self.index += 1
        return result

    def storage_ids(self, tensors: Any) -> tuple[int, ...]:
        return ()


def test_mode_forwards_every_op_to_the_executor() -> None:
    executor = Recording()
    x = torch.randn(3, requires_grad=True)
    with ActivationDispatchMode(executor):
        y = (x * 2).sum()
        y.backward()
    names = [name for kind, name in executor.events if kind == "begin"]
    assert names[:2] == ["aten.mul.Tensor", "aten.sum.default"]
    assert any("ones_like" in n or "expand" in n for n in names[2:])  # backward ops too
    # x.grad's creation is one virtual op, open until another op (or the step's end)
    assert names[-1] == ACCUMULATE_GRAD and executor.grad_node is not None
    executor.end_accumulation()
    assert executor.index == len(names) and torch.equal(x.grad, torch.full((3,), 2.0))


def test_a_grad_created_or_accumulated_is_one_virtual_op_reading_the_incoming_gradient() -> None:
    x = torch.randn(3, requires_grad=True)
    x.register_hook(lambda g: g * 1)  # a tensor hook runs inside the same node
    for accumulating in (False, True):
        executor = Recording()
        with ActivationDispatchMode(executor):
            (x * 2).sum().backward()
            torch.ones(1) + 1  # closes the accumulation op
        names = [name for kind, name in executor.events if kind == "begin"]
        assert names[-3:] == [ACCUMULATE_GRAD, "aten.ones.default", "aten.add.Tensor"]
        # the hook's mul and the detach or add_ of the accumulation are inside it
        assert names.count(ACCUMULATE_GRAD) == 1 and names.count("aten.mul.Tensor") == 2
    assert torch.equal(x.grad, torch.full((3,), 4.0))


def test_opaque_depth_bypasses_the_hooks() -> None:
    executor = Recording()
    executor.opaque_depth = 1
    with ActivationDispatchMode(executor):
        torch.ones(2) + 1
    assert executor.events == [] and executor.index == 0


def test_an_opaque_region_is_one_begin_and_one_end() -> None:
    executor = Recording()
    a, b = torch.randn(2, 2), torch.randn(2, 2)
    with ActivationDispatchMode(executor):
        out = run_opaque_region(executor, lambda a, b: (a @ b).relu(), (a, b), {}, "opaque:f", compiled=False)
    assert executor.events == [("begin", "opaque:f"), ("end", "Tensor")] and out.shape == (2, 2)


def test_helpers() -> None:
    a, b = torch.zeros(1), torch.zeros(2)
    assert list(tensor_leaves({"x": [a, (b, 3)], "y": None})) == [a, b]
    assert flat_tensors((a, [b, 1], 2), {"out": a}) == [a, b, a]
    assert result_tensors(a) == (a,) and list(result_tensors((a, None, b))) == [a, b]
    writes = written_arguments(torch.ops.aten.add_.Tensor)
    assert writes == ((0, "self"),)
    assert written_arguments(torch.ops.aten.add.out) == ((3, "out"),) or written_arguments(
        torch.ops.aten.add.out
    )[0][1] == "out"
    assert written_arguments("opaque:f") == ()


def test_a_tensor_subclass_inside_a_session() -> None:
    """A tensor subclass unwraps itself first; its inner ops come back as plain ops."""
    from torch.testing._internal.two_tensor import TwoTensor

    x = torch.randn(6)
    session = OffloadSession(OffloadConfig())
    with session:
        y = TwoTensor(x, x.clone()) * 3
    assert type(y) is TwoTensor and torch.equal(y.a, x * 3) and torch.equal(y.b, x * 3)
    # one mul per inner tensor, each seen as a plain op
    assert [op.name for op in session.trace.ops].count("aten.mul.Tensor") == 2


_ZERO_GRADIENT_STEP = """
import torch
from hyper_offload import OffloadConfig, OffloadSession
x, p = torch.randn(4), torch.ones(4, requires_grad=True)
session = OffloadSession(OffloadConfig(max_resident_activation_mb=0))
for _ in range(2):  # warmup (online eviction of everything), then replay
    p.grad = None
    with session:
        torch.sgn(x * p).sum().backward()
assert torch.equal(p.grad, torch.zeros(4)), p.grad
print("exact")
"""


def test_an_efficient_zero_tensor_is_never_tracked_nor_copied() -> None:
    """``sgn``'s derivative of a real input is ``_efficientzerotensor``: a storage that
    claims 16 bytes and holds no data. The warmup evicted it at budget 0 and the copy
    read address 0: a segmentation fault (found by the op database sweep), hence a
    child process here."""
    import subprocess
    import sys

    assert owns_storage(torch.ones(2)) and not owns_storage(torch._efficientzerotensor(2))
    done = subprocess.run([sys.executable, "-c", _ZERO_GRADIENT_STEP], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "exact" in done.stdout, (done.returncode, done.stderr[-2000:])
