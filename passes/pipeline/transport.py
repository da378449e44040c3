"""P2P transport pass: how the P2P leaves of an order are issued.

* ``plain``    — unchanged: one isend / irecv per leaf.
* ``batch``    — every maximal run of adjacent P2P leaves becomes one ``BATCH_SEND_RECV``
  container (one ``batch_isend_irecv``), a run of one included.
* ``boundary`` — all P2P leaves between two consecutive compute slots (and before the first
  / after the last) become one ``BATCH_SEND_RECV`` at the place of the first of them, even
  when FSDP steps sit between them: one fused exchange per compute boundary.

In every mode the sequence of P2P leaves (flattened, in order) is unchanged, and no
non-P2P step enters a container.
"""

from __future__ import annotations

from collections.abc import Sequence

from hyper_offload.errors import ConfigurationError

from .meta_step import P2P_KINDS, MetaStep, StepKind

TRANSPORTS = ("plain", "batch", "boundary")


def rewrite_transport(order: Sequence[MetaStep], transport: str = "plain") -> list[MetaStep]:
    """Return ``order`` with its P2P leaves issued the way ``transport`` says."""
    if transport not in TRANSPORTS:
        raise ConfigurationError(f"unknown transport {transport!r}; expected one of {', '.join(TRANSPORTS)}")
    for step in order:
        if step.kind is StepKind.BATCH_SEND_RECV or step.is_swap:
            raise ConfigurationError(
                f"rewrite_transport: order already holds {step!r}; the transport pass runs once, "
                "after the FSDP pass and before the swap pass"
            )
    if transport == "plain":
        return list(order)
    if transport == "batch":
        return _fuse_adjacent(order)
    return _fuse_per_boundary(order)


def _fuse_adjacent(order: Sequence[MetaStep]) -> list[MetaStep]:
    out: list[MetaStep] = []
    run: list[MetaStep] = []
    for step in order:
        if step.kind in P2P_KINDS:
            run.append(step)
            continue
        if run:
            out.append(MetaStep(StepKind.BATCH_SEND_RECV, None, None, tuple(run)))
            run = []
        out.append(step)
    if run:
        out.append(MetaStep(StepKind.BATCH_SEND_RECV, None, None, tuple(run)))
    return out


def _fuse_per_boundary(order: Sequence[MetaStep]) -> list[MetaStep]:
    out: list[MetaStep] = []
    segment: list[MetaStep] = []  # steps since the last compute slot

    def flush() -> None:
        p2p = tuple(s for s in segment if s.kind in P2P_KINDS)
        placed = False
        for s in segment:
            if s.kind in P2P_KINDS:
                if not placed:
                    out.append(MetaStep(StepKind.BATCH_SEND_RECV, None, None, p2p))
                    placed = True
            else:
                out.append(s)
        segment.clear()

    for step in order:
        if step.is_compute_slot:
            flush()
            out.append(step)
        else:
            segment.append(step)
    flush()
    return out
