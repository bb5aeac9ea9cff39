"""The bench's peak memory: an allocator that keeps nothing large after a free, so that two
runs of one hook agree and hooks can be ranked by what their steps hold live."""

import pytest
import torch

from commhooks.bench import footprint, hookset
from commhooks.bench.launcher import run_hook
from commhooks.bench.records import RunSpec
from commhooks.bench.rows import pool_memory_runs
from commhooks.bench.shape import Shape
from commhooks.testing import run_on_ranks

MiB = 1 << 20


def _written(nbytes):
    return torch.ones(nbytes // 4)  # every page written, so resident


def _resident_after_frees(rank, world_size):
    big = _written(8 * MiB)
    del big  # glibc unmaps it and raises its threshold to 8 MiB
    start = footprint.rss_bytes()
    block = _written(4 * MiB)  # under the raised threshold: from the heap
    del block
    kept = footprint.rss_bytes() - start
    mapped = footprint.map_large_allocations_afresh()
    start = footprint.rss_bytes()
    block = _written(16 * MiB)
    grown = footprint.rss_bytes() - start
    del block
    left = footprint.rss_bytes() - start
    return kept, mapped, grown, left


@pytest.mark.timeout(60)
def test_mapped_afresh_a_freed_block_leaves_the_resident_set():
    kept, mapped, grown, left = run_on_ranks(_resident_after_frees, 1)[0]
    assert kept > 3 * MiB  # why the bench needs it: a freed heap block stays resident
    assert mapped
    assert 15.5 * MiB < grown < 17 * MiB and left < 0.5 * MiB, (grown, left)


def _spec(hook):
    return RunSpec(
        hook=hook,
        options=hookset.settings_for(hook),
        task="synthetic",
        params=6_000_000,
        seed=0,
        steps=6,
        warmup=2,
        heldout_at=6,
        lr=1e-3,
        bucket_cap_mb=25.0,
        lockstep=True,
        live_memory=True,
    )


def _peaks(hook, runs=3):
    """Each rank's median peak over ``runs`` memory runs, as the bench pools its rounds."""
    outcomes = [run_hook(_spec(hook), Shape(2), timeout=240.0) for _ in range(runs)]
    assert all(o.ok for o in outcomes), [o.error for o in outcomes]
    per_run = [[r.peak_memory_bytes for r in o.ranks] for o in outcomes]
    return [r.peak_memory_bytes for r in pool_memory_runs(outcomes).ranks], per_run


@pytest.mark.timeout(300)
def test_memory_runs_repeat_and_rank_the_half_precision_hooks():
    # Issue 27's memory goals, measured as the bench measures them (6M parameters, 25 MB
    # buckets, the median of three runs): fp16 within 1.05x of PyTorch's fp16 hook, bf16 at
    # most fp16, to the 2% that runs of one hook agree to (the resident set alone moves by
    # 5%), which is what makes those comparisons decidable. A bound of 0.5 MiB (0.3%) was
    # below that: the same tree passed and failed it, by 0.8-1.0 MiB.
    fp16, runs = _peaks("fp16")
    assert all(abs(p - m) < 0.02 * m for run in runs for p, m in zip(run, fp16)), runs
    torch_fp16, bf16 = max(_peaks("torch_fp16")[0]), max(_peaks("bf16")[0])
    assert max(fp16) <= 1.05 * torch_fp16, (max(fp16) / MiB, torch_fp16 / MiB)
    assert bf16 <= 1.02 * max(fp16), (bf16 / MiB, max(fp16) / MiB)
