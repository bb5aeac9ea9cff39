"""examples/gpu_check.py end to end on the CPU (its dry mode), and how it judges its goals."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
SECTIONS = [
    "parity", "init_forms", "many_buckets", "sync_audit", "step_time", "bandwidth", "host_cost",
]  # fmt: skip


def _run(tmp_path: Path, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    path = tmp_path / "check.json"
    paths = [str(ROOT / d) for d in ("src", "tests")]
    env = {"PYTHONPATH": ":".join(paths), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "gpu_check.py"), "--device", "cpu", "--json", str(path),
         *extra],
        env={**os.environ, **env}, capture_output=True, text=True, timeout=170,
    )  # fmt: skip
    assert path.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(path.read_text())


@pytest.mark.timeout(180)
def test_every_section_runs_on_the_cpu_and_reports_a_verdict(tmp_path):
    proc, found = _run(tmp_path)
    sections = found["sections"]
    assert list(sections) == SECTIONS
    for name in ("parity", "init_forms", "many_buckets", "step_time", "bandwidth", "host_cost"):
        assert sections[name]["verdict"] == "pass", (name, json.dumps(sections[name])[:3000])
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert sections["sync_audit"]["verdict"] == "skipped: no CUDA"
    parity = sections["parity"]["parts"]
    assert parity["nccl, 1 rank"]["verdict"] == "skipped: no CUDA"
    hooks = parity["gloo, 2 ranks"]["hooks"]
    assert hooks["allreduce"]["differing_elements"] == 0 and hooks["fp16"]["verdict"] == "pass"
    assert hooks["power_sgd"]["relative_error"] <= 1e-5
    assert sections["init_forms"]["parts"]["eager"]["verdict"] == "skipped: no CUDA"
    assert len(sections["init_forms"]["parts"]["lazy"]["hooks"]) >= 10
    buckets = sections["many_buckets"]["parts"]
    assert all(r["buckets"] >= 100 and r["steps"] == 4 for r in buckets.values()), buckets
    steps = sections["step_time"]["parts"]["one bucket"]["hooks"]
    assert steps["int8"]["median_ms"] > 0 and steps["torch_allreduce"]["median_ms"] > 0
    verdicts = {g["goal"]: g["verdict"] for g in found["goals"]}
    assert verdicts["one bucket: step time int8 / fp16"] in ("met", "missed")
    assert verdicts["25 MB buckets: peak memory fp16 / torch_fp16"].startswith("n/a")
    assert verdicts["host waits in a step: power_sgd, repair, non-finite"] == "skipped: no CUDA"
    assert "host waits in a step: int4, non-finite" in proc.stdout
    hosts = sections["host_cost"]["parts"]["table"]["rows"]
    assert [r["hook"] for r in hosts] == ["allreduce", "fp16", "int8"], hosts
    # The costs over no hook are timings of a few microseconds on a shared machine: the
    # section must measure them, not find them above zero.
    timed = (math.isfinite(r["ours_ms"]) and math.isfinite(r["theirs_ms"]) for r in hosts)
    assert all(r["buckets"] == 8 for r in hosts) and all(timed), hosts
    assert verdicts["host time int8 / torch_fp16, 8 buckets"] in ("met", "missed")
    met = sum(v == "met" for v in verdicts.values())
    assert f"goals: {met} met" in proc.stdout


@pytest.mark.timeout(120)
def test_a_section_out_of_time_is_recorded_and_the_rest_still_run(tmp_path):
    proc, found = _run(tmp_path, "--budget-scale", "0.001", "--sections", "parity,bandwidth")
    assert proc.returncode == 1
    parity, bandwidth = found["sections"]["parity"], found["sections"]["bandwidth"]
    assert parity["verdict"] == "fail"
    assert (
        "not run: the section's time budget is spent" in parity["parts"]["gloo, 2 ranks"]["error"]
    )
    assert bandwidth["verdict"] == "fail" and "TimeoutError" in bandwidth["error"]


@pytest.fixture(scope="module")
def parts():
    sys.path.insert(0, str(EXAMPLES))
    try:
        import gpu_check_parts
    finally:
        sys.path.remove(str(EXAMPLES))
    return gpu_check_parts


def test_goals_compare_ours_with_pytorchs_and_say_why_when_they_cannot(parts):
    rows = {
        "fp16": {"median_ms": 5.0, "peak_mib": 100.0},
        "torch_fp16": {"median_ms": 4.9, "peak_mib": 98.0},
        "int8": {"median_ms": 4.0, "peak_mib": 90.0},
        "torch_bf16": {"error": "TypeError: needs CUDA"},
        "bf16": {"median_ms": 5.0, "peak_mib": 100.0},
    }
    goals = {g["goal"]: g for g in parts.step_goals("one bucket", {"hooks": rows})}
    assert goals["one bucket: step time fp16 / torch_fp16"]["verdict"] == "missed"  # 1.02x
    assert goals["one bucket: peak memory fp16 / torch_fp16"]["verdict"] == "met"  # 1.02x
    assert goals["one bucket: step time int8 / fp16"]["verdict"] == "met"
    bf16 = goals["one bucket: step time bf16 / torch_bf16"]["verdict"]
    assert bf16 == "n/a: torch_bf16 TypeError: needs CUDA"
    assert goals["one bucket: step time int4 / fp16"]["verdict"].startswith("missed: not measured")


def test_each_host_cost_row_is_a_goal_and_a_missing_table_says_why(parts):
    rows = [
        {"hook": "fp16", "against": "torch_fp16", "buckets": 96, "ratio": 1.2, "goal": 1.0,
         "met": False},
        {"hook": "power_sgd", "against": "torch_power_sgd", "buckets": 1, "ratio": 0.8,
         "goal": 1.0, "met": True},
    ]  # fmt: skip
    found = parts.host_goals({"parts": {"table": {"verdict": "pass", "rows": rows}}})
    assert [(g["goal"], g["measured"], g["limit"], g["verdict"]) for g in found] == [
        ("host time fp16 / torch_fp16, 96 buckets", 1.2, 1.0, "missed"),
        ("host time power_sgd / torch_power_sgd, 1 bucket", 0.8, 1.0, "met"),
    ]
    failed = {"verdict": "fail", "parts": {"table": {"verdict": "fail", "error": "no answer"}}}
    (only,) = parts.host_goals(failed)
    assert only["verdict"] == "missed: no answer" and only["measured"] is None


def test_the_first_sync_is_found_in_the_hooks_traceback(parts):
    message = (
        'Traceback (most recent call last):\n  File "/x/torch/nn/parallel/ddp.py", line 9, in f\n'
        '  File "/x/src/commhooks/hooks/half.py", line 42, in finish\n'
        '  File "/x/torch/cuda/__init__.py", line 7, in synchronize\n'
        "RuntimeError: called a synchronizing CUDA operation"
    )
    found = parts.first_sync(RuntimeError(message))
    assert found == "/x/src/commhooks/hooks/half.py:42 in finish"


def test_host_waits_are_counted_only_within_the_audited_step(parts):
    # The registries PyTorch's GPU trace fires when the host waits for a CUDA event, a stream
    # (what .item() does) or the device.
    from torch.cuda import _gpu_trace

    waits = parts.HostWaits()
    _gpu_trace.EventSynchronizationCallbacks.fire_callbacks(1)
    with waits.counting() as seen:
        _gpu_trace.EventSynchronizationCallbacks.fire_callbacks(2)
        _gpu_trace.StreamSynchronizationCallbacks.fire_callbacks(3)
        _gpu_trace.DeviceSynchronizationCallbacks.fire_callbacks()
    _gpu_trace.StreamSynchronizationCallbacks.fire_callbacks(4)
    assert len(seen) == 3 and all("test_gpu_check.py" in line for line in seen)
    with waits.counting() as again:
        pass
    assert again == []  # each audited step counts its own


def test_the_audit_expects_no_wait_by_default_and_one_with_the_repair(parts):
    skipped = {"verdict": "skipped: no CUDA"}
    goals = parts.sync_goals({"parts": {name: skipped for name in parts.AUDITED}})
    limits = {g["goal"].removeprefix("host waits in a step: "): g["limit"] for g in goals}
    assert limits["fp16, finite"] == limits["fp16, non-finite"] == 0
    assert limits["int4, repair"] == limits["int4, repair, non-finite"] == 1
    assert "streaming_diloco, non-finite" in limits and "streaming_diloco, repair" not in limits
    cases = {"finite": {"verdict": "pass", "syncs": 0},
             "non-finite": {"verdict": "fail", "syncs": ">= 1", "first_sync": "x.py:3 in f"},
             "repair": {"verdict": "pass", "syncs": 1},
             "repair, non-finite": {"verdict": "fail", "syncs": 2}}  # fmt: skip
    found = {
        g["goal"]: g["verdict"] for g in parts.sync_goals({"parts": {"fp16": {"cases": cases}}})
    }
    assert found["host waits in a step: fp16, finite"] == "met"
    assert found["host waits in a step: fp16, non-finite (first: x.py:3 in f)"] == "missed"
    assert found["host waits in a step: fp16, repair"] == "met"
    assert found["host waits in a step: fp16, repair, non-finite"] == "missed"


@pytest.mark.parametrize("name", ["fp16", "int4", "streaming_diloco"])
def test_the_audits_steps_are_finite_then_not_and_repaired_where_the_hook_can_be(parts, name):
    from commhooks.testing import run_on_ranks

    sys.path.insert(0, str(EXAMPLES))  # where the rank finds the function
    try:
        (found,) = run_on_ranks(parts.sync_audit_rank, 1, name, False, timeout=60)
    finally:
        sys.path.remove(str(EXAMPLES))
    assert list(found["cases"]) == parts.audit_cases(name)
    assert found["verdict"] == "pass", found  # each step as finite as it was meant to be
