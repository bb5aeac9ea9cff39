"""Streaming DiLoCo against careless or hostile input: models with empty modules, state dicts
that do not fit the model or hold absurd settings, and workers whose models differ."""

import pytest
import torch
from torch import nn

import commhooks
from commhooks.diloco import split_by_module
from commhooks.testing import run_on_ranks

pytestmark = pytest.mark.timeout(60)


class _EmptyLast(nn.Module):
    """A model whose last module holds no element (a head of width 0), still in the graph."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(8, 16)
        self.mid = nn.Linear(16, 4)
        self.empty = nn.Linear(4, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.mid(torch.relu(self.body(x)))
        return torch.cat([y, self.empty(y)], dim=1)


def _empty_model() -> nn.Module:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "Initializing zero-element tensors"
        return _EmptyLast()


# -- 4: modules of no elements ------------------------------------------------------------------
def test_a_module_of_no_elements_joins_the_fragment_before_it():
    named = list(_empty_model().named_parameters())
    assert split_by_module(named, 1) == [[n for n, _ in named]]
    assert split_by_module(named, 2) == [
        ["body.weight", "body.bias"],
        ["mid.weight", "mid.bias", "empty.weight", "empty.bias"],
    ]
    first = [("a.weight", torch.zeros(0)), *named]  # first in line: joins fragment 0
    assert split_by_module(first, 2)[0][0] == "a.weight"
    with pytest.raises(ValueError, match=r"lie in 2 modules \(of 3\); pass fragments <= 2"):
        split_by_module(named, 3)
    with pytest.raises(ValueError, match=r"fragment\(s\) \[1\] hold only parameters of no"):
        split_by_module(named, (("body", "mid"), ("empty",)))


def _train_empty_last(rank, world_size, bits):
    model = _empty_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    diloco = commhooks.StreamingDiLoCo(sync_every=2, fragments=2, bits=bits)
    diloco.attach(inner, model.named_parameters())
    gen = torch.Generator().manual_seed(rank)
    for _ in range(4):
        inner.zero_grad()
        model(torch.randn(4, 8, generator=gen)).square().mean().backward()
        inner.step()
    diloco.finish()
    return diloco.plan, diloco.snapshot


@pytest.mark.parametrize("bits", [None, 4])
def test_a_model_whose_last_module_has_no_elements_trains(bits):
    (plan, first), (_, second) = run_on_ranks(_train_empty_last, 2, bits)
    assert plan[1][-2:] == ["empty.weight", "empty.bias"]
    start = dict(_empty_model().named_parameters())
    for name, value in first.items():  # both fragments synced: the same global parameters
        assert torch.equal(value, second[name]), name
        assert value.numel() == 0 or not torch.equal(value, start[name]), name
