"""Models for ``commhooks bench --model`` in the tests: each factory shows one form of the
protocol (``commhooks.bench.usermodel``), or one way a user's model can go wrong.

Under torchrun a factory is called once on every rank to check it before anything runs, then
once per hook (each hook's model is built afresh), in the order of ``--hooks``: the faulty
factory counts its calls to fail on given hooks only, and reads ``RANK`` to fail on one rank
only.
"""

import os
import time
from typing import Any

import torch
from torch import nn

from commhooks.bench.usermodel import BenchModel

WIDTH = 32
_calls = {"n": 0}


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(WIDTH, 64), nn.ReLU(), nn.Linear(64, 4))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(16, WIDTH, generator=gen)
    return x, (x[:, :4].sum(dim=1) > 0).long()


def _cross_entropy(model: nn.Module, batch: Any) -> torch.Tensor:
    inputs, targets = batch
    return nn.functional.cross_entropy(model(inputs), targets)


def classifier() -> BenchModel:
    """The full protocol: a model, a batch per rank and step, a loss."""
    return BenchModel(_mlp(), _batch, loss=_cross_entropy)


class _WithLoss(nn.Module):
    """A model whose forward returns its own loss, as many training codebases do."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _mlp()

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.net(inputs), targets)


def model_and_batch() -> tuple[nn.Module, Any]:
    """The short form: a model that returns its loss, and one batch used every step."""
    return _WithLoss(), _batch(0, 0)


def no_loss() -> tuple[nn.Module, Any]:
    """A model whose output is not a loss, and no loss given: refused with the fix."""
    return _mlp(), _batch(0, 0)[0]


def not_a_model() -> str:
    return "a string"


def _hook_on_rank_1(number: int) -> bool:
    """Whether this call builds the ``number``-th hook's model (from 1) on rank 1 (the first
    call is the bench's check of the factory)."""
    return _calls["n"] == number + 1 and os.environ.get("RANK") == "1"


def _stalls(make_batch_at_2: Any) -> BenchModel:
    def make_batch(rank: int, step: int) -> Any:
        if step == 2:
            make_batch_at_2()
        return _batch(rank, step)

    return BenchModel(_mlp(), make_batch, loss=_cross_entropy)


def _corrupt() -> None:
    raise ValueError("batch 2 is corrupt")


def _hang() -> None:
    time.sleep(3600)


def raises_then_hangs() -> BenchModel:
    """On rank 1, the batch maker raises at step 2 of the third hook's run and sleeps for an
    hour at step 2 of the fourth's; every other run trains normally."""
    _calls["n"] += 1
    if _hook_on_rank_1(3):
        return _stalls(_corrupt)
    if _hook_on_rank_1(4):
        return _stalls(_hang)
    return classifier()
