#!/usr/bin/env python3
"""Plant known bugs one at a time and show that the tests guarding each one fail.

Every mutation below is a small deliberate bug in ``passes/``, ``runtime/`` or the CLI
that once went unnoticed (issue 7), or a rule the runtime hardening introduced. For each,
the script copies the package into a temporary directory (never touching this tree),
applies the one edit, and runs the named test files against the copy; a mutation is
CAUGHT when pytest fails. It first checks that the unmutated copy passes those tests and
that ``import hyper_offload`` really resolves to the copy.

    python scripts/mutation_check.py            # all mutations (a few minutes on 2 cores)
    python scripts/mutation_check.py --list
    python scripts/mutation_check.py --only wait_h2d-noop --only trim-keeps-reservation

Exit status: 0 when every mutation is caught, 1 when one survives (or breaks the code
in another way, e.g. an import error: ``BROKEN``), 2 when the baseline fails. One line
per mutation: ``CAUGHT``/``MISSED``/``BROKEN``, its name, and the first failing test.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Repository folder -> where it lives inside the installed package.
PACKAGE_DIRS = {"offload_compile": "hyper_offload", "passes": "hyper_offload/passes",
                "runtime": "hyper_offload/runtime"}
IGNORE = shutil.ignore_patterns("__pycache__", ".hypothesis", "*.pyc")


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str  # repository-relative source file
    old: str  # must occur exactly once
    new: str
    tests: tuple[str, ...]  # test files (or node ids) that must fail
    why: str


RT = "tests/runtime/"
COPY = RT + "test_copy_stream.py"
MUTATIONS = (
    Mutation("report-ok-forced-true", "passes/analysis/validator.py",
             "        return not self.violations", "        return True",
             ("tests/passes/analysis/test_validator.py", "tests/cli/test_plan.py"),
             "ScheduleReport.ok ignores violations; the plan CLI never exits 3"),
    Mutation("d2h-backward-zeros", "passes/ir/ops.py",
             "def _copy_d2h_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:\n"
             "    return grad.to(ctx.source_device), None, None",
             "def _copy_d2h_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:\n"
             "    return torch.zeros_like(grad).to(ctx.source_device), None, None",
             (RT + "test_ops.py",), "copy_d2h's backward returns zeros"),
    Mutation("h2d-backward-zeros", "passes/ir/ops.py",
             "def _copy_h2d_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:\n"
             "    return grad.to(ctx.source_device), None",
             "def _copy_h2d_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:\n"
             "    return torch.zeros_like(grad).to(ctx.source_device), None",
             (RT + "test_ops.py",), "copy_h2d's backward returns zeros"),
    Mutation("wait-backward-zeros", "passes/ir/ops.py",
             "        return grad, None", "        return torch.zeros_like(grad), None",
             (RT + "test_ops.py",), "wait_transfer's backward returns zeros"),
    Mutation("wait_h2d-noop", "runtime/residency.py",
             "        buffer.wait_device()", "        pass",
             (COPY, RT + "test_residency.py"), "ResidencyManager.wait_h2d does nothing"),
    Mutation("trim-keeps-reservation", "runtime/pinned_pool.py",
             "            self._held -= freed\n", "",
             (RT + "test_pinned_pool.py",), "trim() frees buffers but not the cap's room"),
    Mutation("refused-pin-keeps-reservation", "runtime/pinned_pool.py",
             "                self._held -= cost  # pinning failed: give the reservation back",
             "                pass",
             (RT + "test_pinned_pool.py",), "a refused pinning keeps its reservation"),
    Mutation("pinned-cost-exact-size", "runtime/pinned_pool.py",
             "        cost = pinned_cost(capacity) if self.pin else capacity\n"
             "        with self._lock:\n            self._reap_locked()\n            cached",
             "        cost = capacity\n"
             "        with self._lock:\n            self._reap_locked()\n            cached",
             (RT + "test_pinned_pool.py",), "the cap ignores torch's power-of-two pinning"),
    Mutation("eviction-keeps-host-cache", "runtime/pinned_pool.py",
             "                need -= evicted.cost\n                self._host_cache_dirty = self.pin\n",
             "                need -= evicted.cost\n",
             (RT + "test_pinned_pool.py",), "evicted pinned buffers stay in torch's host cache"),
    Mutation("pageable-fallback-silent", "runtime/pinned_pool.py",
             "        if warn:\n            warnings.warn(", "        if False:\n            warnings.warn(",
             (RT + "test_pinned_pool.py",), "pageable fallbacks are not warned about"),
    Mutation("host-ledger-ignores-budget", "passes/plan/host_budget.py",
             "        return self._tree.max(*extension) + size <= self.budget_bytes",
             "        return True",
             ("tests/passes/plan/test_host_budget.py",),
             "the planners plan more host bytes alive at once than the host budget"),
    Mutation("greedy-accepts-at-budget", "passes/plan/greedy.py",
             "subtract_if_over(cand.start + 1, cand.end, 0, -cand.size)",
             "subtract_if_over(cand.start + 1, cand.end, -1, -cand.size)",
             ("tests/passes/plan/test_greedy.py",),
             "a gap is accepted when its ops sit exactly at the budget"),
    Mutation("release-device-blocks-host", "runtime/physical_buffer.py",
             "                transfer.order_before_free()", "                transfer.synchronize()",
             (COPY,), "RELEASE_DEVICE synchronizes the host on pending copies"),
    Mutation("release-device-frees-under-h2d", "runtime/physical_buffer.py",
             "                transfer.order_before_free()", "                pass",
             (COPY,), "RELEASE_DEVICE frees bytes an unwaited H2D still writes"),
    Mutation("demand-paging-blocks-host", "runtime/physical_buffer.py",
             "            self.start_h2d()\n            self.wait_device()\n            return self.storage",
             "            self.start_h2d().synchronize()\n            return self.storage",
             (COPY,), "demand paging synchronizes the host"),
    Mutation("wait-is-no-stream-wait", "runtime/transfer.py",
             "        stream.wait_event(self.event)\n", "",
             (COPY, RT + "test_device.py"), "Transfer.wait orders nothing"),
    Mutation("no-record-stream-for-early-frees", "runtime/transfer.py",
             "recorded = free_before_wait and self._record_stream(device_side, stream)",
             "recorded = False",
             (COPY,), "a D2H freed before any wait is not protected"),
    Mutation("record-stream-always", "runtime/transfer.py",
             "recorded = free_before_wait and self._record_stream(device_side, stream)",
             "recorded = self._record_stream(device_side, stream)",
             (COPY, RT + "test_device.py"), "record_stream on every copy (deferred reuse)"),
    Mutation("ops-path-records-stream", "runtime/transfer_context.py",
             "            transfer = engine.d2h(src, host)\n",
             "            transfer = engine.d2h(src, host, free_before_wait=True)\n",
             (COPY,), "the transfer ops record_stream their sources (deferred reuse)"),
    Mutation("handle-drops-device-side", "runtime/transfer.py",
             "until_wait=() if recorded else (device_side,),", "until_wait=(),",
             (COPY,), "an unrecorded device side is not kept until the wait"),
    Mutation("pageable-copy-not-counted", "runtime/transfer.py",
             "            self.host_syncs.record(SyncReason.PAGEABLE_COPY)",
             "            pass", (COPY,), "copies through pageable memory are not counted"),
    Mutation("host-sync-counter-silent", "runtime/stats.py",
             "            self._counts[reason] = self._counts.get(reason, 0) + 1",
             "            pass", (COPY,), "the host-sync counter counts nothing"),
    Mutation("host-copy-death-keeps-buffer", "runtime/transfer_records.py",
             "                pool.release_soon(holder.pop())\n", "                pass\n",
             (RT + "test_ops.py", RT + "test_transfer_context.py"),
             "a dead host copy's buffer never goes back to the pool (issue 18, leaked buffers)"),
    Mutation("release-host-after-release-refused", "runtime/transfer_records.py",
             "            record.state = HostCopyState.RELEASED\n",
             "            if record.state is HostCopyState.RELEASED:\n"
             "                raise TransferMisuseError('already released')\n"
             "            record.state = HostCopyState.RELEASED\n",
             (RT + "test_ops_misuse.py", "tests/compiler/test_host_copy_lifetime.py"),
             "a retained graph's second backward fails (issue 18, double backward)"),
    Mutation("h2d-pending-holds-its-destination", "runtime/transfer_context.py",
             '"copy_h2d", transfer, host, device_tensor, host_key, expect=expect,\n',
             '"copy_h2d", transfer, host, device_tensor, host_key, expect=expect,\n'
             '                keep=(host, device_tensor),\n',
             (RT + "test_transfer_context.py",),
             "an unwaited prefetch keeps its device tensor and host copy alive"),
    Mutation("partitioner-uuid-per-region", "offload_compile/compiler/partitioner.py",
             "        return (self.request.planning_code, self.request.options.cache_key())",
             "        return (self.request.planning_code, self.request.options.cache_key(), id(self))",
             ("tests/compiler/test_warm_restart.py",),
             "no cache can serve a region (issue 18, warm restarts)"),
    Mutation("warmup-peak-ignores-step-end", "offload_compile/eager/warmup.py",
             "max(self.stats.peak_resident_bytes, trace.retained_bytes)",
             "max(self.stats.peak_resident_bytes, 0)",
             ("tests/eager/test_warmup.py",),
             "warmup reports a peak below what replay must reach (issue 18, point 3)"),
    Mutation("held-releases-latest-copy-first", "passes/plan/placement.py",
             "heapq.heappush(self.by_copy_end, (copy_end, storage))",
             "heapq.heappush(self.by_copy_end, (-copy_end, storage))",
             ("tests/passes/plan/test_release_delay.py",),
             "where room runs out, the release whose copy ends last is issued first"),
    Mutation("reloads-issued-out-of-wait-order", "passes/plan/placement.py",
             "max(release_op + 1, op_limit(earliest_op, storage, 0), previous_start)",
             "max(release_op + 1, op_limit(earliest_op, storage, 0))",
             ("tests/passes/plan/test_prefetch.py",),
             "a later-waited reload may start before an earlier one"),
    Mutation("reloads-as-early-as-the-budget-allows", "passes/plan/placement.py",
             "    return _latest_without_stall(",
             "    return earliest or _latest_without_stall(",
             ("tests/passes/plan/test_prefetch.py",),
             "reloads fill the budget where no copy needs the lead (no room for op workspaces)"),
    Mutation("rebuilt-view-loses-offset", "passes/fx/saved.py",
             "(list(layout.size), list(layout.stride), layout.offset)",
             "(list(layout.size), list(layout.stride), 0)",
             ("tests/passes/fx/test_saved.py",),
             "a saved view is rebuilt at offset 0 of its reloaded base"),
    Mutation("host-copy-ignores-dim-order", "passes/ir/ops.py",
             "    if dim_order is None:\n        return dense_layout(tensor)",
             "    if True:\n        return dense_layout(tensor)",
             ("tests/runtime/test_ops.py",),
             "copy_d2h lays the host copy out like the source, not as dim_order says"),
    Mutation("split-outputs-own-storages", "passes/fx/graph_trace.py",
             'if info is not None and "*" in info.after_set and info.before_set:',
             'if False:',
             ("tests/passes/fx/test_saved.py",),
             "split/unbind results get storages of their own (q/k/v views stop moving once)"),
    Mutation("saved-node-not-realized-like-an-output", "passes/fx/lowering.py",
             '    anchor.meta["inductor_realize_to_strides"] = True\n', "",
             ("tests/compiler/test_saved_views_numerics.py::"
              "test_every_budget_moves_saved_views_and_stays_bit_exact[hf_llama-inductor-fp32]",),
             "Inductor reschedules a saved node's producer once it is no output (fp32 drifts)"),
    Mutation("search-ignores-random-ops", "offload_compile/compiler/recompute/candidates.py",
             "        if random:\n", "        if False:\n",
             ("tests/compiler/test_recompute_search.py",),
             "a partition that re-runs dropout in the backward is used (its mask is drawn again)"),
    Mutation("low-precision-rule-off", "offload_compile/compiler/recompute/rules.py",
             "        if low_result or fused_low_input:\n", "        if False:\n",
             ("tests/compiler/test_recompute_search.py",),
             "under Inductor bf16 fused values are recomputed (they round differently)"),
    Mutation("search-keeps-the-slowest", "offload_compile/compiler/recompute/search.py",
             "        best = min(feasible, key=lambda c: c.report.step_s)",
             "        best = max(feasible, key=lambda c: c.report.step_s)",
             ("tests/compiler/test_recompute_search.py",
              "tests/compiler/test_recompute_numerics.py::test_aot_eager_recomputes_where_offload_stalls_and_stays_exact"),
             "the search compiles the partition with the longest predicted step"),
    Mutation("search-always-runs", "offload_compile/compiler/recompute/search.py",
             "    if pristine is None or (default.report.feasible and default.report.stall_s <= 0):",
             "    if pristine is None:",
             ("tests/compiler/test_recompute_search.py",
              "tests/compiler/test_recompute_numerics.py::test_at_the_peak_the_backend_compiles_plain_compiles_partition"),
             "a region that fits (or does not stall) is re-partitioned anyway"),
    Mutation("splice-saving-begins-at-first-saved-name", "offload_compile/compiler/recompute/splice.py",
             "        first_saved = len(outputs) - saved_count\n",
             "        first_saved = next((i for i, n in enumerate(names) if n in {p.name for p in"
             " fw.graph.find_nodes(op='output')[0].args[0][len(outputs) - saved_count:]"
             " if isinstance(p, fx.Node)}), len(names))\n",
             ("tests/compiler/test_recompute_splice.py",),
             "a user output that is also saved moves the added inputs into the user outputs"),
    Mutation("splice-materialize-skipped", "offload_compile/compiler/recompute/splice.py",
             "        barrier = self.graph.call_function(MATERIALIZE, (self._build(name),))\n",
             "        return self._build(name)\n"
             "        barrier = self.graph.call_function(MATERIALIZE, (self._build(name),))\n",
             ("tests/compiler/test_recompute_splice.py",),
             "a chain reads another recomputed value unrounded, straight from its chain"),
    Mutation("splice-count-never-refined", "offload_compile/compiler/recompute/candidates.py",
             "    while priced < limit:\n", "    while False:\n",
             ("tests/compiler/test_recompute_search.py",),
             "the splice search stops at the byte shares (Llama-7B 70 % on 16 GB/s: slower than recompute only)"),
    Mutation("swapped-window-never-freed", "passes/pipeline/residency.py",
             "_LEVEL_SIGN = {1: -1, 2: +1}", "_LEVEL_SIGN = {2: +1}",
             ("tests/passes/pipeline/test_residency.py",),
             "the residency model keeps a swapped window (dW state included) on the device"),
    Mutation("dw-load-after-weight-accepted", "passes/pipeline/check_order.py",
             "    if wait_load > chunk.consumer_pos:",
             "    if wait_load > chunk.consumer_pos and phase is SwapPhase.ACTIVATIONS:",
             ("tests/passes/pipeline/test_pp_check_order.py",),
             "check_order lets a dW state come back after the BWD_WEIGHT that reads it"),
    Mutation("dw-window-anchored-at-forward", "passes/pipeline/swap.py",
             "gap >= min_gap, open_pos, close_pos, phase)",
             "gap >= min_gap, open_pos - (phase is SwapPhase.WEIGHT_STATE), close_pos, phase)",
             ("tests/passes/pipeline/test_pp_check_order.py", "tests/passes/pipeline/test_pp_properties.py"),
             "DW_LAUNCH_OFFLOAD is placed before the BWD_INPUT whose state it moves"),
    Mutation("kept-output-keeps-graph", "offload_compile/pipeline/step_runner.py",
             "            self._detach_kept_output(stage, s, m)\n",
             "",
             ("tests/runtime/pipeline/test_step_context.py::test_a_kept_last_stage_output_drops_its_graph_after_its_backward",),
             "a last-stage output kept for the caller holds its autograd graph until the step ends"),
    Mutation("packed-d2h-per-storage", "runtime/pipeline/swap_group.py",
             "            if not packed:\n                self.manager.bind(sid, _whole_storage(tensor))",
             "            packed = False\n            if not packed:\n                self.manager.bind(sid, _whole_storage(tensor))",
             ("tests/runtime/pipeline/test_pp_swap_dist.py::test_swap_matches_no_swap_reference_and_prediction[zbv-4r-8mb-plain-group_swap]",),
             "group_swap=True moves every storage with a copy of its own"),
    Mutation("send-proven-by-its-own-receive", "passes/pipeline/execution.py",
             "clock[clocks.slot[peer]] > received", "clock[clocks.slot[peer]] >= received",
             ("tests/passes/pipeline/test_send_release.py",),
             "a send counts as received before the peer completed its receive"),
    Mutation("released-grad-kept-by-input-buffer", "runtime/pipeline/p2p.py",
             "            self._drop_input_grads(leaf, storages)", "            pass",
             ("tests/runtime/pipeline/test_p2p_tracker.py",
              "tests/runtime/pipeline/test_pp_swap_dist.py::"
              "test_releasing_proven_sends_lowers_the_peak_by_what_the_model_predicts"),
             "a released input gradient stays alive as the receive buffer's .grad"),
    # verify (issue 34): its checks dropped or weakened, and a race it must catch
    Mutation("verify-transfer-ops-unchecked", "runtime/transfer_context.py",
             "        if pending.expect is not None:\n", "        if False:\n",
             (RT + "test_verify_transfer_ops.py", "tests/compiler/test_verify_compile.py"),
             "the compile door's waits never compare what came back with what left"),
    Mutation("verify-write-after-copy-unchecked", "runtime/physical_buffer.py",
             "        if self._sent is not None and (self.host_buffer is not None"
             " or self._disk is not None):\n",
             "        if False:\n",
             (RT + "test_verify.py",),
             "a write to a storage after its D2H was issued goes unnoticed at its release"),
    Mutation("verify-checksum-samples-blocks", "runtime/verify.py",
             "block_sums = words[:full].view(-1, BLOCK_WORDS).sum(dim=1)",
             "block_sums = words[:full].view(-1, BLOCK_WORDS)[::2].sum(dim=1)",
             (RT + "test_verify.py",),
             "the checksum reads every other block: a torn copy in a skipped block passes"),
    Mutation("verify-checksum-unweighted", "runtime/verify.py",
             "weighted = (sums * weights).sum()", "weighted = sums.sum()",
             (RT + "test_verify.py",),
             "blocks copied to the wrong offsets keep both checksum words"),
    Mutation("verify-eager-reads-unchecked-reloads", "offload_compile/eager/executor_base.py",
             "        if self.manager.verify:\n", "        if False:\n",
             ("tests/eager/test_verify_eager.py",),
             "an eager op reads a reload whose wait never ran (and never checked it)"),
    Mutation("verify-packed-reload-unchecked", "runtime/pipeline/packed_copy.py",
             "        if self._sent is not None:\n", "        if False:\n",
             (RT + "pipeline/test_swap_verify.py",),
             "a packed swap's reload is unpacked without its check"),
    Mutation("verify-first-steps-never-off", "runtime/verify.py",
             "return self.limit is None or self.verified < self.limit", "return True",
             ("tests/compiler/test_verify_compile.py", "tests/eager/test_verify_eager.py",
              RT + "pipeline/test_swap_verify.py"),
             "verify='first_steps:N' keeps checking every step"),
    Mutation("race-wait-orders-nothing", "runtime/transfer_context.py",
             "        pending.transfer.wait()\n", "",
             (RT + "test_verify_transfer_ops.py::test_verified_copies_without_a_race_pass_and_keep_every_bit",),
             "a wait_transfer that orders nothing: the reload is read before its copy landed"),
    Mutation("reload-drops-conjugate-bit", "passes/fx/saved.py",
             "        steps.append(RebuildStep(aten._conj.default, ()))\n", "        pass\n",
             ("tests/passes/fx/test_saved.py", "tests/exactness/test_check.py::"
              "test_the_library_is_exact_on_complex_rope_and_fft_mixing_models"),
             "a saved conj view reloads without its conjugate bit (complex RoPE, issue 41)"),
    Mutation("reload-drops-negative-bit", "passes/fx/saved.py",
             "        steps.append(RebuildStep(aten._neg_view.default, ()))\n", "        pass\n",
             ("tests/passes/fx/test_saved.py",),
             "a saved _neg_view reloads without its negative bit"),
    Mutation("reload-ignores-dtype-views", "passes/fx/saved.py",
             "    reinterpret = value.dtype != base_value.dtype\n", "    reinterpret = False\n",
             ("tests/passes/fx/test_saved.py",),
             "a saved view in another dtype reloads as the base's dtype"),
    Mutation("verify-ignores-reload-metadata", "runtime/verify.py",
             "    differences = sent.differences(TensorProperties.of(data))\n",
             "    differences = []\n",
             (RT + "test_verify_transfer_ops.py",),
             "verify does not compare a reload's dtype and sizes with what left"),
)


def _build_copy(tmp: Path) -> Path:
    """The package laid out as installed (``hyper_offload/…``) plus tests, the examples
    (some tests train the demo GPT) and pyproject."""
    pkg = tmp / "pkg"
    for folder, target in PACKAGE_DIRS.items():
        shutil.copytree(ROOT / folder, pkg / target, ignore=IGNORE, dirs_exist_ok=True)
    shutil.copytree(ROOT / "passes" / "pipeline", pkg / "hyper_offload/passes/pipeline",
                    ignore=IGNORE, dirs_exist_ok=True)
    shutil.copytree(ROOT / "tests", tmp / "tests", ignore=IGNORE)
    shutil.copytree(ROOT / "examples", tmp / "examples", ignore=IGNORE)
    shutil.copy(ROOT / "pyproject.toml", tmp / "pyproject.toml")
    return pkg


def _installed_path(repo_path: str) -> str:
    folder, _, rest = repo_path.partition("/")
    return f"{PACKAGE_DIRS[folder]}/{rest}"


def _env(pkg: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(pkg), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def _pytest(
    tmp: Path, pkg: Path, tests: tuple[str, ...], *, stop_first: bool = True
) -> subprocess.CompletedProcess[str]:
    stop = ["-x"] if stop_first else []
    command = [sys.executable, "-m", "pytest", *stop, "-q", "-p", "no:cacheprovider", *tests]
    return subprocess.run(command, cwd=tmp, env=_env(pkg), capture_output=True, text=True,
                          timeout=900)


def _failures(output: str) -> list[str]:
    return [m.group(2) for m in re.finditer(r"^(FAILED|ERROR) (\S+)", output, re.MULTILINE)]


def _first_failure(output: str) -> str:
    failed = _failures(output)
    return failed[0] if failed else output.strip().splitlines()[-1] if output.strip() else "?"


def _apply(pkg: Path, mutation: Mutation) -> None:
    path = pkg / _installed_path(mutation.path)
    text = path.read_text()
    count = text.count(mutation.old)
    if count != 1:
        raise SystemExit(
            f"mutation {mutation.name}: expected the snippet once in {mutation.path}, found "
            f"{count}; update MUTATIONS in {Path(__file__).name} to the current source"
        )
    path.write_text(text.replace(mutation.old, mutation.new))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", default=[], help="run this mutation only")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--all-failures", action="store_true",
                        help="run every named test instead of stopping at the first failure, "
                        "and list each failing test")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    if args.list or not chosen:
        for m in MUTATIONS:
            print(f"{m.name:34} {m.path:28} {m.why}")
        return 0 if args.list else 2
    with tempfile.TemporaryDirectory(prefix="hyper_offload_mutation_") as name:
        tmp = Path(name)
        pristine = _build_copy(tmp / "pristine")
        where = subprocess.run(
            [sys.executable, "-c", "import hyper_offload; print(hyper_offload.__file__)"],
            env=_env(pristine), capture_output=True, text=True, check=True,
        ).stdout.strip()
        if not where.startswith(str(pristine)):
            print(f"import hyper_offload resolves to {where}, not the copy", file=sys.stderr)
            return 2
        baseline = sorted({t for m in chosen for t in m.tests})
        done = _pytest(tmp / "pristine", pristine, tuple(baseline))
        if done.returncode != 0:
            print(f"baseline fails, fix it first:\n{done.stdout[-3000:]}", file=sys.stderr)
            return 2
        print(f"baseline: {len(baseline)} test file(s) pass on the unmutated copy")
        missed = 0
        for mutation in chosen:
            work = tmp / mutation.name
            pkg = _build_copy(work)
            _apply(pkg, mutation)
            start = time.perf_counter()
            done = _pytest(work, pkg, mutation.tests, stop_first=not args.all_failures)
            seconds = time.perf_counter() - start
            # Exit 1: tests ran and failed. Anything else (a collection or import error, no
            # tests) means the mutation broke the code in some other way: not a catch.
            caught = done.returncode == 1
            missed += not caught
            if caught:
                verdict, detail = "CAUGHT", _first_failure(done.stdout)
            elif done.returncode == 0:
                verdict, detail = "MISSED", "all tests passed"
            else:
                verdict, detail = "BROKEN", f"pytest exit {done.returncode}: " + _first_failure(done.stdout)
            print(f"{verdict} {mutation.name:34} {seconds:5.1f}s  {detail}")
            if caught and args.all_failures:
                for test in _failures(done.stdout):
                    print(f"       fails: {test}")
            shutil.rmtree(work, ignore_errors=True)
    print(f"{len(chosen) - missed}/{len(chosen)} mutations caught")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
