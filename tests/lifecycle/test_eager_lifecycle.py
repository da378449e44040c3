"""The eager door through random training-loop events against a plain twin (issue 49,
item 3): :mod:`.machine`'s state machine with :class:`~.doors.EagerDoor`.

``make test`` runs a deterministic subset (a few short sequences per model);
``make fuzz`` runs it long: ``HYPER_OFFLOAD_FUZZ_EXAMPLES`` sequences for the door, shared
out over the models, random seeds, and appends what it ran to ``out/fuzz-eager.jsonl``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from .doors import EagerDoor
from .machine import EVENTS, machine_for
from .models import MODELS

FUZZ = int(os.environ.get("HYPER_OFFLOAD_FUZZ_EXAMPLES", "0"))
"""Sequences for the door in a long run (0: the deterministic subset of ``make test``)."""

SETTINGS = settings(
    max_examples=-(-FUZZ // len(MODELS)) if FUZZ else 3,
    stateful_step_count=25 if FUZZ else 8,
    derandomize=not FUZZ,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_eager_door_matches_its_twin_through_random_events(model: str) -> None:
    started = time.perf_counter()
    before = EVENTS.copy()
    run_state_machine_as_test(machine_for(EagerDoor, model), settings=SETTINGS)
    if FUZZ:
        ran = EVENTS - before
        out = Path("out")
        out.mkdir(exist_ok=True)
        line = {"door": "eager", "model": model, "sequences": ran["sequences"],
                "events": sum(v for k, v in ran.items() if k not in ("sequences", "strict_mismatch")),
                "by_event": dict(sorted(ran.items())),
                "seconds": round(time.perf_counter() - started, 1)}
        with open(out / "fuzz-eager.jsonl", "a") as stream:
            stream.write(json.dumps(line) + "\n")
