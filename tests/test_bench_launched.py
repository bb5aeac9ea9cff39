"""``commhooks bench`` under torchrun: it joins the launcher's world, measures the network,
trains the user's model (``--model``) with every hook in turn, survives a hook that raises or
hangs on one rank, and rank 0 alone prints the tables, the answer and the JSON."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from commhooks.bench import args, costmodel, launched, linkprobe, predict, usermodel, world
from commhooks.bench.clock import HostClock, clock_for
from commhooks.bench.rows import Row

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"


def checkout_env(**extra: str) -> dict[str, str]:
    """This checkout's sources first on the path, one thread per rank, gloo on loopback."""
    paths = [str(ROOT / "src"), str(TESTS)]
    env = {k: v for k, v in os.environ.items() if k not in world.LAUNCHER_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")])
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1", **extra)
    return env


@pytest.fixture(scope="module")
def torchrun_output(tmp_path_factory):
    """``torchrun --nproc_per_node 2 -m commhooks bench --steps 6`` with a test model whose
    third hook raises on rank 1 and whose fourth hangs there: JSON, output, seconds."""
    out = tmp_path_factory.mktemp("launched") / "run.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", "-m", "commhooks", "bench", "--steps", "6", "--model",
           "bench_models:raises_then_hangs", "--hooks", "noop,allreduce,fp16,bf16,power_sgd",
           "--timeout", "6", "--json", str(out)]  # fmt: skip
    started = time.monotonic()
    proc = subprocess.run(
        cmd, cwd=out.parent, env=checkout_env(), capture_output=True, text=True, timeout=120
    )
    printed = proc.stdout + proc.stderr
    assert proc.returncode == 0, printed[-5000:]
    return json.loads(out.read_text()), proc.stdout, time.monotonic() - started


@pytest.mark.timeout(150)
def test_torchrun_joins_the_world_and_rank_0_alone_reports(torchrun_output):
    doc, printed, _ = torchrun_output
    env = doc["environment"]
    assert env["backend"] == "gloo" and env["world_size"] == 2
    assert env["launcher"]["world_size"] == 2 and env["launcher"]["rank"] == 0
    assert doc["settings"]["model"] == "bench_models:raises_then_hangs"
    rows = {r["hook"]: r for r in doc["results"]}
    assert list(rows) == ["noop", "allreduce", "fp16", "bf16", "power_sgd"]
    for hook in ("noop", "allreduce", "power_sgd"):
        row = rows[hook]
        assert row["ok"], row["error"]
        assert row["device"] == "cpu" and row["timed_steps"] == 3
        assert row["step_ms_median"] > 0 and row["host_step_ms_median"] > 0
        assert row["device_peak_memory_bytes"] is None  # no GPU here
        # the test model's own size: 32x64 + 64 + 64x4 + 4 parameters of 4 bytes
        assert row["gradient_bytes"] == 4 * (32 * 64 + 64 + 64 * 4 + 4)
    # what crosses machines, by the payload model: nothing leaves one machine of two ranks,
    # whose allreduce hands over every gradient each step
    assert rows["allreduce"]["bytes_per_step"] == 0
    assert rows["allreduce"]["payload_bytes_per_step"] == {
        "all_reduce": rows["allreduce"]["gradient_bytes"]
    }
    # one table, one answer: only rank 0 prints them; the shape is the launcher's (one node
    # of two processes), and the answer is for it and for two machines of eight
    assert printed.count("cluster: 1 machine x 2 ranks") == 1
    assert printed.count("measured on your network (1 machine x 2 ranks, gloo):") == 1
    assert printed.count("Which hook on which link, 1 machine x 2 ranks") == 1
    assert printed.count("Which hook on which link, 2 machines x 8 ranks") == 1
    assert env["shape"] == {"nodes": 1, "per_node": 2}
    assert [s["shape"]["key"] for s in doc["answer"]["shapes"]] == ["1x2", "2x8"]


@pytest.mark.timeout(150)
def test_the_measured_network_and_the_answer_on_it(torchrun_output):
    doc, printed, _ = torchrun_output
    link = doc["answer"]["link"]
    assert link["backend"] == "gloo" and link["world_size"] == 2
    sizes = [p[0] for p in link["points"]]
    assert sizes[0] == 4096 and sizes == sorted(sizes) and len(sizes) >= 4
    assert link["rate_bps"] > 1e8 and 0 <= link["latency_s"] < 0.01  # loopback
    assert link["text"] in printed.replace("\n", " ")
    best = doc["answer"]["on_your_network"]
    assert best["text"].split(";")[0] in printed.replace("\n", " ")
    # the ladder of predictions for other rates, from the rows measured
    for row in doc["results"]:
        if row["ok"]:
            assert set(row["predicted"]) == {str(b) for b in doc["answer"]["links"]}
    assert doc["answer"]["measured_on"] == "your network"


