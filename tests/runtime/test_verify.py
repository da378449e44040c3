"""Transfer verification (issue 34, first part: the runtime's checksum and its checks).

The checksum covers every byte and is deterministic; each planted copy-stream race
raises :class:`TransferIntegrityError` with ``verify`` on, and without it the same race
goes through silently with other bytes than the program wrote.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hyper_offload import TransferIntegrityError
from hyper_offload.runtime.transfer import TransferEngine
from hyper_offload.runtime.physical_buffer import PhysicalBuffer
from hyper_offload.runtime.pinned_pool import PinnedMemoryPool
from hyper_offload.runtime.verify import BLOCK_WORDS, checksum, same_checksum

from .scripted_cuda import ScriptedCudaEngine

# ------------------------------------------------------------------ the checksum


def _bytes(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("n", [1, 7, 8, 13, 8 * BLOCK_WORDS, 8 * BLOCK_WORDS * 3 + 5])
def test_every_byte_counts_and_equal_bytes_agree(n):
    data = _bytes(n)
    reference = checksum(data)
    assert same_checksum(checksum(data.clone()), reference)  # deterministic
    for position in {0, n // 2, n - 1}:
        changed = data.clone()
        changed[position] ^= 1
        assert not same_checksum(checksum(changed), reference), position


def test_blocks_in_the_wrong_place_are_caught_though_their_sum_is_unchanged():
    data = _bytes(8 * BLOCK_WORDS * 2, seed=1)
    swapped = torch.cat([data[8 * BLOCK_WORDS:], data[: 8 * BLOCK_WORDS]])
    assert checksum(swapped)[0] == checksum(data)[0]  # the plain sum cannot tell
    assert not same_checksum(checksum(swapped), checksum(data))


def test_a_view_at_an_odd_offset_is_covered_too():
    data = _bytes(101, seed=2)
    assert same_checksum(checksum(data[3:]), checksum(data[3:].clone()))
    with pytest.raises(TypeError, match="flat uint8"):
        checksum(torch.zeros(4))


# ------------------------------------------------------------------ planted races


def _buffer(engine: TransferEngine, verify: bool) -> tuple[PhysicalBuffer, torch.Tensor]:
    tensor = torch.arange(1024, dtype=torch.float32)
    pool = PinnedMemoryPool(1 << 20, pin=False)
    return PhysicalBuffer(tensor, engine, pool, label="storage 7", verify=verify), tensor


def _write_after_copy(verify: bool) -> torch.Tensor:
    """The program writes the storage after its D2H was issued and the plan still
    releases it: the host copy holds the bytes from before the write."""
    buffer, tensor = _buffer(TransferEngine("cpu"), verify)
    buffer.start_d2h()
    tensor.add_(1)  # the planted race
    buffer.release_device()
    buffer.start_h2d()
    buffer.wait_device()
    return tensor


class _NoRecordEngine(ScriptedCudaEngine):
    """Says the device side was record_stream-ed but is not: a release before the D2H
    completed frees bytes the copy has yet to read."""

    def _record_stream(self, tensor: torch.Tensor, stream: Any) -> bool:
        return True


def _release_before_d2h_done(verify: bool) -> torch.Tensor:
    engine = _NoRecordEngine()
    buffer, tensor = _buffer(engine, verify)
    buffer.start_d2h()
    buffer.release_device()  # the copy has not run: the stream reads freed bytes
    engine.sim.run_all()
    buffer.start_h2d()
    buffer.wait_device()
    return tensor


def _host_reused_during_h2d(verify: bool) -> torch.Tensor:
    engine = ScriptedCudaEngine()
    buffer, tensor = _buffer(engine, verify)
    buffer.start_d2h()
    buffer.release_device()
    engine.sim.run_all()
    buffer.start_h2d()
    assert buffer.host_buffer is not None
    buffer.host_buffer.fill_(3)  # the planted race: another copy reuses the host buffer
    buffer.wait_device()
    return tensor


RACES = {
    "write after copy": _write_after_copy,
    "release before its D2H is done": _release_before_d2h_done,
    "host buffer reused while its H2D is in flight": _host_reused_during_h2d,
}
CHECK = {"write after copy": "write after copy"}


@pytest.mark.parametrize("race", list(RACES))
def test_a_planted_race_raises_with_verify_and_goes_through_silently_without(race):
    expected = torch.arange(1024, dtype=torch.float32)
    if race == "write after copy":
        expected = expected + 1
    silent = RACES[race](verify=False)
    assert not torch.equal(silent, expected)  # no error, other numbers
    with pytest.raises(TransferIntegrityError) as caught:
        RACES[race](verify=True)
    error = caught.value
    assert error.check == CHECK.get(race, "reload")
    assert "storage 7, 4096 B on cpu" in str(error) and "Fix:" in str(error)


def test_verified_copies_without_a_race_pass_and_keep_every_bit():
    engine = ScriptedCudaEngine()
    buffer, tensor = _buffer(engine, verify=True)
    buffer.start_d2h()
    buffer.release_device()
    buffer.start_h2d()
    buffer.wait_device()
    buffer.release_host()
    assert torch.equal(tensor, torch.arange(1024, dtype=torch.float32))
    assert engine.sim.violations == []
