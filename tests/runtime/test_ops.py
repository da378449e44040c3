"""Transfer custom ops: schemas, tracing, DCE, round trips, gradients, keepalive, and a host
copy's lifetime (its buffer returns at its death). Misuse: ``test_ops_misuse.py``."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from hyper_offload.runtime import ops
from hyper_offload.runtime.memory_meter import DeviceMemoryMeter
from hyper_offload.runtime.pinned_pool import PinnedMemoryPool
from hyper_offload.runtime.transfer_context import TransferRuntime
from hyper_offload.runtime.transfer_records import HostCopyState

ROUND_TRIP = [ops.COPY_D2H, ops.WAIT_TRANSFER, ops.COPY_H2D, ops.WAIT_TRANSFER, ops.RELEASE_HOST]


def round_trip(x: torch.Tensor) -> torch.Tensor:
    """offload → wait → prefetch → wait → release, as the FX lowering emits it."""
    act = x.sin()
    host = ops.wait_transfer(ops.copy_d2h(act), keepalive=act)
    back = ops.wait_transfer(ops.copy_h2d(host, x.device), keepalive=host)
    ops.release_host(host, after=back)
    return back * 2


def transfer_nodes(gm: torch.fx.GraphModule) -> list[object]:
    return [
        n.target for n in gm.graph.nodes if n.op == "call_function" and n.target in ops.TRANSFER_OPS
    ]


# ---------------------------------------------------------------- declarations


def test_schemas_declare_exactly_what_the_ops_do() -> None:
    assert [str(op._schema) for op in ops.TRANSFER_OPS] == [
        "hyper_offload::copy_d2h(Tensor src, int[]? dim_order=None, int slot=-1) -> Tensor",
        "hyper_offload::copy_h2d(Tensor host, Device device) -> Tensor",
        "hyper_offload::wait_transfer(Tensor(a) tensor, Tensor? keepalive=None) -> Tensor(a)",
        "hyper_offload::release_host(Tensor host, Tensor? after=None) -> ()",
    ]
    for op in ops.TRANSFER_OPS:
        assert not op._schema.is_mutable  # nothing is written in place
    # Only the wait aliases, and only its first argument: it returns that very tensor.
    wait_schema = ops.WAIT_TRANSFER._schema
    assert (
        wait_schema.returns[0].alias_info.before_set
        == wait_schema.arguments[0].alias_info.before_set
    )
    assert wait_schema.arguments[1].alias_info is None
    # Inductor passes every argument as it is (the keepalive must be the copied buffer).
    for op in ops.TRANSFER_OPS:
        assert op.tags == [torch.Tag.flexible_layout]


def test_the_wait_returns_its_input_and_the_copies_return_new_storage(
    runtime: TransferRuntime,
) -> None:
    src = torch.ones(4)
    host = ops.copy_d2h(src)
    assert ops.wait_transfer(host, src) is host
    back = ops.copy_h2d(host, "cpu")
    assert back.untyped_storage().data_ptr() not in (
        host.untyped_storage().data_ptr(),
        src.untyped_storage().data_ptr(),
    )
    assert ops.wait_transfer(back, host) is back
    ops.release_host(host, back)


def test_fake_kernels_give_layout_and_device_without_a_runtime() -> None:
    with FakeTensorMode():
        act = torch.empty(4, 3, dtype=torch.bfloat16, device="cuda").t()  # fake: no GPU needed
        host = ops.copy_d2h(act)
        back = ops.copy_h2d(ops.wait_transfer(host, act), "cuda")
        waited = ops.wait_transfer(back, host)
        assert ops.release_host(host, waited) is None
    assert (host.device.type, host.shape, host.stride(), host.dtype) == (
        "cpu",
        (3, 4),
        (1, 3),
        torch.bfloat16,
    )
    assert (back.device.type, back.shape, back.stride()) == ("cuda", (3, 4), (1, 3))
    assert waited.device == back.device and waited.shape == back.shape


def test_make_fx_graph_holds_the_ops_in_order_with_keepalive_edges() -> None:
    gm = make_fx(round_trip, tracing_mode="fake")(torch.randn(4, 3))
    assert transfer_nodes(gm) == ROUND_TRIP
    nodes = {n.name: n for n in gm.graph.nodes}
    # The activation's last use is the D2H wait: that edge is what keeps it alive.
    assert list(nodes["sin"].users) == [nodes["copy_d2h"], nodes["wait_transfer"]]
    assert nodes["wait_transfer"].args == (nodes["copy_d2h"], nodes["sin"])
    assert nodes["wait_transfer_1"].args == (nodes["copy_h2d"], nodes["wait_transfer"])
    assert nodes["release_host"].args == (nodes["wait_transfer"], nodes["wait_transfer_1"])


def test_dead_code_elimination_keeps_every_transfer_op() -> None:
    def results_unused(x: torch.Tensor) -> torch.Tensor:
        host = ops.copy_d2h(x)
        ops.wait_transfer(host, x)  # result unused: only the side effect matters
        back = ops.copy_h2d(host, x.device)
        ops.wait_transfer(back, host)
        ops.release_host(host)
        x.cos()  # a pure op nobody uses: DCE must remove this one
        return x + 1

    gm = make_fx(results_unused, tracing_mode="fake")(torch.randn(8))
    assert any(n.target is torch.ops.aten.cos.default for n in gm.graph.nodes)
    gm.graph.eliminate_dead_code()
    assert not any(n.target is torch.ops.aten.cos.default for n in gm.graph.nodes)
    assert transfer_nodes(gm) == ROUND_TRIP


def test_functionalized_graph_feeds_readers_from_the_wait() -> None:
    """AOTAutograd functionalizes: the aliasing wait must survive it, and every reader of
    a transferred tensor must read the wait's output, never the copy's."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_function

    graphs: list[torch.fx.GraphModule] = []

    def keep(gm: torch.fx.GraphModule, _: object) -> object:
        graphs.append(gm)
        return make_boxed_func(gm)

    with TransferRuntime(pool=PinnedMemoryPool(1 << 20)):
        aot_function(round_trip, fw_compiler=keep)(torch.randn(4, 3))
    (gm,) = graphs
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    waits = [n for n in nodes if n.target is ops.WAIT_TRANSFER]
    assert len(waits) == 2
    d2h_wait, h2d_wait = waits
    copy_h2d = next(
        n for n in nodes if len(n.args) > 1 and n.args[1] is ops.COPY_H2D
    )  # in with_effects
    assert copy_h2d.args[2] is d2h_wait  # prefetch reads the waited host copy
    mul = next(n for n in nodes if n.target is torch.ops.aten.mul.Tensor)
    assert mul.args[0] is h2d_wait  # compute reads the waited device tensor


