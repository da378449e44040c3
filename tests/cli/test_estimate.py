"""``hyper-offload estimate``: a 7B-wide Llama on meta without allocating, exit codes,
one-line errors. Runs in-process (the CLI's ``main``) to save the interpreter start."""

from __future__ import annotations

import json
import re
import resource
import sys
import threading
from pathlib import Path

import pytest
import torch

import hyper_offload
from hyper_offload.cli import main

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
MIB = 1 << 20

FACTORIES = '''
import torch
from torch import nn


def small():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16), nn.GELU())


def broken():
    raise RuntimeError("no weights here")


def frozen():
    return nn.Linear(16, 16).requires_grad_(False)


class TwoHalves(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
        self.second = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))

    def forward(self, x):
        x = self.first(x)
        torch._dynamo.graph_break()
        return self.second(x)


def two_halves():
    torch.manual_seed(0)
    return TwoHalves()
'''


def _rss_bytes() -> int:
    """Current resident set size (Linux /proc)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize()


class _PeakRss:
    """The largest RSS seen while the block runs, sampled every 5 ms by a thread
    (``ru_maxrss`` is the whole process's maximum, which earlier tests may have set)."""

    def __enter__(self) -> _PeakRss:
        self.before = self.peak = _rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _rss_bytes())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_bytes())

    @property
    def grown(self) -> int:
        return self.peak - self.before


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs Linux /proc")
def test_a_7b_wide_llama_on_meta_is_estimated_without_allocating(capsys) -> None:
    with _PeakRss() as rss:
        code = main([
            "estimate", str(EXAMPLES / "llama_model.py") + ":llama_7b_2_layers",
            "--input-shape", "1,4096", "--input-shape", "1,4096", "--input-dtype", "int64",
            "--budget-mb", "1024", "--json",
        ])
    grown = rss.grown
    result = json.loads(capsys.readouterr().out)
    parameters_bytes = 2 * (2 * 32000 * 4096 + 2 * (4 * 4096 * 4096 + 3 * 4096 * 11008))
    # Real tensors would take the parameters (1.3 GB bf16) plus the activations (2.6 GiB).
    assert grown < parameters_bytes / 3, f"RSS grew by {grown / MIB:.0f} MiB"
    assert result["peak_without_offload_bytes"] > 2 * 1024 * MIB
    assert result["min_feasible_budget_bytes"] > result["budget_bytes"] == 1024 * MIB
    assert code == 1 and result["fits"] is False  # infeasible: exit code 1, best plan reported
    assert result["peak_with_plan_bytes"] == result["min_feasible_budget_bytes"]
    assert result["bytes_d2h"] == result["bytes_h2d"] > 0
    assert result["fw_ops"] > 100 and result["device"] == "cpu"


@pytest.fixture
def factories(tmp_path: Path) -> Path:
    path = tmp_path / "my_models.py"
    path.write_text(FACTORIES)
    return path


def test_file_and_module_targets_give_the_python_apis_figures(factories, monkeypatch, capsys) -> None:
    args = ["--input-shape", "4,16", "--budget-fraction", "0.5", "--inner-compiler",
            "aot_eager", "--bandwidth-gbps", "4", "--json"]
    code_file = main(["estimate", f"{factories}:small", *args])
    by_file = json.loads(capsys.readouterr().out)
    monkeypatch.syspath_prepend(str(factories.parent))
    code_module = main(["estimate", "my_models:small", *args])
    by_module = json.loads(capsys.readouterr().out)
    assert code_file == code_module == (0 if by_file["fits"] else 1)
    sys.modules.pop("my_models", None)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16),
                                torch.nn.GELU())
    api = hyper_offload.estimate(model, (torch.randn(4, 16),), max_resident_activation_fraction=0.5,
                                 inner_compiler="aot_eager", bandwidth=4.0)
    for result in (by_file, by_module):
        for key in ("peak_without_offload_bytes", "peak_with_plan_bytes", "bytes_d2h",
                    "min_feasible_budget_bytes", "budget_bytes", "exposed_transfer_s"):
            assert result[key] == api.to_dict()[key], key
        assert result["d2h_bandwidth_gbps"] == 4.0 and result["bytes_d2h"] > 0


def test_human_summary_and_exit_code_0(factories, capsys) -> None:
    code = main(["estimate", f"{factories}:small", "--input-shape", "4,16", "--budget-mb", "64",
                 "--inner-compiler", "aot_eager", "--compute-tflops", "400", "--memory-gbps",
                 "3000"])
    out = capsys.readouterr().out
    assert code == 0
    assert "ops priced at 400 TFLOP/s, 3000 GB/s" in out
    assert out.splitlines()[0].startswith("Sequential on cpu (aot_eager graphs")
    assert "fits in a budget of 64.0 MiB" in out and "smallest feasible budget" in out


