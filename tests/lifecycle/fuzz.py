"""How a door's lifecycle test runs: a deterministic subset under ``make test``, long
under ``make fuzz`` (``HYPER_OFFLOAD_FUZZ_EXAMPLES`` sequences per door, shared out over
the models, random seeds), appending what ran to ``out/fuzz-<door>.jsonl``."""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from .machine import EVENTS, DoorFactory, machine_for
from .models import MODELS

FUZZ = int(os.environ.get("HYPER_OFFLOAD_FUZZ_EXAMPLES", "0"))
"""Sequences per door in a long run (0: the deterministic subset of ``make test``)."""


def fuzz_settings(subset_examples: int, subset_steps: int) -> settings:
    """Hypothesis settings: the deterministic subset's size, or the long run's."""
    return settings(
        max_examples=-(-FUZZ // len(MODELS)) if FUZZ else subset_examples,
        stateful_step_count=25 if FUZZ else subset_steps,
        derandomize=not FUZZ,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


def run_and_record(door: DoorFactory, door_name: str, model: str, config: settings) -> None:
    """Run ``door``'s machine on ``model``; in a long run, append one JSON line per
    sequence as it ends (``out/fuzz-<door>-sequences.jsonl``: what an interrupted run
    ran) and one for the whole run (``out/fuzz-<door>.jsonl``)."""
    started = time.perf_counter()
    before = EVENTS.copy()
    machine = machine_for(door, model)
    if FUZZ:
        machine.on_sequence = staticmethod(_record_sequence)
    run_state_machine_as_test(machine, settings=config)
    if FUZZ:
        ran = EVENTS - before
        out = Path("out")
        out.mkdir(exist_ok=True)
        line = {"door": door_name, "model": model, "sequences": ran["sequences"],
                "events": sum(v for k, v in ran.items() if k not in ("sequences", "strict_mismatch")),
                "by_event": dict(sorted(ran.items())),
                "seconds": round(time.perf_counter() - started, 1)}
        with open(out / f"fuzz-{door_name}.jsonl", "a") as stream:
            stream.write(json.dumps(line) + "\n")


def _record_sequence(door: str, model: str, ran: Counter[str]) -> None:
    events = sum(v for k, v in ran.items() if k not in ("sequences", "strict_mismatch"))
    out = Path("out")
    out.mkdir(exist_ok=True)
    with open(out / f"fuzz-{door}-sequences.jsonl", "a") as stream:
        stream.write(json.dumps({"door": door, "model": model, "events": events,
                                 "time": round(time.time(), 1)}) + "\n")
