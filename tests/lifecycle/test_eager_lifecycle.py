"""The eager door through random training-loop events against a plain twin (issue 49,
item 3): :mod:`.machine`'s state machine with :class:`~.doors.EagerDoor`.

``make test`` runs a deterministic subset (a few short sequences per model);
``make fuzz`` runs it long (:mod:`.fuzz`) and appends what it ran to
``out/fuzz-eager.jsonl``.
"""

from __future__ import annotations

import pytest

from .doors import EagerDoor
from .fuzz import fuzz_settings, run_and_record
from .models import MODELS

SETTINGS = fuzz_settings(subset_examples=3, subset_steps=8)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_eager_door_matches_its_twin_through_random_events(model: str) -> None:
    run_and_record(EagerDoor, "eager", model, SETTINGS)
