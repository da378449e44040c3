"""DeviceMemoryMeter: frees, views, resizes, host labels, threads, and the profiler; the
StorageLedger every storage follower in the library shares."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.profiler import ProfilerActivity, profile

from hyper_offload.runtime.memory_meter import (
    DeviceMemoryMeter,
    MemorySample,
    StorageLedger,
    is_host_labelled,
    label_host,
)

F32 = 4  # bytes per float32 element

# The meter and torch.profiler count the same allocations of a plain MLP step; the only
# admissible difference would be allocator-internal bytes the dispatcher never sees.
PROFILER_TOLERANCE = 0.01


def _profiler_alloc_curve(prof: profile) -> list[int]:
    """Running sum of the profiler's allocation records (bytes allocated since start)."""
    from torch._C._profiler import _EventType

    def walk(nodes):  # noqa: ANN001, ANN202 - profiler event-tree nodes
        for node in nodes:
            yield node
            yield from walk(node.children)

    tree = prof.profiler.kineto_results.experimental_event_tree()
    allocations = sorted(
        (node for node in walk(tree) if node.tag == _EventType.Allocation),
        key=lambda node: node.start_time_ns,
    )
    total, curve = 0, []
    for node in allocations:
        total += node.extra_fields.alloc_size
        curve.append(total)
    return curve


def _mlp() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)
    )
    return model, torch.randn(64, 256)


def test_agrees_with_torch_profiler_on_mlp_step() -> None:
    model, x = _mlp()
    meter = DeviceMemoryMeter("cpu").register(*model.parameters(), x)
    registered = meter.peak_bytes
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with meter:
            model(x).sum().backward()
    profiler_curve = _profiler_alloc_curve(prof)
    assert registered == sum(p.numel() for p in model.parameters()) * F32 + x.numel() * F32

    meter_peak = meter.peak_bytes - registered
    profiler_peak = max(profiler_curve)
    relative = abs(meter_peak - profiler_peak) / profiler_peak
    assert relative <= PROFILER_TOLERANCE, (meter_peak, profiler_peak)
    # After the step only the gradients remain: both must see exactly that.
    grads = sum(p.grad.numel() for p in model.parameters()) * F32
    assert meter.live_bytes - registered == grads
    assert abs(profiler_curve[-1] - grads) / grads <= PROFILER_TOLERANCE


def test_sees_backward_ops_and_the_step_shape() -> None:
    model, x = _mlp()
    meter = DeviceMemoryMeter("cpu").register(*model.parameters(), x)
    with meter:
        model(x).sum().backward()
    ops = meter.ops()
    assert "aten.threshold_backward.default" in ops
    assert len(meter.curve()) == len(meter.samples) == len(ops)
    assert all(isinstance(s, MemorySample) and s.peak_bytes >= s.live_bytes for s in meter.samples)
    assert meter.peak_bytes == max(s.peak_bytes for s in meter.samples)
    assert meter.allocator_peak_bytes is None  # CPU has no allocator counters


def test_dropping_a_saved_activation_drops_the_curve_by_its_bytes() -> None:
    w = torch.randn(32, 64, requires_grad=True)
    x = torch.randn(16, 32)
    meter = DeviceMemoryMeter("cpu").register(w, x)
    with meter:
        act = (x @ w).sigmoid()  # sigmoid saves its output for backward
        loss = act.sum()
        act_bytes = act.untyped_storage().nbytes()
        del act  # still saved by the graph: nothing is freed
        torch.ones(1)
        held = meter.curve()[-1]
        del loss  # the graph goes, and with it the saved activation
        torch.ones(1)
        dropped = meter.curve()[-1]
    # x @ w's output is not saved by sigmoid's backward, so it was freed at once; the last
    # two samples differ by the activation alone (each holds one 4-byte ones(1)).
    assert held - dropped == act_bytes + F32  # and the 4-byte loss itself
    assert act_bytes == 16 * 64 * F32


def test_views_and_in_place_results_are_not_counted_twice() -> None:
    meter = DeviceMemoryMeter("cpu")
    with meter:
        base = torch.zeros(10, 100)
        views = [base.view(100, 10), base.t(), base[2:5], base.reshape(-1), base.add_(1)]
        assert meter.live_bytes == 1000 * F32
        alias = views[0].as_strided((5,), (1,))
        assert meter.live_bytes == 1000 * F32
        del base, views, alias
        assert meter.live_bytes == 0


