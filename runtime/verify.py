"""Transfer verification (``verify``): a checksum of every byte that leaves the device,
checked where those bytes come back and where the device copy is freed.

Three points, each on the stream that runs the library's work at that point:

* **At the D2H** (:func:`checksum` of the device bytes, enqueued on the compute stream
  right before the copy is issued): the copy stream waits for exactly that point of the
  compute stream before it reads, so the checksum sees the bytes the copy sees.
* **At the release of the device bytes**: the same checksum again. A difference means
  something wrote the storage after its D2H was issued (the write-after-copy race):
  the host copy holds either the old bytes or a torn mix of old and new.
* **At the reload**, once its wait has ordered the compute stream after the H2D and
  before anything reads the storage: a difference means the reload is not what left
  the device (a D2H that read freed or reused memory, a host buffer overwritten while
  in flight, a read that did not wait for its copy).

Why this checksum (two 64-bit words over the bytes as 64-bit words, with wrapping
integer arithmetic, so every order of reduction gives the same bits: deterministic on
any device):

* ``total`` = the sum of all words. Any difference confined to one word changes it, and
  so does any stale or torn copy whose wrong words do not happen to sum to the right
  ones modulo 2^64.
* ``weighted`` = the sum over blocks of ``(block index + 1) x (block sum)``. A copy that
  holds the right words in the wrong places (a block copied to another offset, a buffer
  of the right bytes in another order) keeps ``total`` and changes ``weighted``.

Every byte is covered (a tail shorter than a word is summed byte by byte with its own
weights). It costs one read of the bytes per check and two small reductions, with no
temporary as large as the data.
"""

from __future__ import annotations

import torch

from hyper_offload.errors import ConfigurationError, ConfigurationTypeError, TransferIntegrityError
from hyper_offload.passes.ir.properties import TensorProperties

__all__ = [
    "BLOCK_WORDS", "VerifySteps", "checksum", "dense_bytes", "integrity_error",
    "require_checksum", "require_properties", "same_checksum", "verify_steps",
]

BLOCK_WORDS = 1 << 12
"""Words per block of the position-weighted word (32 KiB of data)."""


def checksum(data: torch.Tensor) -> torch.Tensor:
    """Two int64 words (``total``, ``weighted``) over every byte of ``data``, a flat
    uint8 tensor, on ``data``'s device (no host synchronization)."""
    if data.dtype != torch.uint8 or data.dim() != 1:
        raise ConfigurationTypeError(f"checksum: expected a flat uint8 tensor, got {data.dtype} {data.shape}")
    whole = data.numel() // 8 * 8
    words = data[:whole].view(torch.int64) if data.storage_offset() % 8 == 0 else \
        data[:whole].clone().view(torch.int64)
    full = words.numel() // BLOCK_WORDS * BLOCK_WORDS
    block_sums = words[:full].view(-1, BLOCK_WORDS).sum(dim=1)
    tail = words[full:].sum().reshape(1)
    sums = torch.cat([block_sums, tail])
    weights = torch.arange(1, sums.numel() + 1, device=data.device, dtype=torch.int64)
    total = sums.sum()
    weighted = (sums * weights).sum()
    if whole < data.numel():  # the last bytes, each weighted by its position in the tail
        rest = data[whole:].to(torch.int64)
        positions = torch.arange(1, rest.numel() + 1, device=data.device, dtype=torch.int64)
        total = total + rest.sum()
        weighted = weighted + (rest * positions).sum() * (sums.numel() + 1)
    return torch.stack([total, weighted])


