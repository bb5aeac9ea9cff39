"""The bench's errors about what it was given, found before any hook runs: an output file that
cannot be written, and a ``--model`` that cannot be trained, each one line with the fix and a
non-zero exit, on one process and under torchrun."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from commhooks.bench import cli, world

ROOT = Path(__file__).resolve().parents[1]


# -- 11: output files ---------------------------------------------------------------------------
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
@pytest.mark.parametrize("flag", ["--json", "--plot"])
def test_an_unwritable_output_is_refused_before_the_run(flag, capsys):
    if flag == "--plot":
        pytest.importorskip("matplotlib")  # refused first for want of it otherwise
    path = "/proc/x.json" if flag == "--json" else "/proc/x.png"
    with pytest.raises(SystemExit) as exited:
        cli.main(["--hooks", "allreduce", "--steps", "2", flag, path])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"{flag} '{path}': it cannot be written" in err and "Traceback" not in err


def test_a_directory_is_refused_as_an_output_and_a_writable_path_leaves_nothing(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli.main(["--hooks", "allreduce", "--json", str(tmp_path)])
    assert f"is a directory: give a file in it, e.g. '{tmp_path}/bench.json'" in (
        capsys.readouterr().err
    )
    from commhooks.bench import args

    args.parse(["--hooks", "allreduce", "--json", str(tmp_path / "out.json")])
    assert list(tmp_path.iterdir()) == []  # the probe is gone, and no file was made


# -- 10: a --model the bench cannot train -------------------------------------------------------
_HEAD = "import torch\nfrom torch import nn\nfrom commhooks.bench.usermodel import BenchModel\n"
_BATCH = "def _batch(rank, step):\n    return torch.randn(4, 8)\n"

BAD_MODELS = {
    "raises_at_import": (
        "raise RuntimeError('no config file at /etc/model.yaml')\n",
        r"importing '\w+' raised RuntimeError: no config file at /etc/model\.yaml \(\w+\.py, "
        r"line 4\); fix the module until `python -c 'import \w+'` runs",
    ),
    "syntax_error": ("x = (\n", r"importing '\w+' raised SyntaxError: '\(' was never closed"),
    "returns_a_string": ("def make():\n    return 'model'\n", r"returned a str; return .*Bench"),
    "factory_raises": (
        "def make():\n    raise KeyError('weights')\n",
        r"calling the factory raised KeyError: 'weights' \(\w+\.py, line 5\); it must build",
    ),
    "frozen": (
        "def make():\n    m = nn.Linear(8, 1).requires_grad_(False)\n    return m, torch.ones(8)\n",
        "must be a torch.nn.Module with trainable parameters",
    ),
    "not_a_loss": (
        "def make():\n    return nn.Linear(8, 2), torch.ones(4, 8)\n",
        r"the model's output on its batch is \(4, 2\), not a loss",
    ),
    "make_batch_raises": (
        _BATCH.replace("return", "raise OSError('no data'); return")
        + "def make():\n    return BenchModel(nn.Linear(8, 1), _batch)\n",
        r"make_batch\(0, 0\) raised OSError: no data \(\w+\.py, line 5\); it must return a batch",
    ),
    "cuda_only": (
        "def make():\n    return nn.Linear(8, 1).cuda(), torch.ones(8)\n",
        r"calling the factory raised .*; this machine has no CUDA: build the model and its "
        r"batches on the CPU",
    ),
}


def _write(folder, case, source):
    name = f"bad_{case}_{os.getpid()}"
    (folder / f"{name}.py").write_text(_HEAD + source)
    return name


@pytest.mark.parametrize("case", list(BAD_MODELS))
def test_a_model_the_bench_cannot_train_is_one_line_and_exit_2(case, tmp_path, monkeypatch, capsys):
    if case == "cuda_only" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    monkeypatch.syspath_prepend(str(tmp_path))
    name = _write(tmp_path, case, BAD_MODELS[case][0])
    argv = ["--model", f"{name}:make", "--hooks", "allreduce", "--steps", "2", "--memory", "rss"]
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""  # nothing ran: no notes, no rows
    (line,) = err.splitlines()
    assert line.startswith(f"commhooks bench: --model '{name}:make'"), line
    assert re.search(BAD_MODELS[case][1], line), line


def _torchrun(folder, name):
    env = {k: v for k, v in os.environ.items() if k not in world.LAUNCHER_VARIABLES}
    paths = [str(ROOT / "src"), str(folder), env.get("PYTHONPATH", "")]
    env.update(PYTHONPATH=os.pathsep.join(paths), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", "-m", "commhooks", "bench", "--model", f"{name}:make", "--hooks", "allreduce",
           "--steps", "2"]  # fmt: skip
    return subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True, timeout=90)


_ON_RANK_1 = (
    "import os\n"
    + _BATCH.replace("return", "assert os.environ['RANK'] == '0', 'no shard'; return")
    + "def make():\n    return BenchModel(nn.Linear(8, 1), _batch, lambda m, b: m(b).mean())\n"
)
UNDER_TORCHRUN = {
    "syntax_error": BAD_MODELS["syntax_error"],
    "make_batch_on_rank_1": (
        _ON_RANK_1,
        r"make_batch\(1, 0\) raised AssertionError: no shard .*\(on rank 1 of 2\)$",
    ),
}


@pytest.mark.timeout(100)
@pytest.mark.parametrize("case", list(UNDER_TORCHRUN))
def test_under_torchrun_rank_0_says_it_in_one_line_and_every_rank_exits(case, tmp_path):
    source, says = UNDER_TORCHRUN[case]
    name = _write(tmp_path, case, source)
    proc = _torchrun(tmp_path, name)
    printed = proc.stdout + proc.stderr
    assert proc.returncode != 0, printed[-3000:]
    ours = [line for line in printed.splitlines() if line.startswith("commhooks bench:")]
    assert len(ours) == 1 and re.search(says, ours[0]), printed[-3000:]
    # the launcher's own report of a failed child follows; no traceback of ours does
    assert "commhooks/bench" not in printed and printed.count("Traceback") <= 1, printed[-3000:]