# ---------------------------------------------------------------- real kernels on CPU


@settings(max_examples=25, deadline=None)
@given(
    dtype=st.sampled_from(
        [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.bool, torch.complex64]
    ),
    shape=st.lists(st.integers(0, 5), min_size=1, max_size=3),
    layout=st.sampled_from(["contiguous", "transposed", "strided"]),
)
def test_round_trip_is_bit_identical_and_real_layout_matches_fake(
    dtype: torch.dtype, shape: list[int], layout: str
) -> None:
    src = torch.randn(shape, dtype=torch.float64).mul(1e3).to(dtype)
    if layout == "transposed":
        src = src.transpose(0, -1)
    elif layout == "strided":
        src = src[..., ::2]  # not dense: the host copy is packed
    with FakeTensorMode() as mode:
        fake_host = ops.copy_d2h(mode.from_tensor(src))
        fake_back = ops.copy_h2d(fake_host, "cpu")
    with TransferRuntime(pool=PinnedMemoryPool(1 << 20)) as rt:
        host = ops.wait_transfer(ops.copy_d2h(src), src)
        back = ops.wait_transfer(ops.copy_h2d(host, "cpu"), host)
        assert torch.equal(host, src) and torch.equal(back, src)
        for real, fake in ((host, fake_host), (back, fake_back)):
            assert (real.shape, real.stride(), real.dtype) == (
                fake.shape,
                fake.stride(),
                fake.dtype,
            )
        assert back.stride() == host.stride() == ops.dense_layout(src)[1]
        if layout != "strided" and src.numel() > 0:
            assert host.stride() == src.stride()  # dense layouts travel unchanged
        assert (
            back.untyped_storage().data_ptr() != src.untyped_storage().data_ptr()
            or src.numel() == 0
        )
        ops.release_host(host, back)
        assert rt.host_state(host) is HostCopyState.RELEASED


