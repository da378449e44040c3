"""A step that fails and that the user skips returns every host buffer (issue 49 case 8).

HF GPT-2 (from a config) compiled whole through the compile door (aot_eager, 50% of the
plain step's saved bytes): two good steps, a batch whose labels are out of range (the
loss raises inside the compiled model: Dynamo recompiles nothing for it, the forward's
saved tensors die with the frame), skipped by the user, then two good steps. Reported:
12 host buffers stayed in use after the failed step where 8 were in use after good ones.
Here: after every step whose outputs the loop dropped, no host buffer is in use, the
failed step included, and the later steps are ``torch.equal`` to plain compile's. The
report did not reproduce on this design (the step's host copies belong to the runtime of
the step lifecycle, and a step that raised is abandoned when its graphs die); this test
keeps it so.
"""

from __future__ import annotations

import pytest
import torch

import hyper_offload

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 64, 32


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=SEQ,
                                     vocab_size=VOCAB, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, VOCAB, (2, SEQ), generator=generator) for _ in range(5)]
    bad = ids[2].clone() + VOCAB  # labels out of range: the loss raises
    return [(i, bad if n == 2 else i) for n, i in enumerate(ids)]


def _train(backend):
    torch._dynamo.reset()
    model = _model()
    compiled = torch.compile(model, backend=backend)
    results, in_use = [], []
    for ids, labels in _batches():
        try:
            loss = compiled(input_ids=ids, labels=labels).loss
            loss.backward()
        except (IndexError, RuntimeError):
            results.append(None)  # the user skips the batch
        else:
            results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        model.zero_grad(set_to_none=True)
        loss = None
        pool = getattr(getattr(backend, "runtime", None), "pool", None)
        in_use.append(None if pool is None else pool.stats().buffers_in_use)
    return results, in_use


def test_a_skipped_failed_step_returns_every_host_buffer_and_training_stays_exact():
    plain, _ = _train("aot_eager")
    assert plain[2] is None  # the batch fails without the library too
    backend = hyper_offload.backend(inner_compiler="aot_eager",
                                    max_resident_activation_fraction=0.5)
    got, in_use = _train(backend)
    assert got[2] is None
    assert in_use == [0] * 5, in_use
    for number in (0, 1, 3, 4):
        (loss, grads), (want_loss, want_grads) = got[number], plain[number]
        assert torch.equal(loss, want_loss), number
        assert all(torch.equal(a, b) for a, b in zip(grads, want_grads)), number
    assert backend.runtime.bytes_d2h > 0  # it moved bytes: the pool was used


# ---------------------------------------------------------------- a backward that raises


class _Saved:
    """What a saved tensor is packed into (detached: no reference cycle through its node)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor.detach()


def _failed_pass_leaves_saved_tensors(release: bool) -> tuple[int, int]:
    """Four independent chains summed; a gradient hook on the chain autograd runs first
    raises, while the other chains' next nodes are queued. Returns (saved tensors alive
    after the pass raised and the graph was dropped, alive after ``release``)."""
    import gc
    import weakref

    from hyper_offload.compiler.step.recorder import release_failed_backward_pass

    refs: list[weakref.ref[_Saved]] = []

    def pack(tensor: torch.Tensor) -> _Saved:
        saved = _Saved(tensor)
        refs.append(weakref.ref(saved))
        return saved

    def alive() -> int:
        gc.collect()
        return sum(ref() is not None for ref in refs)

    torch.manual_seed(0)
    weights = [torch.randn(4, 4, requires_grad=True) for _ in range(4)]
    x = torch.randn(4, 4)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda saved: saved.tensor):
        loss = sum((x @ w).tanh().exp().sin().sum() for w in weights)

    def fail(_: torch.Tensor) -> None:
        raise KeyboardInterrupt

    handle = weights[-1].register_hook(fail)  # the chain made last runs first
    with pytest.raises(KeyboardInterrupt):
        loss.backward()
    handle.remove()
    del loss
    after_raise = alive()
    if release:
        assert release_failed_backward_pass()
    return after_raise, alive()


def test_torch_keeps_a_raised_backward_pass_queued_nodes_until_the_thread_runs_another():
    """Measured torch behaviour the compile door works around (recorder's
    ``release_failed_backward_pass``): no Python object reaches the failed graph, yet 12
    of its 16 saved tensors (the three chains not yet run) stay alive, and a one-node
    backward pass on the same thread frees them all. If torch stops keeping them, the
    first figure drops to 0 and this test says so."""
    held, released = _failed_pass_leaves_saved_tensors(release=True)
    assert held == 12, f"torch kept {held} saved tensors of a failed pass (12 measured on 2.13)"
    assert released == 0


@pytest.mark.parametrize("then", ["next_forward", "collect"])
@pytest.mark.parametrize("where", ["parameter", "loss_side"])
def test_a_backward_that_raises_returns_every_host_buffer_and_leaves_the_plan(
    where: str, then: str
):
    """The compile door (budget 0: every activation moves) on blocks compiled one by one,
    summed in eager code, so that the failed pass leaves compiled regions' nodes queued in
    the engine. The pass raises at a parameter's gradient (``parameter``: after the
    block's region ran its backward) or at an eager tensor on the loss side (``loss_side``:
    before any region's backward began, so the recorder saw nothing of it). The failed
    step's host buffers come back at the next forward (``next_forward``: the forward
    finds the evidence, or begins an invocation the plan does not have), or at once when
    the user calls ``backend.collect()`` after catching the error (``collect``). The
    failed step made no plan, the next step is a step of its own on the same plan, and
    every other step is exact."""
    from torch import nn

    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.ModuleList(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16))
                             for _ in range(4))

    def run(backend):
        torch._dynamo.reset()
        blocks = build()
        compiled = [torch.compile(block, backend=backend) for block in blocks]
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(2))
        results, held = [], []
        for number in range(5):
            blocks.zero_grad(set_to_none=True)
            outs = [block(x).exp() for block in compiled]  # the block made last runs first
            handle = None
            if number == 2:
                handle = (blocks[-1][0].weight.register_hook(_raise) if where == "parameter"
                          else outs[-1].register_hook(_raise))
            try:
                sum(out.sum() for out in outs).backward()
            except KeyboardInterrupt:
                results.append(None)
                if backend != "aot_eager" and then == "collect":
                    backend.collect()
            else:
                results.append([p.grad.clone() for p in blocks.parameters()])
            del outs
            if handle is not None:
                handle.remove()
            if backend != "aot_eager":
                backend.runtime.collect()  # finished copies let go; nothing else
                controller = backend.controller
                held.append(backend.runtime.pool.stats().buffers_in_use)
                if number == 1:
                    plan_before, replans = controller.plan, controller.replans
                if number >= 2:
                    assert controller.plan is plan_before and controller.replans == replans
                    assert controller.steps == number  # the failed step is no step
        return results, held

    plain, _ = run("aot_eager")
    backend = hyper_offload.backend(inner_compiler="aot_eager", max_resident_activation_mb=0)
    got, held = run(backend)
    # Without collect() the engine holds the failed pass's nodes until the next forward.
    assert held[:2] == [0, 0] and held[3:] == [0, 0], held
    assert held[2] == 0 if then == "collect" else held[2] > 0, held
    assert got[2] is None and plain[2] is None
    for number in (0, 1, 3, 4):
        assert all(torch.equal(a, b) for a, b in zip(got[number], plain[number])), number
    assert backend.runtime.bytes_d2h > 0


def _raise(_: torch.Tensor) -> None:
    raise KeyboardInterrupt
