"""ResidencyManager against its rules: every misuse names the storage and the rule and
changes nothing, a failing copy leaves a valid copy and leaks nothing, and random action
sequences agree with the state model (refusals included) and leak nothing on an
asynchronous engine. The manager at work: ``test_residency.py``."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hyper_offload.errors import DataLostError, ResidencyMisuseError, TransferFailedError
from hyper_offload.runtime.transfer import TransferEngine
from hyper_offload.runtime.physical_buffer import BufferState
from hyper_offload.runtime.pinned_pool import PinnedMemoryPool
from hyper_offload.runtime.residency import ResidencyManager

from .residency_helpers import MIB, offloaded


# ---------------------------------------------------------------- misuse


@pytest.mark.parametrize(
    "call",
    ["copy_d2h", "copy_h2d", "release_device", "release_host", "wait_h2d", "unbind",
     "device_storage", "device_tensor", "is_resident", "state"],
)
def test_every_action_on_an_unknown_id_names_it(manager, call) -> None:
    manager.bind(1, torch.ones(2))
    expected = rf"{call}\(42\): storage id 42 is not bound \(bound: \[1\]\)"
    with pytest.raises(ResidencyMisuseError, match=expected):
        getattr(manager, call)(42)


def test_release_device_twice_raises(manager) -> None:
    offloaded(manager)
    with pytest.raises(ResidencyMisuseError, match="already released"):
        manager.release_device(0)


def test_copy_h2d_without_host_copy_raises(manager) -> None:
    manager.bind(0, torch.ones(4))
    manager.release_device(0)
    with pytest.raises(ResidencyMisuseError, match="no host copy"):
        manager.copy_h2d(0)


def test_copy_h2d_of_resident_storage_raises(manager) -> None:
    manager.bind(0, torch.ones(4))
    manager.copy_d2h(0)
    with pytest.raises(ResidencyMisuseError, match="already on the device"):
        manager.copy_h2d(0)


def test_prefetch_after_host_release_raises(manager) -> None:
    offloaded(manager)
    manager.release_host(0)
    assert manager.state(0) is BufferState.RELEASED
    with pytest.raises(ResidencyMisuseError, match="host copy was released"):
        manager.copy_h2d(0)
    with pytest.raises(DataLostError):
        manager.device_storage(0)


def test_release_host_twice_or_without_copy_raises(manager) -> None:
    manager.bind(0, torch.ones(4))
    with pytest.raises(ResidencyMisuseError, match="no host copy"):
        manager.release_host(0)
    manager.copy_d2h(0)
    manager.release_host(0)
    with pytest.raises(ResidencyMisuseError, match="released already"):
        manager.release_host(0)
    assert manager.pool.stats().buffers_in_use == 0


def test_copy_d2h_of_offloaded_storage_raises(manager) -> None:
    offloaded(manager)
    with pytest.raises(ResidencyMisuseError, match="not on the device"):
        manager.copy_d2h(0)


def test_wait_h2d_on_offloaded_storage_raises(manager) -> None:
    offloaded(manager)
    with pytest.raises(ResidencyMisuseError, match="must follow the COPY_H2D"):
        manager.wait_h2d(0)


def test_bind_rules(manager) -> None:
    manager.bind(0, torch.ones(4))
    with pytest.raises(ResidencyMisuseError, match="already bound"):
        manager.bind(0, torch.ones(4))
    with pytest.raises(ResidencyMisuseError, match="ints"):
        manager.bind("x", torch.ones(4))  # type: ignore[arg-type]
    with pytest.raises(ResidencyMisuseError, match="expected a torch.Tensor"):
        manager.bind(1, [1.0])  # type: ignore[arg-type]
    assert list(manager) == [0]


def test_unbind_of_offloaded_storage_raises_instead_of_dropping_data(manager) -> None:
    offloaded(manager)
    with pytest.raises(ResidencyMisuseError, match="only copy is on the host"):
        manager.unbind(0)
    assert manager.state(0) is BufferState.HOST


# ---------------------------------------------------------------- failure injection


def test_failed_d2h_keeps_device_copy_and_leaks_nothing(
    pool, failing_engine_cls, make_random, bits_equal
) -> None:
    engine = failing_engine_cls(fail_on={"d2h"})
    manager = ResidencyManager(engine, pool)
    tensor = make_random((64,), seed=5)
    reference = tensor.clone()
    manager.bind(0, tensor)
    expected = r"copy_d2h\(storage 0\) failed.*device copy is intact"
    with pytest.raises(TransferFailedError, match=expected) as info:
        manager.copy_d2h(0)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert engine.engine_syncs == 1  # copy stream drained before the buffer went back
    assert manager.state(0) is BufferState.DEVICE and bits_equal(tensor, reference)
    assert manager.transfers_in_flight() == 0
    stats = pool.stats()
    assert stats.buffers_in_use == 0 and stats.pending_releases == 0
    manager.release_device(0)
    with pytest.raises(ResidencyMisuseError, match="no host copy"):
        manager.copy_h2d(0)  # the failed copy is never mistaken for a host copy


def test_failed_second_d2h_discards_the_overwritten_host_copy(pool, failing_engine_cls) -> None:
    engine = failing_engine_cls()
    manager = ResidencyManager(engine, pool)
    manager.bind(0, torch.ones(64))
    manager.copy_d2h(0)
    engine.fail_on = {"d2h"}
    with pytest.raises(TransferFailedError, match="partly overwritten and is discarded"):
        manager.copy_d2h(0)
    assert manager.state(0) is BufferState.DEVICE and pool.stats().buffers_in_use == 0


def test_failed_h2d_keeps_host_copy_and_exposes_no_partial_data(
    pool, failing_engine_cls, make_random, bits_equal
) -> None:
    engine = failing_engine_cls()
    manager = ResidencyManager(engine, pool)
    tensor = make_random((100,), dtype=torch.float64, seed=6)
    reference = tensor.clone()
    manager.bind(0, tensor)
    manager.copy_d2h(0)
    manager.release_device(0)
    engine.fail_on = {"h2d"}
    with pytest.raises(TransferFailedError, match="host copy is intact"):
        manager.copy_h2d(0)
    assert manager.state(0) is BufferState.HOST
    assert tensor.untyped_storage().nbytes() == 0  # the half-written bytes are gone
    assert manager.transfers_in_flight() == 0 and pool.stats().buffers_in_use == 1

    engine.fail_on = set()  # the activation is recoverable
    manager.copy_h2d(0)
    assert bits_equal(tensor, reference)


class _ExhaustedPool(PinnedMemoryPool):
    def acquire(self, nbytes: int) -> torch.Tensor:
        raise MemoryError("host memory exhausted")


def test_failing_host_allocation_changes_nothing() -> None:
    pool = _ExhaustedPool(MIB, pin=False)
    manager = ResidencyManager(TransferEngine("cpu"), pool)
    manager.bind(0, torch.ones(4))
    with pytest.raises(MemoryError):
        manager.copy_d2h(0)
    assert manager.state(0) is BufferState.DEVICE and manager.transfers_in_flight() == 0


# ---------------------------------------------------------------- property: model check

_ACTIONS = ("copy_d2h", "release_device", "copy_h2d", "wait_h2d", "release_host")


def _expected_ok(action: str, on_device: bool, on_host: bool) -> bool:
    return {
        "copy_d2h": on_device,
        "release_device": on_device,
        "copy_h2d": on_host and not on_device,
        "wait_h2d": on_device,
        "release_host": on_host,
    }[action]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(_ACTIONS), st.integers(0, 2)), max_size=30))
def test_random_action_sequences_match_the_state_model(steps) -> None:
    pool = PinnedMemoryPool(MIB, pin=False)
    manager = ResidencyManager(TransferEngine("cpu"), pool)
    tensors = [torch.arange(40, dtype=torch.float32) * (sid + 1) for sid in range(3)]
    references = [t.clone() for t in tensors]
    model = {sid: [True, False] for sid in range(3)}  # [on_device, on_host]
    for sid, tensor in enumerate(tensors):
        manager.bind(sid, tensor)
    for action, sid in steps:
        on_device, on_host = model[sid]
        if _expected_ok(action, on_device, on_host):
            getattr(manager, action)(sid)
            if action == "copy_d2h":
                model[sid][1] = True
            elif action == "release_device":
                model[sid][0] = False
            elif action == "copy_h2d":
                model[sid][0] = True
            elif action == "release_host":
                model[sid][1] = False
        else:
            with pytest.raises(ResidencyMisuseError, match=rf"{action}\(.*{sid}"):
                getattr(manager, action)(sid)
        for s, (dev, host) in model.items():
            assert manager.is_resident(s) == dev and manager.has_host_copy(s) == host
            assert tensors[s].untyped_storage().nbytes() == (160 if dev else 0)
            if dev:
                assert torch.equal(tensors[s], references[s])
        assert pool.stats().buffers_in_use == sum(host for _, host in model.values())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    steps=st.lists(
        st.tuples(st.sampled_from((*_ACTIONS, "complete")), st.integers(0, 2), st.integers(0, 7)),
        max_size=30,
    ),
    records_streams=st.booleans(),
)
def test_random_sequences_on_an_async_engine_leak_nothing(
    deferred_engine_cls, steps, records_streams  # noqa: ANN001
) -> None:
    """Copies that complete out of step with the actions (as on CUDA, where a wait only
    orders a stream): after reset every buffer is back, every kept storage bit-exact."""
    engine = deferred_engine_cls(records_streams=records_streams, stream_waits=True)
    pool = PinnedMemoryPool(MIB, pin=False)
    manager = ResidencyManager(engine, pool)
    tensors = [torch.arange(40, dtype=torch.float32) * (sid + 1) for sid in range(3)]
    references = [t.clone() for t in tensors]
    for sid, tensor in enumerate(tensors):
        manager.bind(sid, tensor)
    for action, sid, mask in steps:
        if action == "complete":  # some in-flight copies finish now
            for index, (_, event, _) in enumerate(engine.log):
                if mask >> (index % 3) & 1:
                    event.fire()
            continue
        try:
            getattr(manager, action)(sid)
        except ResidencyMisuseError:
            pass  # refusals are covered by the sync model check above
    released = {sid for sid in range(3) if manager.state(sid) is BufferState.RELEASED}
    manager.reset()
    assert not engine.in_flight() and manager.transfers_in_flight() == 0
    stats = pool.stats()
    assert stats.buffers_in_use == 0 and stats.pending_releases == 0
    for sid, (tensor, reference) in enumerate(zip(tensors, references)):
        if sid in released:  # dropped on purpose: stays at zero bytes, never garbage
            assert tensor.untyped_storage().nbytes() == 0
        else:
            assert torch.equal(tensor, reference)

