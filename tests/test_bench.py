"""``commhooks bench`` end to end on a tiny budget: the default command, the JSON schema, a
PyTorch baseline that fails becoming a row, and the command-line entry points."""

import contextlib
import io
import json
import math
import os
import subprocess
import sys

import pytest

from commhooks.bench import cli, hookset

ROW_KEYS = {
    "hook": str,
    "bandwidth": (int, type(None)),
    "ok": bool,
    "step_ms_median": float,
    "bytes_per_step": (int, float),
    "heldout_loss": float,
    "peak_memory_bytes": int,
    "peak_rss_bytes": int,
}

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


@pytest.fixture(scope="module")
def default_output(tmp_path_factory):
    """The no-argument command with only a tiny budget added (every default hook that exists):
    its JSON document and what it printed."""
    path = tmp_path_factory.mktemp("bench") / "out.json"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        argv = ["--steps", "5", "--warmup", "2", "--reach-steps", "5", "--json", str(path)]
        assert cli.main(argv) == 0
    with open(path) as f:
        return json.load(f), printed.getvalue()


@pytest.fixture(scope="module")
def default_run(default_output):
    return default_output[0]


def test_default_command_runs_every_registered_default_hook(default_run, capsys):
    rows = {r["hook"]: r for r in default_run["results"]}
    expected = [h for h in hookset.DEFAULT_HOOKS if h in hookset.available_hooks()]
    assert list(rows) == expected
    assert all(r["ok"] for r in rows.values()), [r.get("error") for r in rows.values()]
    assert default_run["settings"]["skipped_hooks"] == [
        h for h in hookset.DEFAULT_HOOKS if h not in expected
    ]


def test_json_schema(default_run):
    env = default_run["environment"]
    for key in ("python", "torch", "commhooks", "world_size", "bandwidths", "date"):
        assert key in env
    assert env["world_size"] == 2 and env["bandwidths"] == [None] and env["bandwidth"] is None
    for row in default_run["results"]:
        for key, kind in ROW_KEYS.items():
            assert isinstance(row[key], kind), (row["hook"], key, row[key])
        assert row["bandwidth"] is None
        assert row["step_ms_median"] > 0 and row["step_ms_p25"] <= row["step_ms_p75"]
        assert math.isfinite(row["heldout_loss"]) and row["peak_memory_bytes"] > 0
        assert len(row["peak_memory_bytes_per_rank"]) == 2 and row["peak_rss_bytes"] > 0
        assert len(row["losses"]) == 5 and all(len(x) == 3 for x in row["losses"])
        times = [x[2] for x in row["losses"]]
        assert times == sorted(times)
        assert len(row["step_ms"]) == 2 and len(row["step_ms"][0]) == 3


def test_bytes_follow_the_hooks_compression(default_run):
    rows = {r["hook"]: r for r in default_run["results"]}
    grad = rows["allreduce"]["gradient_bytes"]
    # two ranks: a ring allreduce sends 2 (p-1)/p = 1 times the payload per rank
    assert rows["noop"]["bytes_per_step"] == 0
    assert rows["allreduce"]["bytes_per_step"] == pytest.approx(grad)
    # fp16 sends each bucket at half size, nothing more.
    assert rows["fp16"]["bytes_per_step"] == pytest.approx(grad / 2)
    assert rows["fp16"]["compression_ratio"] == pytest.approx(2.0, rel=1e-3)
    assert rows["fp16"]["time_vs_allreduce"] == pytest.approx(
        rows["fp16"]["step_ms_median"] / rows["allreduce"]["step_ms_median"]
    )
    # allreduce keeps every rank's model identical; noop trains two separate models
    a, n = rows["allreduce"]["heldout_loss_per_rank"], rows["noop"]["heldout_loss_per_rank"]
    assert a[0] == pytest.approx(a[1], abs=1e-6) and n[0] != pytest.approx(n[1], abs=1e-6)


def test_default_run_ends_with_the_answer(default_output):
    document, printed = default_output
    ladder = {str(b) for b in (10**8, 10**9, 10**10, 25 * 10**9)}
    for row in document["results"]:
        assert set(row["predicted"]) == ladder, row["hook"]
        for at in row["predicted"].values():
            assert at["step_ms"] > 0 and at["speedup_vs_allreduce"] > 0
        assert "break_even_bps" in row and isinstance(row["noise"]["noisy"], bool)
        reached = row["steps_to_allreduce_loss"]
        assert (reached is None) == (row["time_to_allreduce_loss_s"] is None)
    rows = {r["hook"]: r for r in document["results"]}
    assert rows["allreduce"]["break_even_bps"] == 0  # never faster than itself
    assert 1 <= rows["allreduce"]["steps_to_allreduce_loss"] <= 5
    recommendations = document["answer"]["recommendations"]
    assert [r["bandwidth"] for r in recommendations] == sorted(int(b) for b in ladder)
    # The last screen: the tables and the answer, in 80 columns, ending with which hook to use.
    screen = printed[printed.index("measured on loopback:") :].splitlines()
    assert max(len(line) for line in screen) <= 80, max(screen, key=len)
    assert "Which hook on which link" in printed
    for recommendation in recommendations:
        assert recommendation["text"] in printed


