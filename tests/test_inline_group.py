"""The inline backend (commhooks.testing.inline_group): one rank whose collectives complete as
they are issued, as NCCL's futures do, for PyTorch's hooks and ours; each check in a process of
its own."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[1]


def test_collectives_complete_as_issued_and_hooks_run_on_it():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")])}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "inline_group_worker.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found == {
        "backend": "inline",
        "complete_when_issued": True,
        "gathered": [2.0, 2.0, 2.0],
        "torch_power_sgd_finite": True,  # many buckets: no hang, as on NCCL
        "allreduce_bitwise": True,  # our hooks, on the GPU's control flow
        "fp16_bitwise": True,
        "power_sgd_finite": True,
    }