def test_resize_through_an_op_and_directly_on_the_storage_is_accounted() -> None:
    meter = DeviceMemoryMeter("cpu")
    with meter:
        t = torch.empty(10)
        t.resize_(1000)  # aten.resize_: visible in the sample of that very op
        assert meter.samples[-1].live_bytes == 1000 * F32
        t.untyped_storage().resize_(0)  # how the runtime frees device bytes: no op at all
        assert meter.live_bytes == 0
        t.untyped_storage().resize_(40)
        torch.ones(2)
        assert meter.samples[-1].live_bytes == 40 + 2 * F32
    assert meter.peak_bytes == 1000 * F32


def test_sample_peak_sees_growth_that_is_gone_by_the_next_op() -> None:
    meter = DeviceMemoryMeter("cpu")
    with meter:
        t = torch.empty(10)
        t.untyped_storage().resize_(4000)
        assert meter.live_bytes == 4000  # reading re-counts: the window saw 4000 bytes
        t.untyped_storage().resize_(0)
        torch.ones(1)
    last = meter.samples[-1]
    assert (last.live_bytes, last.peak_bytes) == (4, 4000)
    assert meter.peak_bytes == 4000


def test_host_labelled_storages_are_excluded() -> None:
    meter = DeviceMemoryMeter("cpu")
    with meter:
        device_t = torch.ones(100)
        host_t = torch.ones(300)
        assert meter.live_bytes == 400 * F32
        meter.label_host(host_t[10:])  # a view labels its whole storage
        assert is_host_labelled(host_t)
        assert meter.live_bytes == 100 * F32
        fresh_host = torch.empty(50)
        label_host(fresh_host)  # module-level label: seen at the next op
        torch.ones(1)
        assert meter.samples[-1].live_bytes == 101 * F32
    registered_host = torch.empty(64)
    label_host(registered_host.untyped_storage())
    late = DeviceMemoryMeter("cpu").register(registered_host, device_t)
    assert late.live_bytes == 100 * F32
    del fresh_host


def test_registration_ignores_other_devices_and_counts_storages_once() -> None:
    shared = torch.empty(8, 8)
    meter = DeviceMemoryMeter("cpu").register(
        shared, shared.t(), shared[0], torch.empty(3, device="meta")
    )
    assert meter.live_bytes == 64 * F32
    with pytest.raises(TypeError, match="expected a torch.Tensor or torch.UntypedStorage"):
        meter.register(3)  # type: ignore[arg-type]


def test_unregistered_preexisting_storages_and_their_views_are_ignored() -> None:
    param = torch.ones(1000)
    meter = DeviceMemoryMeter("cpu")
    with meter:
        view = param.view(10, 100).t()
        out = view * 2
    assert meter.live_bytes == out.untyped_storage().nbytes() == 1000 * F32
    del view


def test_a_meter_measures_one_step_only() -> None:
    meter = DeviceMemoryMeter("cpu")
    with meter:
        torch.ones(1)
    with pytest.raises(RuntimeError, match="already entered.*create a new DeviceMemoryMeter"):
        with meter:
            pass


def test_wrapper_subclass_outputs_count_their_inner_storages() -> None:
    from torch.testing._internal.two_tensor import TwoTensor

    a, b = torch.ones(10), torch.ones(10)
    meter = DeviceMemoryMeter("cpu")
    with meter:
        doubled = TwoTensor(a, b) * 2
    assert meter.live_bytes == 20 * F32
    del doubled
    assert meter.live_bytes == 0


