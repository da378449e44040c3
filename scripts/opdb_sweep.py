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

``--jobs N`` runs N worker processes on disjoint shares of the (op, dtype) pairs and
merges their results (the machine's cores are shared: the default is 1).
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


def _run_share(args: argparse.Namespace, ops: Sequence[Any]) -> list[CaseResult]:
    """This process's share of the (op, dtype) pairs, every door; prints its lines."""
    index, count = (int(x) for x in args.shard.split("/"))
    results: list[CaseResult] = []
    pair = -1
    for variant in args.variants:
        for op, dtype, cases in iter_cases(ops, args.dtypes, args.max_samples, variant):
            pair += 1
            if pair % count != index:
                continue
            for door in args.doors:
                if isinstance(cases, Exception):
                    done = [skipped_op(op, dtype, variant, door, cases)]
                else:
                    done = [run_case(case, door, args.steps) for case in cases]
                if done:
                    print(json.dumps(_line(done)), flush=True)
                results += done
    return results


def _run_jobs(args: argparse.Namespace, argv: Sequence[str]) -> list[CaseResult]:
    """``--jobs`` workers, each a share; their results come back through files."""
    with tempfile.TemporaryDirectory() as folder:
        raws = [Path(folder) / f"share{i}.jsonl" for i in range(args.jobs)]
        workers = [
            subprocess.Popen([sys.executable, __file__, *argv, "--jobs", "1", "--worker",
                              "--shard", f"{i}/{args.jobs}", "--records", str(raw)])
            for i, raw in enumerate(raws)
        ]
        codes = [w.wait() for w in workers]
        if any(codes):
            raise SystemExit(f"opdb_sweep: a worker failed (exit codes {codes})")
        return [CaseResult(**json.loads(line)) for raw in raws for line in raw.read_text().splitlines()]


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
    if args.jobs > 1:
        results = _run_jobs(args, argv)
    else:
        results = _run_share(args, ops)
    out = Path(args.out)
    records = Path(args.records or out.with_name(out.stem + "-cases.jsonl"))
    records.parent.mkdir(parents=True, exist_ok=True)
    records.write_text("".join(json.dumps(r.record()) + "\n" for r in results))
    if args.worker:
        return 0
    config = {
        "doors": args.doors, "dtypes": [dtype_name(d) for d in args.dtypes],
        "variants": args.variants, "max_samples": args.max_samples, "steps": args.steps,
        "ops_filter": patterns, "torch": torch.__version__,
        "seconds": round(time.perf_counter() - started, 1), "jobs": args.jobs,
        "cpu_seconds": round(time.process_time() - cpu_started + _children_cpu(), 1),
    }
    no_dtype = [op_key(op) for op in ops if not op_dtypes(op, args.dtypes)]
    summary = summarize(results, op_db_size=op_db_size, autograd_ops=[op_key(op) for op in ops],
                        no_dtype=no_dtype, config=config)
    out.write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({"summary": str(out), **{d: s["totals"] for d, s in summary["doors"].items()}}))
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
