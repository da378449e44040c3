"""``CPU_SMOKE=1 bash scripts/gpu_check.sh``: the prepared GPU run's every stage on CPU at
tiny sizes (about 80 s on 2 cores), so that a broken stage, flag or summary shows in CI
and not first on a GPU machine. The stages are read from the script itself; each must be
recorded ``ok`` in ``summary.txt``, and the verify stage (issue 34) must report no
mismatch."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.sh"


def stages() -> list[str]:
    """The names of the script's ``stage NAME SECONDS ...`` calls, in order."""
    return re.findall(r"^stage (\w+) ", SCRIPT.read_text(), flags=re.MULTILINE)


def test_stage_names_are_read() -> None:
    assert stages()[:2] == ["gpu_tests", "gpu_tests_csan"] and "verify" in stages()


@pytest.mark.slow
def test_cpu_smoke_runs_every_stage_ok(tmp_path: Path) -> None:
    env = {**os.environ, "CPU_SMOKE": "1", "PY": sys.executable, "OUT": str(tmp_path)}
    done = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True,
                          timeout=600)
    summary_file = tmp_path / "summary.txt"
    summary = summary_file.read_text() if summary_file.exists() else "(no summary.txt)"
    context = (f"summary:\n{summary}\nstdout tail:\n{done.stdout[-3000:]}\n"
               f"stderr:\n{done.stderr[-2000:]}")
    assert done.returncode == 0, context
    for name in stages():
        ok = re.search(rf"^{name}\s+ok\s", summary, flags=re.MULTILINE)
        assert ok, f"stage {name}: {context}"
    assert "verify: no mismatch" in summary, context
    assert (tmp_path / "verify_eager.jsonl").read_text().count('"verify": true') >= 4
