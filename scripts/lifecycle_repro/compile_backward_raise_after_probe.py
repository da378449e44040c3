"""Lifecycle failure, compile door (open): host buffers stay in use after a backward that
raised, when an earlier step caught an op error.

Found by ``make fuzz`` (12-07, mlp and attention models; shrunk by hypothesis). The
sequence, at budget 0 (everything movable moves): one layer added, one step whose forward
probes an op that raises and catches it (a graph break: one more region), then a step
whose backward raises from a parameter's gradient hook (the user skips the batch). After
that failed step one invocation's ``CompiledFunctionBackward`` stays alive, no Python
object reaches it and a collection does not free it, and it holds 7 host buffers
(7,168 B) that the runtime never gets back. Without the caught op error, or as a plain
script outside the harness, every buffer comes back: what holds the node is not known yet.
Exits 1 while buffers stay in use.

    PYTHONPATH=. .venv/bin/python scripts/lifecycle_repro/compile_backward_raise_after_probe.py
"""

from __future__ import annotations

import gc
import logging
import sys
import warnings

from tests.lifecycle.doors import CompileDoor
from tests.lifecycle.harness import Interrupt
from tests.lifecycle.machine import machine_for


def main() -> int:
    logging.getLogger("hyper_offload").setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    state = machine_for(CompileDoor, "mlp")()
    state.setup(budget=0.0, fraction_option=False, max_warmups=1, rewarm=False)
    state.add_layer()
    state.step_with_a_caught_op_error()
    try:
        state.step_that_raises(error=Interrupt, where="backward")
    except AssertionError as error:  # the harness's check of the host pool
        print(f"after the failed backward: {error}")
    gc.collect()
    runtime = state.door.backend.runtime
    runtime.collect()
    in_use = runtime.pool.stats().buffers_in_use
    recorder = state.door.backend.controller.recorder
    print(f"after a collection: {in_use} host buffer(s) in use; {recorder!r}")
    return 1 if in_use else 0


if __name__ == "__main__":
    sys.exit(main())