@pytest.mark.parametrize(
    ("target", "extra", "message"),
    [
        ("{f}", [], "is not MODULE:FACTORY"),
        ("{d}/missing.py:small", [], "no such file"),
        ("{f}:nope", [], "no callable 'nope'"),
        ("no_such_module_xyz:small", [], "cannot import no_such_module_xyz"),
        ("{f}:broken", [], "raised RuntimeError: no weights here"),
        ("{f}:frozen", [], "no backward"),
        ("{f}:small", ["--input-shape", "4,x"], "expected integers"),
        ("{f}:small", ["--input-dtype", "int99"], "not a torch dtype"),
        ("{f}:small", ["--input-dtype", "float32", "--input-dtype", "int64"], "one per input"),
        ("{f}:small", ["--input-shape", "4,17"], "a and b must have same reduction dim"),
        # Issue 45: a bad number names the flag the user typed, not the option behind it.
        ("{f}:small", ["--budget-mb", "-3"], "--budget-mb must be a finite number of MiB >= 0"),
        ("{f}:small", ["--budget-mb", "nan"], "--budget-mb must be"),
        ("{f}:small", ["--budget-fraction", "2"], "--budget-fraction must be a number in (0, 1]"),
        ("{f}:small", ["--bandwidth-gbps", "0"], "--bandwidth-gbps must be"),
        ("{f}:small", ["--host-budget-mb", "-1"], "--host-budget-mb must be a finite number"),
        ("{f}:small", ["--local-world-size", "0"], "--local-world-size must be a whole number"),
        ("{f}:small", ["--device", "meta"], "--device meta: cannot trace on the meta device"),
        ("{f}:small", ["--device", "nodevice"], "--device 'nodevice' is not a torch device"),
        ("{f}:small", ["--compute-tflops", "100"], "together"),
        ("{f}:small", ["--compute-tflops", "0", "--memory-gbps", "10"], "finite number > 0"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(factories, capsys, target, extra, message) -> None:
    argv = ["estimate", target.format(f=factories, d=factories.parent)]
    argv += extra if "--input-shape" in extra else ["--input-shape", "4,16", *extra]
    if not any(flag in extra for flag in ("--budget-mb", "--budget-fraction")):
        argv += ["--budget-mb", "1"]
    argv += ["--inner-compiler", "aot_eager"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("hyper-offload estimate: error: ") and message in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "max_resident_activation" not in err and "device=" not in err  # Python names


def test_host_budget_flag_reaches_the_step_plan(factories, capsys) -> None:
    # 95% of the peak without offload (425,984 B) is over the floor (393,216 B, the last
    # GELU's backward): the plan fits by moving bytes, when the host has room for them.
    base = ["estimate", f"{factories}:small", "--input-shape", "512,16", "--budget-fraction",
            "0.95", "--inner-compiler", "aot_eager", "--recompute", "off"]
    assert main([*base, "--json", "--host-budget-mb", "1024"]) == 0
    roomy = json.loads(capsys.readouterr().out)["step"]
    assert roomy["binding"] == "device" and roomy["moved_bytes"] > 0
    assert roomy["host_budget_bytes"] == 1024 * MIB
    # No host room: what the device budget would move stays on the device, over it.
    assert main([*base, "--host-budget-mb", "0"]) == 1
    out = capsys.readouterr().out
    assert "binding: host" in out and "--host-budget-mb" in out
    main([*base, "--json", "--host-budget-mb", "0"])
    tight = json.loads(capsys.readouterr().out)["step"]
    assert tight["peak_host_bytes"] == 0 and tight["moved_bytes"] == 0
    assert tight["predicted_peak_bytes"] > tight["budget_bytes"] >= tight["floor_peak_bytes"]


def test_recompute_flag_reaches_the_search(factories, capsys) -> None:
    base = ["estimate", f"{factories}:small", "--input-shape", "4,16", "--budget-fraction", "0.5",
            "--inner-compiler", "aot_eager", "--bandwidth-gbps", "0.001", "--json",
            "--budget-scope", "region"]
    main([*base, "--recompute", "off"])
    off = json.loads(capsys.readouterr().out)["recompute"]
    main(base)
    auto = json.loads(capsys.readouterr().out)["recompute"]
    assert off["mode"] == "off" and not off["searched"] and len(off["partitions"]) == 1
    # a link this slow stalls the offload-only plan: the default (auto) searches
    assert auto["mode"] == "auto" and auto["searched"] and len(auto["partitions"]) > 1
    assert auto["joint_s"] <= off["joint_s"]


def test_the_step_scope_sees_the_graph_break_the_region_scope_plans_across(
        factories, capsys) -> None:
    base = ["estimate", f"{factories}:two_halves", "--input-shape", "4,16", "--budget-fraction",
            "0.9", "--inner-compiler", "aot_eager", "--json"]
    assert main(base) == 0
    step = json.loads(capsys.readouterr().out)
    main([*base, "--budget-scope", "region"])
    region = json.loads(capsys.readouterr().out)
    assert step["budget_scope"] == "step" and region["budget_scope"] == "region"
    # Dynamo splits the step in two regions, as torch.compile would; one invocation each.
    assert step["regions"] == 2 and [i["region"] for i in step["invocations"]] == [0, 1]
    assert step["step"]["invocations"] == 2 and "invocations" not in region
    assert step["fits"] and step["bytes_d2h"] == sum(i["moved_bytes"] for i in step["invocations"])
    main([*base[:-1], "--budget-scope", "step"])  # the human summary
    text = capsys.readouterr().out
    assert "2 region(s), 2 invocation(s) per step" in text and "r1#0" in text


def test_a_model_that_fails_on_its_inputs_is_named_in_one_line(factories, capsys) -> None:
    """Issue 51: a 16-wide model given 17 features said "TorchRuntimeError: RuntimeError
    when making fake tensor call" (Dynamo's wrapper); the line names the op's own error
    (the shape mismatch) and the model's line where it broke."""
    argv = ["estimate", f"{factories}:small", "--input-shape", "4,17", "--budget-mb", "1",
            "--inner-compiler", "aot_eager"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "fails on --input-shape 4,17 (float32): RuntimeError: a and b must have same " \
           "reduction dim, but got [4, 17] X [16, 64]" in err
    assert "(at torch/nn/modules/linear.py:" in err and "F.linear(" in err
    assert "fake tensor call" not in err
    assert main([*argv, "--debug"]) == 2  # the whole chain first, then the same line
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0].startswith("Traceback") and "fake tensor call" in "\n".join(lines)
    assert lines[-1].startswith("hyper-offload estimate: error: one step of")


def test_no_torch_traceback_reaches_stderr_without_debug(factories) -> None:
    """torch's fake-tensor mode logs the failing op's traceback at ERROR before raising
    (20 lines in issue 51); a real process shows our one line only."""
    import subprocess

    done = subprocess.run(
        [sys.executable, "-m", "hyper_offload", "estimate", f"{factories}:small",
         "--input-shape", "4,17", "--budget-mb", "1", "--inner-compiler", "aot_eager"],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 2 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "a and b must have same reduction dim" in lines[0], done.stderr


def _shape(line: str) -> str:
    """A summary line up to its figures: numbers become N, an invocation row is its
    shape, and the floor lines keep only what they name first (the values at the floor
    are the model's own)."""
    line = re.sub(r"\d[\d,]*(?:\.\d+)?", "N", " ".join(line.split()))
    for lead in ("floor set by", "at the floor:"):
        if line.startswith(lead):
            return lead
    return line


def test_readme_sample_has_the_lines_the_command_prints_now(capsys) -> None:
    """Issue 51: README's sample of ``hyper-offload estimate ... llama_7b`` showed one
    region after the command began estimating the 32 blocks per block (3 regions, 34
    invocations). The 7B run takes 30-70 s here, so the sample is pasted from a real run
    and this test runs the same command on the 2-block Llama, also per block: every line
    the command prints has the sample's shape, and the other way round."""
    readme = (EXAMPLES.parent / "README.md").read_text()
    sample = next(block for block in re.findall(r"```text\n(.*?)```", readme, re.S)
                  if block.startswith("$ .venv/bin/hyper-offload estimate "))
    shown = {_shape(line) for line in sample.splitlines()[2:] if not line.startswith("[")}
    assert main(["estimate", f"{EXAMPLES / 'llama_model.py'}:llama_tiny", "--input-shape",
                 "1,64", "--input-shape", "1,64", "--input-dtype", "int64",
                 "--budget-fraction", "0.6", "--layout", "per_block"]) == 0
    printed = {_shape(line) for line in capsys.readouterr().out.splitlines()}
    assert printed == shown, (sorted(printed - shown), sorted(shown - printed))
