"""Run code in a fresh interpreter: import effects (what a module loads, which kernels it
registers) are process-wide, so tests of them cannot share the test session's process."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

#: Python source of a sorted list of the loaded ``hyper_offload.runtime`` modules.
RUNTIME_LOADED = (
    "sorted(m for m in sys.modules if m == 'hyper_offload.runtime'"
    " or m.startswith('hyper_offload.runtime.'))"
)


def fresh_json(code: str) -> dict[str, object]:
    """Run ``code`` in a new interpreter with ``-W error`` (an import that warns, e.g. a
    kernel overridden in place, fails too); ``code`` prints one JSON object last."""
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", textwrap.dedent(code)],
        cwd=REPO, capture_output=True, text=True, timeout=180,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])