class _Reentrant(torch.autograd.Function):
    """Backward runs a nested backward; past the engine's depth limit (60) the nested
    ones run on autograd worker threads, which is where the meter must follow."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, depth: int) -> torch.Tensor:  # noqa: ANN001
        ctx.depth = depth
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN001
        (x,) = ctx.saved_tensors
        _Reentrant.threads.add(threading.get_ident())
        if ctx.depth > 0:
            with torch.enable_grad():
                leaf = x.detach().requires_grad_()
                (inner,) = torch.autograd.grad(_Reentrant.apply(leaf, ctx.depth - 1).sum(), leaf)
            return grad * 2 + inner * 0, None
        return grad * 2, None

    threads: set[int] = set()


def test_sees_backward_ops_on_autograd_worker_threads() -> None:
    _Reentrant.threads = set()
    x = torch.randn(3, requires_grad=True)
    meter = DeviceMemoryMeter("cpu")
    with meter:
        _Reentrant.apply(x, 70).sum().backward()
    assert len(_Reentrant.threads) > 1, "the engine did not use a worker thread"
    # 71 backward calls each do one `grad * 2`; all of them must be metered.
    assert meter.ops().count("aten.mul.Tensor") >= 2 * 71


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["new", "view", "drop", "resize", "host"]),
            st.integers(0, 7),
            st.integers(0, 64),
        ),
        max_size=30,
    )
)
def test_live_bytes_equal_the_distinct_live_device_storages(
    steps: list[tuple[str, int, int]],
) -> None:
    """Whatever mix of allocations, views, frees, resizes and labels: the meter's count is
    the sum of nbytes over distinct alive non-host storages created in the step."""
    meter = DeviceMemoryMeter("cpu")
    held: list[torch.Tensor] = []
    with meter:
        for kind, pick, size in steps:
            if kind == "new" or not held:
                held.append(torch.empty(size, dtype=torch.uint8))
                continue
            target = held[pick % len(held)]
            if kind == "drop":
                del held[pick % len(held)]
            elif kind == "view":
                # set_ with a storage argument: a new tensor on an existing storage.
                held.append(torch.empty(0, dtype=torch.uint8).set_(target.untyped_storage()))
            elif kind == "resize":
                target.untyped_storage().resize_(size)
            else:
                label_host(target)
            del target  # the loop must not keep a dropped tensor alive
        distinct = {id(t.untyped_storage()): t.untyped_storage() for t in held}
        expected = sum(s.nbytes() for s in distinct.values() if not is_host_labelled(s))
        assert meter.live_bytes == expected


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_meter_step_delta_matches_the_allocator_delta() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)
    ).cuda()
    x = torch.randn(64, 256, device="cuda")
    model(x).sum().backward()  # warm-up: cuBLAS workspaces exist before we measure
    for p in model.parameters():
        p.grad = None  # the measured step allocates its gradients again
    torch.cuda.synchronize()
    meter = DeviceMemoryMeter("cuda").register(*model.parameters(), x)
    registered = meter.peak_bytes
    with meter:
        model(x).sum().backward()
    assert "aten.threshold_backward.default" in meter.ops()  # backward ran on a device thread
    # Compare what the step *added*: the allocator's peak also holds everything alive
    # before the step (parameters, cuBLAS workspaces, leftovers of earlier tests).
    meter_step = meter.peak_bytes - registered
    allocator_step = meter.allocator_step_peak_bytes
    assert allocator_step is not None and meter.allocator_base_bytes >= registered
    # Every byte the meter counts is an allocator block, rounded up to 512 B.
    slack = 512 * len(meter.samples)
    assert meter_step <= allocator_step <= meter_step + slack, meter.allocator_summary()
    assert meter.allocator_reserved_peak_bytes >= meter.allocator_peak_bytes
    assert "max_memory_reserved" in meter.allocator_summary()


# ---------------------------------------------------------------- the storage ledger


class _Owner:
    """Owns a ledger, as the meters and the eager tracker do (``on_death`` a method)."""

    def __init__(self) -> None:
        self.ended: list[str] = []
        self.ledger: StorageLedger[str] = StorageLedger(self.died)

    def died(self, record: str) -> None:
        self.ended.append(record)


def test_a_record_ends_when_its_storage_dies_and_never_by_a_storage_at_the_same_address():
    owner = _Owner()
    first = torch.empty(1024)
    owner.ledger.add(first.untyped_storage(), "first")
    view = first[:10]
    assert owner.ledger.get(view.untyped_storage()) == "first"  # one storage, any handle
    del first
    assert owner.ended == [] and len(owner.ledger) == 1  # the view still holds it
    address = view.untyped_storage()._cdata
    del view
    assert owner.ended == ["first"] and len(owner.ledger) == 0
    # The allocator hands the address out again: a new storage is a new entry.
    again = [torch.empty(1024) for _ in range(8)]
    reused = [t for t in again if t.untyped_storage()._cdata == address]
    for tensor in again:
        assert owner.ledger.get(tensor.untyped_storage()) is None
    if reused:
        owner.ledger.add(reused[0].untyped_storage(), "second")
        assert owner.ended == ["first"]
        del reused, again
        assert owner.ended == ["first", "second"]


def test_forgotten_records_end_nothing_and_the_ledger_keeps_nothing_alive():
    import gc
    import weakref

    owner = _Owner()
    kept = torch.empty(16)
    ref = owner.ledger.add(kept.untyped_storage(), "kept")
    assert ref() is kept.untyped_storage()
    owner.ledger.clear()
    del kept
    assert owner.ended == []  # cleared: its callback ends nothing
    alive = torch.empty(16)
    owner.ledger.add(alive.untyped_storage(), "alive")
    gone = weakref.ref(owner)
    del owner
    gc.collect()
    assert gone() is None  # a live storage does not keep the ledger's owner alive
    del alive  # its callback finds no ledger: nothing happens
