"""``hyper-offload pp-order``: in-process through ``hyper_offload.cli.main()``, plus one subprocess."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace
import subprocess
import sys
from pathlib import Path

import pytest

from hyper_offload.cli import main
from hyper_offload.passes.pipeline.build import build_rank_orders
from hyper_offload.passes.pipeline.check_order import check_order
from hyper_offload.passes.pipeline.meta_step import MetaStep, StepKind
from hyper_offload.passes.pipeline.swap import find_swap_chunks, strip_swap_steps

MIB = 1 << 20


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["pp-order", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    code, out, err = run_cli(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


@pytest.mark.parametrize(
    "argv",
    [
        ["--schedule", "gpipe", "--ranks", "4", "--microbatches", "8", "--swap"],
        ["--schedule", "interleaved-1f1b", "--ranks", "4", "--stages-per-rank", "2", "--microbatches", "8",
         "--swap", "--fsdp", "--transport", "batch"],
        ["--schedule", "zbv", "--ranks", "2", "--microbatches", "4", "--swap", "--min-gap", "2"],
        ["--schedule", "dualpipev", "--ranks", "2", "--microbatches", "4", "--swap", "--dxdw"],
        ["--schedule", "1f1b", "--ranks", "3", "--microbatches", "6", "--overlap"],
    ],
)
def test_json_steps_round_trip_and_equal_the_library_orders(capsys, argv: list[str]) -> None:
    result = run_json(capsys, *argv)
    options = {flag: value for flag, value in zip(argv, argv[1:]) if flag.startswith("--") and not value.startswith("--")}
    assert result["schedule"] == options["--schedule"]
    expected = build_rank_orders(
        options["--schedule"],
        num_ranks=int(options["--ranks"]),
        stages_per_rank=int(options.get("--stages-per-rank", "2" if options["--schedule"] in ("zbv", "dualpipev") else "1")),
        num_microbatches=int(options["--microbatches"]),
        fsdp="--fsdp" in argv,
        transport=options.get("--transport", "plain"),
        swap="--swap" in argv,
        min_gap=int(options.get("--min-gap", "4")),
        dxdw_split="--dxdw" in argv,
        overlap="--overlap" in argv,
    )
    assert sorted(result["orders"], key=int) == [str(r) for r in sorted(expected)]
    for rank, steps in result["orders"].items():
        parsed = [MetaStep.from_str(text) for text in steps]
        assert [repr(step) for step in parsed] == steps
        assert parsed == expected[int(rank)]


def test_rank_filters_json_and_text(capsys) -> None:
    argv = ["--schedule", "gpipe", "--ranks", "4", "--microbatches", "8", "--swap", "--rank", "2"]
    result = run_json(capsys, *argv)
    assert list(result["orders"]) == ["2"] and list(result["peaks"]) == ["2"]
    assert all(MetaStep.from_str(s).stage in (2, None) for s in result["orders"]["2"])
    code, out, _ = run_cli(capsys, *argv)
    assert code == 0
    assert re.findall(r"^rank (\d+)", out, flags=re.M) == ["2"]


@pytest.mark.parametrize(
    "argv, options",
    [
        (["--swap", "--min-gap", "2", "--rank", "0"], {"swap": True, "min_gap": 2}),
        # rank 1 starts with steps before its first compute slot: UNSHARD and a batched recv
        (["--fsdp", "--transport", "batch", "--rank", "1"], {"fsdp": True, "transport": "batch"}),
    ],
)
def test_text_prints_one_line_per_compute_slot_with_its_tail(capsys, argv: list[str], options: dict) -> None:
    code, out, _ = run_cli(capsys, "--schedule", "gpipe", "--ranks", "2", "--microbatches", "4", *argv)
    assert code == 0
    rank = int(argv[-1])
    order = build_rank_orders("gpipe", num_ranks=2, stages_per_rank=1, num_microbatches=4, **options)[rank]
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["slot", "compute"])
    summary = ("  swapped", "  cost-aware", "  kept")  # the lines after the order
    rows = [line.split() for line in lines[header + 1 :] if line.strip() and not line.startswith(summary)]
    numbered = [row for row in rows if row[0].isdigit()]
    computes = [s for s in order if s.is_compute_slot]
    assert [int(row[0]) for row in numbered] == list(range(len(computes)))
    assert [row[1] for row in numbered] == [repr(s) for s in computes]
    # every step of the order is printed once, in order: a compute, then what follows it
    printed = [word for row in rows for word in (row[1:] if row[0].isdigit() else row)]
    assert printed == [repr(s) for s in order]


def test_swap_reports_the_peak_drop(capsys) -> None:
    result = run_json(capsys, "--schedule", "gpipe", "--ranks", "4", "--microbatches", "8", "--swap")
    for rank, peak in result["peaks"].items():
        order = [MetaStep.from_str(s) for s in result["orders"][rank]]
        assert peak["unit"] == "chunks"
        assert peak["without"] == 8  # GPipe holds every micro-batch before the first backward
        # With swap the peak is at F7: chunk 7 (just computed), chunk 6 (its offload is waited
        # only after the next slot) and chunk 0 (loaded back before F7, the slot ahead of B0).
        assert peak["with"] == 3
        assert peak["swapped"] == peak["eligible"] == 8
        assert check_order(order, rank=int(rank), reference=strip_swap_steps(order)) == []
    code, out, _ = run_cli(capsys, "--schedule", "gpipe", "--ranks", "4", "--microbatches", "8", "--swap",
                           "--activation-mb", "100")
    assert code == 0
    assert "predicted peak 800.0 MiB -> " in out


def test_cost_aware_swaps_a_subset_and_explains_the_rest(capsys) -> None:
    argv = ["--schedule", "gpipe", "--ranks", "4", "--microbatches", "8", "--cost-aware", "--activation-mb", "100"]
    result = run_json(capsys, *argv)
    assert result["swap"] == "cost-aware"
    for rank, steps in result["orders"].items():
        order = [MetaStep.from_str(s) for s in steps]
        chosen = {tuple(key) for key in result["cost"][rank]["chosen"]}
        swapped = {s.chunk for s in order if s.kind is StepKind.SWAP_LAUNCH_OFFLOAD}
        eligible = {c.key for c in find_swap_chunks(strip_swap_steps(order)) if c.eligible}
        assert swapped == chosen and 0 < len(chosen) < len(eligible)
        reasons = {(r["stage"], r["micro"]): r["reason"] for r in result["cost"][rank]["rejected"]}
        assert set(reasons) == eligible - chosen and set(reasons.values()) == {"NOT_AT_PEAK"}
        peak = result["peaks"][rank]
        assert peak["unit"] == "bytes" and peak["with"] < peak["without"] == 8 * 100 * MIB
    # a link too slow for any window: nothing is swapped and the order equals the plain one
    slow = run_json(capsys, *argv, "--d2h-gbps", "0.5")
    plain = run_json(capsys, *argv[:-3])
    assert slow["orders"] == plain["orders"]
    assert {r["reason"] for r in slow["cost"]["0"]["rejected"]} == {"OFFLOAD_WINDOW_TOO_SHORT"}
    code, out, _ = run_cli(capsys, *argv, "--rank", "0")
    assert code == 0 and "kept resident: NOT_AT_PEAK 0:0 0:7" in out


def test_plot_writes_a_png(capsys, tmp_path: Path) -> None:
    target = tmp_path / "gpipe.png"
    code, out, err = run_cli(capsys, "--schedule", "gpipe", "--ranks", "2", "--microbatches", "4", "--swap",
                             "--min-gap", "2", "--plot", str(target), "--json")
    assert code == 0
    json.loads(out)  # the notice goes to stderr, stdout stays one JSON object
    assert str(target) in err
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--schedule", "zbv", "--ranks", "4", "--stages-per-rank", "1", "--microbatches", "8"], "needs stages_per_rank=2"),
        (["--schedule", "gpipe", "--ranks", "4", "--microbatches", "-1"], "--microbatches must be >= 1, got -1"),
        (["--schedule", "gpipe", "--ranks", "0", "--microbatches", "4"], "--ranks must be >= 1"),
        (["--schedule", "gpipe", "--ranks", "2", "--microbatches", "4", "--rank", "2"], "expected 0..1"),
        (["--schedule", "gpipe", "--ranks", "2", "--microbatches", "4", "--swap", "--min-gap", "1"], "--min-gap must be >= 2"),
        (["--schedule", "gpipe", "--ranks", "2", "--microbatches", "4", "--d2h-gbps", "5"], "only apply with --cost-aware"),
        (["--schedule", "gpipe", "--ranks", "2", "--microbatches", "4", "--cost-aware"], "needs --activation-mb"),
        (["--schedule", "gpipe", "--ranks", "2", "--microbatches", "4", "--cost-aware", "--activation-mb", "1",
          "--h2d-gbps", "0"], "--h2d-gbps must be > 0"),
        (["--schedule", "dualpipev", "--ranks", "4", "--microbatches", "2"], "dualpipev"),
        (["--schedule", "zbv", "--ranks", "2", "--microbatches", "4", "--swap", "--send-mb", "1"],
         "--send-mb needs --activation-mb"),
        (["--schedule", "zbv", "--ranks", "2", "--microbatches", "4", "--swap", "--activation-mb", "1",
          "--send-mb", "-1"], "--send-mb must be >= 0, got -1"),
        (["--schedule", "gpipe", "--ranks", "2", "--microbatches", "2", "--plot", "/nonexistent-dir/x.png"],
         "cannot write /nonexistent-dir/x.png"),
    ],
)
def test_bad_input_exits_2_with_one_line(capsys, argv: list[str], message: str) -> None:
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("hyper-offload pp-order: error: ")
    assert message in lines[0]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--schedule", "pipedream", "--ranks", "2", "--microbatches", "2"], "argument --schedule: invalid choice"),
        (["--schedule", "gpipe", "--ranks", "two", "--microbatches", "2"], "argument --ranks: invalid int value"),
        (["--schedule", "gpipe", "--ranks", "2"], "the following arguments are required: --microbatches"),
    ],
)
def test_malformed_arguments_are_argparse_errors_without_traceback(capsys, argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["pp-order", *argv])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.splitlines()[-1].startswith("hyper-offload pp-order: error: ")
    assert message in err.splitlines()[-1]


def test_missing_matplotlib_is_a_one_line_error(capsys, monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code, _, err = run_cli(capsys, "--schedule", "gpipe", "--ranks", "2", "--microbatches", "2",
                           "--plot", str(tmp_path / "x.png"))
    assert code == 2 and len(err.splitlines()) == 1
    assert "pip install hyper-offload[plot]" in err


def test_module_entry_point_runs_in_a_subprocess() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "hyper_offload", "pp-order", "--schedule", "1f1b", "--ranks", "2",
         "--microbatches", "4", "--swap", "--min-gap", "2", "--json"],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert set(result["orders"]) == {"0", "1"}
    assert any("SWAP_WAIT_LOAD" in step for step in result["orders"]["0"])


def test_order_rejected_by_check_order_exits_3_and_still_prints(capsys, monkeypatch) -> None:
    # The passes and the validator disagree only through a bug; the CLI must say so loudly.
    from hyper_offload.cli import pp_order as cli_pp_order
    from hyper_offload.passes.pipeline.check_order import OrderRule, OrderViolation

    def reject_rank_1(order, *, rank, **kwargs):
        return [OrderViolation(rank, 3, 1, 0, OrderRule.MISSING_SWAP_STEP, "made up")] if rank == 1 else []

    monkeypatch.setattr(cli_pp_order, "check_order", reject_rank_1)
    code, out, err = run_cli(capsys, "--schedule", "gpipe", "--ranks", "2", "--microbatches", "6", "--swap", "--json")
    assert code == 3
    assert set(json.loads(out)["orders"]) == {"0", "1"}  # the order is still shown, for the bug report
    assert len(err.splitlines()) == 1
    assert "rank 1, step 3 (stage 1, micro 0): [missing-swap-step]" in err and "this is a bug" in err


def test_zero_bubble_orders_swap_the_dw_state_and_the_peak_counts_it(capsys) -> None:
    argv = ["--schedule", "zbv", "--ranks", "4", "--stages-per-rank", "2", "--microbatches", "8", "--swap"]
    result = run_json(capsys, *argv)
    for rank, peak in result["peaks"].items():
        steps = result["orders"][rank]
        assert peak["weight_swapped"] == sum("DW_LAUNCH_OFFLOAD" in s for s in steps) == peak["weight_eligible"]
    assert any(p["weight_swapped"] for p in result["peaks"].values())
    # The reported peak counts the dW swap: it is what the model gives with it, lower than
    # without it on some rank (same sizes: one unit of dW state per chunk).
    from hyper_offload.passes.pipeline import StageFootprint, StageFootprints
    from hyper_offload.passes.pipeline.residency import peak_bytes

    sizes = StageFootprints(default=StageFootprint(activations=1, weight_state=1))
    lowered = []
    for rank, peak in result["peaks"].items():
        order = [MetaStep.from_str(s) for s in result["orders"][rank]]
        assert peak["with"] == peak_bytes(order, sizes)
        lowered.append(peak["with"] < peak_bytes(order, sizes, weight_swapped=()))
    assert any(lowered)
    code, out, _ = run_cli(capsys, *argv[:-1], "--cost-aware", "--activation-mb", "100")
    assert code == 0 and "dW state swapped (stage:micro)" in out


def test_sized_sends_count_in_the_peak_and_leave_once_proven_received(capsys) -> None:
    argv = ["--schedule", "zbv", "--ranks", "4", "--microbatches", "8", "--swap", "--activation-mb", "2",
            "--weight-state-mb", "3"]
    unsent = run_json(capsys, *argv)["peaks"]
    released = run_json(capsys, *argv, "--send-mb", "0.25")["peaks"]
    at_end = run_json(capsys, *argv, "--send-mb", "0.25", "--wait-sends-at-end")["peaks"]
    assert run_json(capsys, *argv, "--wait-sends-at-end")["peaks"] == unsent  # no send sized: no change
    for rank in unsent:
        for key in ("without", "with"):
            # Sends cost memory; releasing them once proven costs less than holding them
            # to the end of the step.
            assert unsent[rank][key] < released[rank][key] <= at_end[rank][key], (rank, key)
    assert any(released[r]["with"] < at_end[r]["with"] for r in unsent)
    # The same figure as the residency model with send_releases over all ranks' orders.
    from hyper_offload.passes.pipeline import send_releases
    from hyper_offload.passes.pipeline.residency import peak_bytes
    from hyper_offload.cli.pp_order import _sizes

    result = run_json(capsys, *argv, "--send-mb", "0.25")
    orders = {int(r): [MetaStep.from_str(s) for s in steps] for r, steps in result["orders"].items()}
    args = SimpleNamespace(activation_mb=2, weight_state_mb=3, send_mb=0.25)
    sizes, releases = _sizes(args, orders), send_releases(orders)
    for rank, order in orders.items():
        assert released[str(rank)]["with"] == peak_bytes(order, sizes, releases=releases[rank])
