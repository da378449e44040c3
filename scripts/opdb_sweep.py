"""Exactness over torch's op database: every autograd OpInfo sample through both doors.

``make sweep`` runs this with its defaults: each OpInfo of ``op_db`` that supports
autograd, in float32, complex64 and bfloat16 where its CPU forward and backward support
them, at most ``--max-samples`` samples per (op, dtype) (evenly spaced over the
OpInfo's list), each made a tiny module whose inputs are activations
(``tests/sweep/opdb.py``), judged bit for bit without and with hyper_offload at a budget
of 0 in the compile door (``aot_eager`` inside) and the eager door
(``tests/sweep/doors.py``). Prints one JSON line per (op, dtype, door) and writes the
summary (``tests/sweep/summary.py``) to ``--out``.

    .venv/bin/python scripts/opdb_sweep.py --ops 'mul,linalg.*' --door compile \\
        --dtype complex64 --max-samples 2 --out out/sweep-mul.json

Cases run in ``--jobs N`` worker processes on disjoint shares of the (op, dtype) pairs
(default 1); a case that kills its worker (a segfault) is recorded as failed and the
worker starts again after it.
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from tests.sweep.doors import DOORS, CaseResult, run_case, skipped_op  # noqa: E402
from tests.sweep.opdb import DTYPES, VARIANTS, autograd_ops, dtype_name, iter_cases  # noqa: E402
from tests.sweep.opdb import op_dtypes, op_key  # noqa: E402
from tests.sweep.summary import summarize  # noqa: E402

DEFAULT_MAX_SAMPLES = 2
MAX_CRASHES = 50
"""Worker deaths after which the sweep gives up (each is recorded as a failed case)."""


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--door", default=",".join(DOORS), help="compile, eager or both (comma-separated)")
    parser.add_argument("--dtype", default=",".join(dtype_name(d) for d in DTYPES),
                        help="float32, complex64, bfloat16 (comma-separated)")
    parser.add_argument("--ops", default="", help="fnmatch patterns on the op's name (comma-separated; default all)")
    parser.add_argument("--variant", default="function", help="function, inplace or both (comma-separated)")
    parser.add_argument("--max-samples", type=int, default=DEFAULT_MAX_SAMPLES,
                        help=f"samples per (op, dtype), evenly spaced (default {DEFAULT_MAX_SAMPLES}; 0: all)")
    parser.add_argument("--steps", type=int, default=2, help="steps per run (>= 2; default 2)")
    parser.add_argument("--out", default="out/sweep.json", help="where the JSON summary goes")
    parser.add_argument("--records", default="",
                        help="where every case's result goes, one JSON line each "
                             "(default: --out with the suffix -cases.jsonl)")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    parser.add_argument("--shard", default="0/1", help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.doors = [d for d in args.door.split(",") if d]
    args.dtypes = [getattr(torch, d) for d in args.dtype.split(",") if d]
    args.variants = [v for v in args.variant.split(",") if v]
    bad = [d for d in args.doors if d not in DOORS] + [v for v in args.variants if v not in VARIANTS]
    if bad or any(d not in DTYPES for d in args.dtypes) or args.steps < 2:
        parser.error(f"unknown door/variant/dtype or steps < 2: {bad or args.dtype}")
    return args


def _line(results: Sequence[CaseResult]) -> dict[str, Any]:
    """The JSON line for one (op, dtype, door): counts and time."""
    first = results[0]
    return {
        "op": first.op, "variant": first.variant, "dtype": first.dtype, "door": first.door,
        "samples": sum(1 for r in results if r.sample >= 0),
        "passed": sum(1 for r in results if r.status == "passed"),
        "moved": sum(1 for r in results if r.moved),
        "skipped": dict(Counter(r.skip for r in results if r.skip)),
        "failed": [r.sample for r in results if r.status == "failed"],
        "moved_bytes": sum(r.moved_bytes for r in results),
        "seconds": round(sum(r.seconds for r in results), 3),
    }


def _key(record: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(record[k] for k in ("op", "variant", "dtype", "sample", "door"))


def _read(records: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in records.read_text().splitlines()] if records.exists() else []


def _run_share(args: argparse.Namespace, ops: Sequence[Any], records: Path) -> None:
    """This worker's share of the (op, dtype) pairs, every door: each result is appended
    to ``records`` as it comes (cases already there are not run again), and the case
    about to run is named in ``records.running`` first, so a crash loses nothing but
    that case, which the parent records as failed. Prints one line per (op, dtype, door)."""
    index, count = (int(x) for x in args.shard.split("/"))
    done = {_key(r) for r in _read(records)}
    running = records.with_suffix(".running")
    pair = -1
    with records.open("a") as out:
        for variant in args.variants:
            for op, dtype, cases in iter_cases(ops, args.dtypes, args.max_samples, variant):
                pair += 1
                if pair % count != index:
                    continue
                for door in args.doors:
                    results = []
                    for case in [cases] if isinstance(cases, Exception) else cases:
                        if isinstance(case, Exception):
                            result = skipped_op(op, dtype, variant, door, case)
                        else:
                            who = CaseResult(op_key(op), variant, dtype_name(dtype), case.index, door)
                            if _key(who.record()) in done:
                                continue
                            running.write_text(json.dumps(who.record()))
                            result = run_case(case, door, args.steps)
                        out.write(json.dumps(result.record()) + "\n")
                        out.flush()
                        results.append(result)
                    if results:
                        print(json.dumps(_line(results)), flush=True)
    running.unlink(missing_ok=True)


def _crash_record(records: Path, code: int) -> None:
    """Record the case a worker died in (``records.running``) as failed."""
    running = records.with_suffix(".running")
    case = json.loads(running.read_text())
    how = f"signal {-code}" if code < 0 else f"exit code {code}"
    case.update(status="failed", detail=f"the process died ({how}) while running this case")
    with records.open("a") as out:
        out.write(json.dumps(case) + "\n")
    running.unlink()
    print(json.dumps({"crashed": _key(case), "how": how}), flush=True)


def _run_workers(args: argparse.Namespace, argv: Sequence[str]) -> list[CaseResult]:
    """``--jobs`` worker processes, each a share; a worker that dies (a segfault in a
    case) has that case recorded as failed and is started again where it stopped."""
    with tempfile.TemporaryDirectory() as folder:
        shares = [Path(folder) / f"share{i}.jsonl" for i in range(args.jobs)]

        def start(i: int) -> subprocess.Popen[bytes]:
            return subprocess.Popen([sys.executable, __file__, *argv, "--worker",
                                     "--shard", f"{i}/{args.jobs}", "--records", str(shares[i])])

        workers = {i: start(i) for i in range(args.jobs)}
        crashes = 0
        while workers:
            time.sleep(0.5)
            for i, worker in list(workers.items()):
                code = worker.poll()
                if code is None:
                    continue
                del workers[i]
                if code != 0:
                    crashes += 1
                    if crashes > MAX_CRASHES or not shares[i].with_suffix(".running").exists():
                        raise SystemExit(f"opdb_sweep: worker {i} failed (exit code {code})")
                    _crash_record(shares[i], code)
                    workers[i] = start(i)
        return [CaseResult(**r) for share in shares for r in _read(share)]


def _children_cpu() -> float:
    """CPU seconds of the finished worker processes (0 without ``--jobs``)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse(argv)
    warnings.simplefilter("ignore")  # budget-0 warnings on every case; results say it all
    logging.getLogger("hyper_offload").setLevel(logging.ERROR)
    logging.getLogger("torch._dynamo").setLevel(logging.ERROR)
    patterns = [p for p in args.ops.split(",") if p]
    ops, op_db_size = autograd_ops(patterns)
    started, cpu_started = time.perf_counter(), time.process_time()
    out = Path(args.out)
    if args.worker:
        _run_share(args, ops, Path(args.records))
        return 0
    results = _run_workers(args, argv)
    records = Path(args.records or out.with_name(out.stem + "-cases.jsonl"))
    records.parent.mkdir(parents=True, exist_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    records.write_text("".join(json.dumps(r.record()) + "\n" for r in results))
    config = {
        "doors": args.doors, "dtypes": [dtype_name(d) for d in args.dtypes],
        "variants": args.variants, "max_samples": args.max_samples, "steps": args.steps,
        "ops_filter": patterns, "torch": torch.__version__,
        "seconds": round(time.perf_counter() - started, 1), "jobs": args.jobs,
        "cpu_seconds": round(time.process_time() - cpu_started + _children_cpu(), 1),
    }
    if "function" not in args.variants:  # only ops with an in-place variant can run
        ops = [op for op in ops if op.inplace_variant is not None]
    no_dtype = [op_key(op) for op in ops if not op_dtypes(op, args.dtypes)]
    summary = summarize(results, op_db_size=op_db_size, autograd_ops=[op_key(op) for op in ops],
                        no_dtype=no_dtype, config=config)
    out.write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({"summary": str(out), **{d: s["totals"] for d, s in summary["doors"].items()}}))
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