@pytest.mark.timeout(150)
def test_a_hook_that_raises_or_hangs_on_one_rank_costs_its_row_only(torchrun_output):
    doc, printed, seconds = torchrun_output
    rows = {r["hook"]: r for r in doc["results"]}
    raised, hung = rows["fp16"], rows["bf16"]
    assert not raised["ok"] and raised["error"].startswith("rank 1: ValueError: batch 2 is corrupt")
    assert not hung["ok"] and "rank 1: HookTimeout" in hung["log_tail"]
    assert "ran past --timeout 6s" in hung["log_tail"]
    # the hook after the hang ran on every rank as usual
    assert rows["power_sgd"]["ok"] and rows["power_sgd"]["timed_steps"] == 3
    assert "FAILED fp16 @ your network" in printed
    assert seconds < 100  # two failures within their timeouts, not the run's


def test_launcher_variables_all_or_none():
    assert world.launcher_world({}) is None
    assert world.launcher_world({"MASTER_ADDR": "10.0.0.1"}) is None
    full = {"RANK": "3", "WORLD_SIZE": "16", "LOCAL_RANK": "3", "MASTER_ADDR": "node0"}
    assert world.launcher_world(full) == world.LauncherWorld(3, 16, 3, "node0")
    with pytest.raises(ValueError, match="LOCAL_RANK, MASTER_ADDR is not"):
        world.launcher_world({"RANK": "0", "WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="whole numbers"):
        world.launcher_world({**full, "RANK": "x"})


def test_flags_that_mean_nothing_under_a_launcher_are_refused(monkeypatch, capsys):
    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    plan = args.parse(["--steps", "6"])
    assert plan.world is not None and plan.ranks == 2 and plan.memory == "rss"
    assert plan.backend == ("nccl" if torch.cuda.is_available() else "gloo")
    for flag in (["--ranks", "4"], ["--bandwidth", "1gbit"], ["--memory", "live"], ["--fsdp"]):
        with pytest.raises(SystemExit):
            args.parse(flag)
        assert "under a launcher" in capsys.readouterr().err or flag[0] == "--memory"
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            args.parse(["--backend", "nccl"])
        assert "needs GPUs" in capsys.readouterr().err


def test_nccl_without_a_launcher_says_how_to_get_one(capsys):
    with pytest.raises(SystemExit):
        args.parse(["--backend", "nccl"])
    assert "torchrun --nproc_per_node N -m commhooks bench" in capsys.readouterr().err


def test_model_factories_are_checked_with_the_fix(capsys):
    with pytest.raises(usermodel.BenchModelError, match="give package.module:factory"):
        usermodel.load_factory("bench_models")
    with pytest.raises(usermodel.BenchModelError, match="PYTHONPATH"):
        usermodel.load_factory("no_such_module_here:make")
    with pytest.raises(usermodel.BenchModelError, match="has no 'missing'"):
        usermodel.load_factory("bench_models:missing")
    with pytest.raises(usermodel.BenchModelError, match="return .*BenchModel"):
        usermodel.task_from_factory("bench_models:not_a_model", 0, 5)
    task = usermodel.task_from_factory("bench_models:no_loss", 0, 5)
    with pytest.raises(usermodel.BenchModelError, match=r"\(16, 4\), not a loss"):
        task.loss(task.train_batch(0, 0), task.model)
    with pytest.raises(SystemExit):
        args.parse(["--model", "bench_models:classifier", "--task", "synthetic"])
    assert "give --model or --task" in capsys.readouterr().err


def test_both_forms_of_the_protocol_train(tmp_path):
    full = usermodel.task_from_factory("bench_models:classifier", 0, heldout_step=5)
    short = usermodel.task_from_factory("bench_models:model_and_batch", 0, heldout_step=5)
    for task in (full, short):
        loss = task.loss(task.train_batch(1, 0), task.model)
        assert loss.dim() == 0 and torch.isfinite(loss)
        assert task.heldout_loss(task.model, torch.device("cpu")) > 0
    # the full form's batches differ per rank and step; the short form's batch is fixed
    assert not torch.equal(full.train_batch(0, 1)[0], full.train_batch(1, 1)[0])
    assert short.train_batch(0, 1) is short.train_batch(1, 7)
    assert full.describe["parameters"] == 32 * 64 + 64 + 64 * 4 + 4


def test_local_ranks_train_a_users_model_too(tmp_path, monkeypatch):
    from commhooks.bench import cli

    monkeypatch.syspath_prepend(str(TESTS))
    path = tmp_path / "m.json"
    argv = ["--model", "bench_models:model_and_batch", "--hooks", "allreduce", "--steps", "3"]
    assert cli.main([*argv, "--warmup", "1", "--memory", "rss", "--json", str(path)]) == 0
    rows = {r["hook"]: r for r in json.loads(path.read_text())["results"]}
    assert sorted(rows) == ["allreduce", "noop"]  # noop: for the prediction for 2 x 8
    row = rows["allreduce"]
    assert row["ok"], row["error"]
    assert row["gradient_bytes"] == 4 * (32 * 64 + 64 + 64 * 4 + 4)


def test_link_fit_recovers_rate_and_latency():
    sizes = [4096 * 4**i for i in range(7)]
    for ranks, rate, latency in ((2, 1e9, 50e-6), (8, 1e8, 2e-3)):
        share = 2 * (ranks - 1) / ranks
        points = [[n, 2 * (ranks - 1) * latency + 8 * share * n / rate] for n in sizes]
        fitted_rate, fitted_latency = linkprobe.fit_link(points, ranks)
        assert fitted_rate == pytest.approx(rate, rel=1e-6)
        assert fitted_latency == pytest.approx(latency, rel=1e-6)
    # a rate limiter lets its bucket (25 KB) through at once: the large sizes still give the rate
    burst = [[n, 1e-4 + 8 * max(0, n - 25_000) / 1e8] for n in sizes]
    assert linkprobe.fit_link(burst, 2)[0] == pytest.approx(1e8, rel=1e-6)
    # times that do not grow with size: too fast a link to tell its rate
    assert linkprobe.fit_link([[4096, 1e-4], [1 << 20, 1e-4]], 2)[0] is None
    # a single size (the first one already took long): its whole time is the rate's
    assert linkprobe.fit_link([[1 << 20, 0.08]], 2) == (pytest.approx(8 * (1 << 20) / 0.08), 0.0)


def test_predictions_start_from_the_rows_less_the_networks_time():
    calls, sent = {"all_reduce": 1.0}, {"all_reduce": 1e6}
    row = Row("allreduce", None, True, step_ms_mean=20.0)
    row.payload_calls_per_step, row.payload_bytes_per_step = calls, sent
    link = costmodel.Link(1e9, 0.0, wire_factor=1.0)  # 1e6 bytes at 1 Gbit/s: 8 ms
    model = predict.Model.from_rows({"allreduce": row}, 2, 0.0, link)
    assert model.measured["allreduce"].step_s == pytest.approx(0.012)
    assert predict.Model.from_rows({"allreduce": row}, 2, 0.0).measured[
        "allreduce"
    ].step_s == pytest.approx(0.020)


def test_cpu_clock_and_deadline():
    clock = clock_for(torch.device("cpu"))
    assert isinstance(clock, HostClock)
    start = clock.mark()
    time.sleep(0.01)
    assert 0.009 < clock.seconds(start, clock.mark()) < 1
    clock.reset_peak_memory()
    assert clock.peak_memory_bytes() is None
    expired = pytest.raises(launched.HookTimeout, match="ran past --timeout 0.2s")
    with expired, launched.deadline(0.2, "a sleep"):
        time.sleep(5)
    with launched.deadline(1.0, "a quick block"):
        pass
    time.sleep(1.2)  # no alarm left behind


def _torchrun_commands(text: str) -> list[str]:
    """The ``torchrun`` lines of ``text``'s bash blocks, continuation lines joined."""
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
    return [line.split("  #")[0] for line in lines if line.startswith("torchrun")]


def test_readme_cluster_commands_use_real_flags():
    readme = _torchrun_commands((ROOT / "README.md").read_text())
    guide = _torchrun_commands((ROOT / "docs" / "choosing-a-hook.md").read_text())
    assert len(readme) == 1 and any("--nnodes 2" in c for c in guide)
    parser = args.build_parser()
    for command in readme + guide:
        words = command.split()
        bench = words[words.index("bench") + 1 :]
        assert words[words.index("bench") - 2 : words.index("bench")] == ["-m", "commhooks"]
        parser.parse_args(bench)  # exits on a flag the bench does not have


class _FakeEvent:
    """Stands for a CUDA event: passed by the device on the third query, 12.5 ms after start."""

    def __init__(self) -> None:
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.queries > 2

    def elapsed_time(self, end: "_FakeEvent") -> float:
        return 12.5


def test_gpu_clock_polls_until_the_device_passed_the_mark():
    from commhooks.bench.clock import CudaClock

    start, end = _FakeEvent(), _FakeEvent()
    assert CudaClock(torch.device("cuda", 0)).seconds(start, end) == pytest.approx(0.0125)
    assert end.queries == 3  # it returned to Python between queries, never blocked


def test_gpu_rows_show_host_time_and_device_memory_in_80_columns():
    from commhooks.bench import report

    rows = [
        Row(hook, None, True, device="cuda:0", step_ms_median=12.0, host_step_ms_median=3.5,
            device_peak_memory_bytes=40 << 30, bytes_per_step=2e8, heldout_loss=2.5,
            steps_to_allreduce_loss=87, time_to_allreduce_loss_s=12.3)
        for hook in ("allreduce", "power_sgd_single_round")
    ]  # fmt: skip
    lines = report.results_lines(rows, "title", wide=False, network="your network")
    header = next(line for line in lines if line.startswith("hook"))
    assert "host" in header and "dev mem" in header
    assert "40.0 GiB" in "\n".join(lines) and max(len(line) for line in lines) <= 80
    cpu = [Row("allreduce", None, True, device="cpu", step_ms_median=12.0)]
    assert "dev mem" not in "\n".join(report.results_lines(cpu, "t", wide=False))
