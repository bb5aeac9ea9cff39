"""The compression core's small parts, each in one process: options, error memory, tensor checks."""

import dataclasses
import warnings
from typing import ClassVar

import numpy as np
import pytest
import torch

from commhooks.compress.error_feedback import ErrorFeedback
from commhooks.options import Options, flag, integer, one_of, option, real
from commhooks.state import StateDictError, check_count, check_tensor


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Demo(Options):
    owner: ClassVar[str] = "DemoState"
    rank: int = option(1, "lower rank => more compression", check=integer(1, hint="try 1 or 2"))
    rate: float = option(2, "minimum gain", check=real(minimum=1, keep_int=True))
    feedback: bool = option(True, "remember what was dropped", check=flag(strict=False))
    bits: int = option(8, "bits per element", check=one_of(4, 8))
    period: int = option(reason="steps between averages", check=integer(minimum=1))

    def check_together(self) -> None:
        if self.bits == 4 and not self.feedback:
            raise ValueError("DemoState: bits=4 needs feedback=True.")


def test_options_normalise_and_describe_themselves() -> None:
    o = _Demo(period=np.int64(3), feedback=np.bool_(False), rate=3)
    assert (o.period, type(o.period), o.feedback, o.rate) == (3, int, False, 3)
    assert _Demo.names() == ("rank", "rate", "feedback", "bits", "period")
    assert _Demo.required() == frozenset({"period"})
    assert _Demo.defaults()["rank"] == 1 and "period" not in _Demo.defaults()
    assert _Demo.reason("rank") == "lower rank => more compression"
    assert o.as_dict()["period"] == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.rank = 2  # type: ignore[misc]


@pytest.mark.parametrize(
    ("values", "words"),
    [
        ({"rank": 0}, "rank must be an integer >= 1 (try 1 or 2); got rank=0"),
        ({"rank": True}, "got rank=True"),
        ({"rate": float("nan")}, "rate must be a finite number >= 1"),
        ({"feedback": "False"}, "feedback must be True or False"),
        ({"bits": 2}, "bits must be one of 4, 8"),
        ({"bits": 4, "feedback": False}, "bits=4 needs feedback=True"),
    ],
)
def test_options_refuse_bad_values_with_the_fix(values: dict[str, object], words: str) -> None:
    with pytest.raises(ValueError, match="DemoState") as info:
        _Demo(period=1, **values)  # type: ignore[arg-type]
    assert words in str(info.value)


def test_options_from_mapping_suggests_the_nearest_name() -> None:
    with pytest.raises(ValueError, match="Did you mean 'rank'"):
        _Demo.from_mapping({"rnak": 2, "period": 1})
    with pytest.raises(ValueError, match="'period' has no default"):
        _Demo.from_mapping({})
    assert _Demo.from_mapping({"period": 2}).replace(rank=4).rank == 4


def test_memory_compensates_and_records() -> None:
    memory = ErrorFeedback("DemoState")
    grad = torch.ones(2, 3)
    assert memory.compensate_all_(["w"], [grad]) == [False]
    memory.record("w", torch.full((2, 3), 0.5))
    assert memory.compensate_all_(["w"], [grad]) == [True]
    assert torch.equal(grad, torch.full((2, 3), 1.5))


def test_memory_drops_residuals_that_do_not_fit() -> None:
    memory = ErrorFeedback("DemoState")
    memory.record(0, torch.ones(4))
    with pytest.warns(UserWarning, match="does not fit"):
        assert memory.get(0, torch.zeros(5)) is None
    assert len(memory) == 0


def test_memory_state_dict_round_trip_and_refusals() -> None:
    memory = ErrorFeedback("DemoState")
    base = torch.arange(6.0)
    memory.record(3, base[2:4])  # a view: only its own elements are saved
    saved = memory.state_dict()
    assert saved["3"].untyped_storage().nbytes() == 2 * 4
    other = ErrorFeedback("DemoState")
    other.load_state_dict(saved, int, "DemoState 'error'")
    assert torch.equal(other.get(3, torch.zeros(2)), torch.tensor([2.0, 3.0]))  # type: ignore[arg-type]
    for bad in (
        {"x": torch.zeros(2)},
        {"1": torch.tensor([float("inf")])},
        {"1": torch.zeros(1).expand(10**9)},
        {"1": torch.zeros(2, dtype=torch.int64)},
        {"1": [0.0]},
    ):
        with pytest.raises(StateDictError, match="DemoState 'error'"):
            other.load_state_dict(bad, int, "DemoState 'error'")
    assert 3 in other  # a refused dict changed nothing