def test_dense_layout_keeps_dense_strides_and_packs_the_rest_row_major() -> None:
    base = torch.empty(4, 6)
    assert ops.dense_layout(base.t()) == ((6, 4), (1, 6))  # transposed: kept
    assert ops.dense_layout(base[:, ::2]) == ((4, 3), (3, 1))  # gaps: packed
    assert ops.dense_layout(base[:1].expand(3, 6)) == ((3, 6), (6, 1))  # overlap: packed
    assert ops.dense_layout(base[:1]) == ((1, 6), (6, 1))  # size-1 dims: stride kept
    assert ops.dense_layout(base[:, :1]) == ((4, 1), (1, 1))  # a column: gaps, packed
    assert ops.dense_layout(torch.empty(0)[::2]) == ((0,), (1,))  # empty: row-major
    assert ops.dense_layout(torch.tensor(3.0)) == ((), ())


def test_dim_order_fixes_the_host_layout_whatever_the_source_layout(
    runtime: TransferRuntime,
) -> None:
    """The layout the fake value was planned with, even when the real source is laid out
    otherwise (as Inductor may lay out an intermediate): the copy gathers, the values and
    the promised strides hold, and the fake kernel promises the same strides."""
    planned = torch.empty(4, 8, 2, 16)  # contiguous: dims fastest to slowest 3, 2, 1, 0
    order = ops.dim_order_of(planned)
    assert order == [3, 2, 1, 0]
    src = torch.randn(4, 2, 8, 16).transpose(1, 2)  # same values' shape, permuted layout
    host = ops.copy_d2h(src, order)
    ops.wait_transfer(host, src)
    assert host.stride() == planned.stride() and torch.equal(host, src)
    with FakeTensorMode() as mode:
        fake = ops.COPY_D2H(mode.from_tensor(src), order)
    assert fake.stride() == planned.stride()
    assert ops.dim_order_of(torch.empty(4, 8, 1)) == [2, 1, 0]  # size-1 ties: later dim first
    with pytest.raises(ValueError, match="not a permutation"):
        ops.host_layout(src, [0, 1, 1, 3])


def test_torch_compile_aot_eager_gives_identical_values_and_gradients(
    runtime: TransferRuntime,
) -> None:
    x = torch.randn(16, 8)
    compiled = torch.compile(round_trip, backend="aot_eager", fullgraph=True)
    x_eager, x_compiled = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected = round_trip(x_eager)
    got = compiled(x_compiled)
    expected.sum().backward()
    got.sum().backward()
    assert torch.equal(got, expected) and torch.equal(x_compiled.grad, x_eager.grad)
    assert torch.equal(got, x.sin() * 2)
    stats = runtime.pool.stats()
    assert stats.hits + stats.misses == 2  # both runs really offloaded (nothing was eliminated)
    assert stats.buffers_in_use == 0 and runtime.transfers_pending == 0


def _d2h_then_wait(x: torch.Tensor) -> torch.Tensor:
    host = ops.wait_transfer(ops.copy_d2h(x), x)
    out = host * 1.0  # a fresh tensor, so the host copy can go back to the pool
    ops.release_host(host)
    return out


def _through_host_and_back(x: torch.Tensor) -> torch.Tensor:
    host = ops.wait_transfer(ops.copy_d2h(x), x)
    back = ops.wait_transfer(ops.copy_h2d(host, x.device), host)
    ops.release_host(host, back)
    return back


@pytest.mark.parametrize("fn", [_d2h_then_wait, _through_host_and_back], ids=lambda f: f.__name__)
def test_gradients_pass_gradcheck(runtime: TransferRuntime, fn) -> None:  # noqa: ANN001
    # Independent of our own backward: finite differences of the forward.
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(fn, (x,), eps=1e-6, atol=1e-8)
    assert runtime.transfers_pending == 0