def test_command_line_conventions(capsys):
    from commhooks.__main__ import main

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == "commhooks 0.1.0"
    assert main(["--help"]) == 0
    assert "bench" in capsys.readouterr().out
    assert main(["benhc"]) == 2
    assert "valid commands: bench" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--hooks", "powersgd"])
    assert "powersgd (Did you mean 'power_sgd'?)" in capsys.readouterr().err


def test_failing_torch_baseline_is_a_row_not_an_abort(tmp_path, capsys):
    path = tmp_path / "t.json"
    argv = ["--hooks", "allreduce,torch_bf16", "--steps", "4", "--warmup", "1", "--json", str(path)]
    assert cli.main(argv) == 0
    rows = {r["hook"]: r for r in json.loads(path.read_text())["results"]}
    assert rows["allreduce"]["ok"]
    assert rows["torch_bf16"]["ok"] is False
    assert "CUDA" in rows["torch_bf16"]["error"] or "NCCL" in rows["torch_bf16"]["error"]
    assert rows["torch_bf16"]["step_ms_median"] is None
    assert "FAILED torch_bf16" in capsys.readouterr().out


def test_repeated_rounds_in_lockstep_pool_every_timed_step(tmp_path, capsys):
    path = tmp_path / "r.json"
    argv = ["--hooks", "noop,power_sgd_single_round", "--steps", "4", "--warmup", "1"]
    argv += ["--reach-steps", "4"]
    assert cli.main([*argv, "--repeat", "2", "--lockstep", "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert doc["settings"]["repeat"] == 2 and doc["settings"]["lockstep"] is True
    assert doc["settings"]["offload"] is True and doc["settings"]["memory"] == "live"
    for row in doc["results"]:
        assert row["ok"] and row["repeats"] == 2 and row["timed_steps"] == 2 * 3
        assert [len(per_rank) for per_rank in row["step_ms"]] == [6, 6]
    out = capsys.readouterr().out
    assert "round 2/2" in out and "lockstep" in out
    # each round also runs each hook for its memory, whose steps are not timed
    assert "power_sgd_single_round @ loopback, round 2/2, memory:" in out


def test_python_dash_m_rejects_unknown_hook_with_valid_names():
    env = {**os.environ, "PYTHONPATH": SRC}
    proc = subprocess.run(
        [sys.executable, "-m", "commhooks", "bench", "--hooks", "nope"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "unknown hook(s) nope" in proc.stderr and "allreduce" in proc.stderr


def test_bandwidth_without_root_says_so(monkeypatch):
    from commhooks.bench import netns

    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    with pytest.raises(netns.NetworkError, match="needs root"):
        netns.check_can_create()


def test_floors_send_what_single_round_powersgd_sends(tmp_path):
    path = tmp_path / "f.json"
    hooks = "noop,floor_sync,floor_wire,floor_memory,power_sgd_single_round"
    argv = ["--hooks", hooks, "--steps", "7", "--warmup", "4", "--reach-steps", "7"]
    argv += ["--json", str(path)]
    assert cli.main(argv) == 0
    rows = {r["hook"]: r for r in json.loads(path.read_text())["results"]}
    assert all(r["ok"] for r in rows.values()), [r.get("error") for r in rows.values()]
    single = rows["power_sgd_single_round"]["bytes_per_step"]
    assert single > 0
    assert rows["floor_wire"]["bytes_per_step"] == pytest.approx(single)
    assert rows["floor_memory"]["bytes_per_step"] == pytest.approx(single)
    assert 0 < rows["floor_sync"]["bytes_per_step"] <= 8
    # The first two leave each rank's gradient alone: they train exactly as noop does.
    for name in ("floor_sync", "floor_wire"):
        assert rows[name]["heldout_loss_per_rank"] == rows["noop"]["heldout_loss_per_rank"]
    # The last one overwrites it with its fixed low-rank product.
    assert rows["floor_memory"]["heldout_loss_per_rank"] != rows["noop"]["heldout_loss_per_rank"]


def test_longer_runs_compare_held_out_loss_and_timings_over_the_same_steps(tmp_path, capsys):
    path = tmp_path / "reach.json"
    argv = ["--hooks", "allreduce,no", "--steps", "4", "--warmup", "1", "--reach-steps", "6"]
    assert cli.main([*argv, "--memory", "rss", "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    rows = {r["hook"]: r for r in doc["results"]}
    # --memory rss: no memory runs, the peak is the timed runs' resident set
    assert doc["settings"]["memory"] == "rss" and "memory:" not in capsys.readouterr().out
    assert all(r["peak_memory_bytes"] == r["peak_rss_bytes"] > 0 for r in rows.values())
    # DDP's own allreduce trains bit for bit as the allreduce hook, two steps longer; the
    # held-out loss is taken after step 4 in both.
    assert len(rows["allreduce"]["losses"]) == 4 and len(rows["no"]["losses"]) == 6
    assert rows["no"]["heldout_loss_per_rank"] == rows["allreduce"]["heldout_loss_per_rank"]
    assert rows["no"]["steps_to_allreduce_loss"] <= 4
    # Step times, bytes and memory come from the same steps (2 to 4) in both rows: the longer
    # run's steps 5 and 6 are not timed, and their allreduces are not counted.
    for row in rows.values():
        assert row["timed_steps"] == 3 and len(row["step_ms"][0]) == 3
    gradient = rows["allreduce"]["gradient_bytes"]
    assert rows["allreduce"]["payload_bytes_per_step"]["all_reduce"] == gradient