def test_check_tensor_and_count() -> None:
    ok = torch.zeros(2, 3)
    assert check_tensor("e", ok, dtype=torch.float32, shape=(2, 3)) is ok
    with pytest.raises(StateDictError, match="shape"):
        check_tensor("e", ok, shape=(3, 2))
    with pytest.raises(StateDictError, match="dense, contiguous"):
        check_tensor("e", ok.t())
    with pytest.raises(StateDictError, match="dense, contiguous"):
        check_tensor("e", ok.to_sparse())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_tensor("e", torch.tensor([float("nan")]), finite=False)
    assert check_count("iter", 5) == 5 and check_count("iter", torch.tensor(2)) == 2
    for bad in (float("inf"), 1.5, True, -1, "3", None):
        with pytest.raises(StateDictError, match="iter must be an integer"):
            check_count("iter", bad)


def test_numbering_counts_from_the_last_parameter_whatever_the_buckets() -> None:
    from commhooks.numbering import ParameterNumbering

    params = [torch.zeros(1) for _ in range(5)]
    whole = ParameterNumbering()
    assert whole.numbers(params) == (4, 3, 2, 1, 0)
    split = ParameterNumbering()  # buckets of runs of consecutive parameters, the last run first
    assert split.numbers(params[3:]) == (1, 0)
    assert split.numbers(params[:3]) == (4, 3, 2)
    assert split.numbers(params[1:4]) == (3, 2, 1) and split.number_of(params[0]) == 4
    assert "last" in whole.describe(0)


def test_a_loaded_memory_is_checked_once_at_its_first_use_only() -> None:
    calls: list[float] = []

    def plausible(residual: torch.Tensor, gradient: torch.Tensor) -> bool:
        calls.append(float(residual.abs().max()))
        return float(residual.abs().max()) <= 10 * float(gradient.abs().max())

    saved = {"1": torch.full((3,), 1e6), "2": torch.full((3,), 0.5), "3": torch.ones(3)}
    memory = ErrorFeedback("DemoState", plausible=plausible)
    memory.load_state_dict(saved, int, "'error'")
    assert memory.awaits_check
    with pytest.warns(UserWarning, match=r"DemoState: the loaded .* \(key '1'\) is out of all"):
        assert memory.compensate_all_([1], [torch.ones(3)]) == [False]  # reset, not added
    assert 1 not in memory and memory.compensate_all_([2], [torch.ones(3)]) == [True]
    memory.record(3, torch.zeros(3))  # recorded since the load: never checked
    assert not memory.awaits_check and len(calls) == 2
    for _ in range(3):
        memory.compensate_all_([2], [torch.ones(3)])
    assert len(calls) == 2  # later steps check nothing
    trusting = ErrorFeedback("DemoState")  # no bound given: loaded memories are trusted
    trusting.load_state_dict(saved, int, "'error'")
    assert not trusting.awaits_check


def test_memory_holds_only_the_very_tensors_recorded_and_records_many_at_once() -> None:
    memory = ErrorFeedback("DemoState", plausible=lambda residual, gradient: True)
    views = [torch.zeros(4), torch.zeros(2)]
    assert not memory.holds([1, 2], views)  # nothing recorded yet
    memory.record_all([1, 2], views)
    assert memory.holds([1, 2], views) and memory.items() == [(1, views[0]), (2, views[1])]
    assert not memory.holds([1, 2], [views[0], views[1].clone()])  # equal, not the same
    assert not memory.holds([2, 1], views) and not memory.holds([1], views)
    memory.load_state_dict({"1": torch.ones(4), "2": torch.ones(2)}, int, "'error'")
    assert not memory.holds([1, 2], views)  # replaced by what was loaded
    loaded = [memory.get(1, views[0]), memory.get(2, views[1])]
    assert not memory.holds([1, 2], loaded)  # held, but awaiting its check: looked up
    memory.record_all([1, 2], views)  # recorded since the load: checked, held again
    assert not memory.awaits_check and memory.holds([1, 2], views)


def test_memories_that_met_no_gradient_in_a_whole_step_are_dropped_and_the_rest_kept() -> None:
    memory = ErrorFeedback("DemoState", plausible=lambda residual, gradient: True)
    memory.load_state_dict({"1": torch.ones(2), "2": torch.ones(2)}, int, "'error'")
    for step in (5, 6):  # the first step after the load, its last bucket counted
        memory.forget_unmet(step)
        memory.compensate_all_([1], [torch.zeros(2)])  # 1 meets its gradient, 2 never does
    assert memory.awaits_check and sorted(memory) == [1, 2]
    with pytest.warns(
        UserWarning,
        match=r"DemoState: 1 loaded error-feedback memory met .* whole step \(2; keys \[2\]\)",
    ):
        memory.forget_unmet(7)
    assert list(memory) == [1] and not memory.awaits_check
