"""``options={"verify": ...}`` in the compile door (issue 34).

* verify changes no graph (the checks run inside the transfer ops' kernels) and no
  cache key, and a verified step is ``torch.equal`` to an unverified one;
* every moved storage is checked twice per step (at its D2H's wait and at its reload);
* a host copy overwritten between the forward and the backward (a host buffer reused
  while it is still needed) raises in the backward, naming the region and the graph node
  whose bytes it was; without verify the gradients silently differ;
* ``"first_steps:N"`` checks N steps and then turns itself off.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import hyper_offload
from hyper_offload import TransferIntegrityError
from hyper_offload.compiler.options import parse_backend_options

from .compile_models import BATCH, HIDDEN, SEQ, Block, compile_step, deterministic, moved_storages

__all__ = ["deterministic"]


def _backend(verify: Any, **options: Any) -> hyper_offload.compiler.HyperOffloadBackend:
    options = {"budget_scope": "region", **options}
    return hyper_offload.backend(inner_compiler="aot_eager", max_resident_activation_fraction=0.5,
                                 verify=verify, **options)


@pytest.fixture(scope="module")
def runs() -> dict[bool, tuple[list[torch.Tensor], list[torch.Tensor], Any]]:
    """One step of the block with verify off and on (and the backends that ran them)."""
    out = {}
    for verify in (False, True):
        backend = _backend(verify)
        losses, grads, _ = compile_step(Block, backend, torch.float32)
        out[verify] = (losses, grads, backend)
    return out


def test_verify_changes_no_graph_and_no_cache_key(runs):
    off, on = runs[False][2], runs[True][2]
    assert off.options.cache_key() == on.options.cache_key()
    assert len(off.regions) == len(on.regions) == 1
    for graph_off, graph_on in zip(off.regions[0].graphs, on.regions[0].graphs, strict=True):
        assert graph_off.code == graph_on.code
    assert off.regions[0].planned.report.offloaded  # the plan moves something


def test_a_verified_step_is_exact_and_checks_every_moved_storage_twice(runs):
    (loss_off, grads_off, off), (loss_on, grads_on, on) = runs[False], runs[True]
    pairs = zip(loss_off + grads_off, loss_on + grads_on, strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    moved = len(moved_storages(on.regions[0].planned))
    assert moved > 0
    assert on.runtime.checks == 2 * moved  # at each D2H's wait and at each reload
    assert off.runtime.checks == 0


def _step_with_a_corrupted_host_copy(verify: bool) -> list[torch.Tensor]:
    """A forward, then one host copy overwritten (the pool handed its buffer to another
    copy too early), then the backward."""
    backend = _backend(verify)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Block()
    compiled = torch.compile(model, backend=backend)
    torch.manual_seed(1)
    loss = compiled(torch.randn(BATCH, SEQ, HIDDEN)).pow(2).mean()
    hosts = [record.lifetime() for record in backend.runtime._records.hosts.values()]
    largest = max((s for s in hosts if s is not None), key=lambda s: s.nbytes())
    torch.empty(0, dtype=torch.uint8).set_(largest).fill_(0x3C)
    loss.backward()
    return [p.grad for p in model.parameters()]


def test_a_host_copy_overwritten_before_its_reload_raises_naming_region_and_node(runs):
    grads_plain = runs[False][1]
    silent = _step_with_a_corrupted_host_copy(verify=False)
    assert not all(torch.equal(a, b) for a, b in zip(silent, grads_plain, strict=True))
    with pytest.raises(TransferIntegrityError) as caught:
        _step_with_a_corrupted_host_copy(verify=True)
    error = caught.value
    assert error.check == "reload"
    assert error.where.startswith("compile door, region 0, copy_d2h of fw:")
    assert error.where.endswith("reloaded by copy_h2d") and "slot" in error.where


def test_first_steps_checks_that_many_steps_then_turns_itself_off():
    backend = hyper_offload.backend(
        inner_compiler="aot_eager", max_resident_activation_fraction=0.5,
        verify="first_steps:1", recompute="off",
    )
    plain = compile_step(Block, "aot_eager", torch.float32, steps=3)
    losses, params, _ = compile_step(Block, backend, torch.float32, steps=3)
    assert all(torch.equal(a, b) for a, b in zip(plain[0] + plain[1], losses + params, strict=True))
    assert backend.verified_steps == 1 and backend.runtime.verify is False
    # the first step runs every region at its floor; steps 2 and 3 check nothing
    floor = backend.regions[0].variants[None].planned  # the lowering the first step ran
    assert backend.runtime.checks == 2 * len(moved_storages(floor)) > 0


def test_first_steps_needs_the_step_scope_and_malformed_forms_are_refused():
    with pytest.raises(ValueError, match="budget_scope='step'"):
        parse_backend_options({"verify": "first_steps:2", "budget_scope": "region"})
    for bad in ("first_steps:0", "always", 1):
        with pytest.raises(ValueError, match="verify"):
            parse_backend_options({"verify": bad})