def same_checksum(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two checksums agree (reads them back: one host synchronization)."""
    return bool(torch.equal(a, b))


def dense_bytes(
    tensor: torch.Tensor, shape: tuple[int, ...], stride: tuple[int, ...]
) -> torch.Tensor:
    """The bytes of ``tensor`` laid out as the dense ``shape``/``stride`` (what a copy into
    that layout writes), as a flat uint8 tensor. A view of ``tensor``'s own bytes when it
    already has that layout (the usual case: the lowering copies a value in the layout
    its producer gave it), else a copy made on ``tensor``'s device and stream."""
    nbytes = tensor.numel() * tensor.element_size()
    flat = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    if tuple(tensor.shape) != tuple(shape) or (
            tensor.numel() > 1 and tuple(tensor.stride()) != tuple(stride)):
        tensor = torch.empty_strided(shape, stride, dtype=tensor.dtype,
                                     device=tensor.device).copy_(tensor)
    offset = tensor.storage_offset() * tensor.element_size()
    return flat.set_(tensor.untyped_storage(), offset, (nbytes,), (1,))


def require_checksum(
    data: torch.Tensor, sent: torch.Tensor, check: str, subject: str, what: str, where: str = ""
) -> None:
    """Raise :func:`integrity_error` unless flat uint8 ``data`` has checksum ``sent``
    (one host synchronization)."""
    if not same_checksum(checksum(data), sent):
        raise integrity_error(check, subject, what, where)


def require_properties(
    data: torch.Tensor, sent: TensorProperties, subject: str, where: str = ""
) -> None:
    """Raise :func:`integrity_error` unless the reload ``data`` has the properties
    ``sent`` of what left (no host synchronization: metadata only)."""
    differences = sent.differences(TensorProperties.of(data))
    if differences:
        raise integrity_error(
            "reload metadata", subject,
            f"the reload is another tensor than what left ({'; '.join(differences)}; "
            "left != reloaded)", where,
            cause="A host copy handed to another reload, or a copy into another layout",
        )


_RACE = (
    "A copy-stream race (a skipped wait, a release before its D2H completed, a host buffer "
    "reused while its H2D was in flight, or a write after the copy was issued)"
)


def integrity_error(
    check: str, subject: str, what: str, where: str = "", *, cause: str = _RACE
) -> TransferIntegrityError:
    """The error of a failed ``check`` ("reload", "write after copy", "reload metadata")
    on ``subject`` (the storage, its size and device): ``what`` differs, found ``where``
    (door, region, op), most likely because of ``cause``."""
    place = f"{where}: " if where else ""
    return TransferIntegrityError(
        f"verify ({check}): {place}{subject}: {what}. {cause}: the values this step "
        "computes from it are wrong. Fix: do not trust this step; report it with this "
        "message (the run without offload is exact)",
        check=check, where=where,
    )


def verify_steps(verify: bool | str) -> int | None:
    """How many steps ``verify`` checks: 0 (off), N (``"first_steps:N"``) or None (every
    step). Raises ``ConfigurationError`` naming the accepted forms for anything else."""
    if verify is False:
        return 0
    if verify is True:
        return None
    if not isinstance(verify, str):  # 1, 0, None: bool(...) would hide a typo in a flag
        raise ConfigurationTypeError(
            f"verify: expected True, False or 'first_steps:N' with N >= 1, got "
            f"{type(verify).__name__} {verify!r}"
        )
    if isinstance(verify, str) and verify.startswith("first_steps:"):
        count = verify.removeprefix("first_steps:")
        if count.isdigit() and int(count) > 0:
            return int(count)
    raise ConfigurationError(
        f"verify: expected True, False or 'first_steps:N' with N >= 1, got {verify!r}"
    )


class VerifySteps:
    """Which steps a door checks, for ``verify`` (``True``, ``False``, ``"first_steps:N"``):
    the door asks :attr:`next_step` before a step and reports it with :meth:`step_done`."""

    def __init__(self, verify: bool | str) -> None:
        self.limit = verify_steps(verify)
        """Steps to check: 0 (off), N, or None (every step)."""
        self.verified = 0
        """Steps checked so far."""

    @property
    def next_step(self) -> bool:
        """Whether the next step is checked."""
        return self.limit is None or self.verified < self.limit

    def step_done(self, verified: bool) -> None:
        """A step ended; ``verified``: whether its transfers were checked."""
        self.verified += verified