@pytest.mark.parametrize("fn", [_d2h_then_wait, _through_host_and_back], ids=lambda f: f.__name__)
def test_gradients_equal_those_of_a_plain_device_copy(runtime: TransferRuntime, fn) -> None:  # noqa: ANN001
    x = random_finite((4, 6), seed=3).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    upstream = random_finite((4, 6), seed=4)
    fn(x).backward(upstream)
    x_ref.to(torch.device("cpu"), copy=True).backward(upstream)  # autograd's own copy
    assert torch.equal(x.grad, x_ref.grad) and torch.equal(x.grad, upstream)


def random_finite(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def test_keepalive_source_lives_until_its_wait(runtime: TransferRuntime) -> None:
    src = torch.randn(1000)
    expected = src.clone()
    storage_ref = weakref.ref(src.untyped_storage())
    host = ops.copy_d2h(src)
    del src
    gc.collect()
    assert storage_ref() is not None, "the source died while its transfer was pending"
    ops.wait_transfer(host)
    gc.collect()
    assert storage_ref() is None, "the runtime kept the source after the wait"
    assert torch.equal(host, expected)
    ops.release_host(host)


def test_host_copies_are_labelled_host_for_the_meter(runtime: TransferRuntime) -> None:
    meter = DeviceMemoryMeter("cpu")
    with meter:
        act = torch.ones(256)  # 1 KiB of "device" memory
        host = ops.wait_transfer(ops.copy_d2h(act), act)
        after_offload = meter.live_bytes
        del act
        after_free = meter.live_bytes
        back = ops.wait_transfer(ops.copy_h2d(host, "cpu"), host)
        after_prefetch = meter.live_bytes
        ops.release_host(host, back)
    assert (after_offload, after_free, after_prefetch) == (1024, 0, 1024)
    del back


@pytest.mark.parametrize("requires_grad", [False, True], ids=["plain", "autograd"])
def test_a_host_buffer_is_reused_only_once_no_tensor_reaches_its_copy(
    runtime: TransferRuntime, requires_grad: bool
) -> None:
    pool = runtime.pool
    # Under autograd the wait returns a new tensor object on the same storage, and the
    # copy's own result can die first: any live tensor on the copy must hold it back.
    first = ops.wait_transfer(ops.copy_d2h(torch.ones(16, requires_grad=requires_grad)))
    assert first.requires_grad is requires_grad
    ops.release_host(first)
    alias = first.detach().view(4, 4)  # another object on the copy's storage
    del first
    gc.collect()
    second = ops.wait_transfer(ops.copy_d2h(torch.zeros(16)))
    assert second.untyped_storage().data_ptr() != alias.untyped_storage().data_ptr()
    # Released by the program, still reachable: readable, and its bytes are intact.
    back = ops.wait_transfer(ops.copy_h2d(alias, "cpu"), alias)
    assert torch.equal(back, torch.ones(4, 4)) and pool.stats().buffers_in_use == 2
    del alias
    gc.collect()
    assert pool.stats().buffers_in_use == 1  # the last tensor died: the buffer is back
    third = ops.wait_transfer(ops.copy_d2h(torch.ones(16)))
    assert pool.stats().hits == 1  # ...and reused
    ops.release_host(second)
    ops.release_host(third)


def test_a_host_copy_goes_back_to_the_pool_when_it_dies_unreleased(runtime: TransferRuntime) -> None:
    # A forward whose backward never runs (no backward, or one that raised) leaves host
    # copies no release_host reaches: their death alone must return the buffers.
    host = ops.wait_transfer(ops.copy_d2h(torch.ones(256)))
    assert runtime.pool.stats().buffers_in_use == 1 and runtime.host_copies == 1
    del host
    stats = runtime.pool.stats()
    assert stats.buffers_in_use == 0 and stats.pinned_bytes_cached == 1024
    assert runtime.host_copies == 0


def test_a_host_copy_in_a_reference_cycle_returns_at_collection(runtime: TransferRuntime) -> None:
    # The garbage collector may free it inside any code, the pool's own locked sections
    # included: the finalizer must neither block nor lose the buffer.
    class Holder:
        pass

    holder = Holder()
    holder.self, holder.host = holder, ops.wait_transfer(ops.copy_d2h(torch.ones(64)))
    del holder
    assert runtime.pool.stats().buffers_in_use == 1  # only the cycle collector frees it
    with runtime.pool._lock:  # a collection while the pool's lock is held
        gc.collect()
    assert runtime.pool.stats().buffers_in_use == 0
