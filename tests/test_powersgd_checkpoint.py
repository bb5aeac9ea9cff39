"""Saving and resuming PowerSGD state: exact resume, other layouts and world sizes, bad dicts."""

import io
import os
import pickle
import warnings

import pytest
import torch
import torch.distributed as dist
from ddp_utils import IN, OUT, batches, flat_params, make_ddp, make_mlp

from commhooks import PowerSGDState, batched_powerSGD_hook, powerSGD_hook
from commhooks.state import StateDictError
from commhooks.testing import run_on_ranks

OPTIONS = dict(start_powerSGD_iter=3, matrix_approximation_rank=2)
# Two hidden layers of one shape: state applied to the wrong one would fit it without a warning.
WIDTHS = (IN, 64, 64, 64, OUT)
HALF = 8


def _train(ddp, opt, data):
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()


def _optimizer(ddp):
    return torch.optim.SGD(ddp.parameters(), lr=0.02, momentum=0.9)


def _original(
    rank,
    world_size,
    folder,
    options=OPTIONS,
    hook=powerSGD_hook,
    bucket_cap_mb=0.004,
    **ddp,
):
    data = batches(rank, 2 * HALF)
    model, state = make_mlp(widths=WIDTHS), PowerSGDState(None, **options)
    ddp = make_ddp(model, hook, state, bucket_cap_mb, **ddp)
    opt = _optimizer(ddp)
    _train(ddp, opt, data[:HALF])
    hook_state = state.state_dict()
    saved = {"model": model.state_dict(), "opt": opt.state_dict(), "hook": hook_state}
    torch.save(saved, os.path.join(folder, f"rank{rank}.pt"))
    _train(ddp, opt, data[HALF:])
    loaded = pickle.loads(pickle.dumps(state))  # where a default group exists, it binds to it
    bound = (
        loaded.process_group is dist.group.WORLD
        and loaded.error_dict.keys() == state.error_dict.keys()
    )
    return flat_params(model), len(state.error_dict), pickle.dumps(state), bound


def _resumed(
    rank, world_size, folder, bucket_cap_mb, options=OPTIONS, hook=powerSGD_hook, files=2, **ddp
):
    """Resume from the file of rank ``rank % files`` and train the second half again."""
    data = batches(rank, 2 * HALF)[HALF:]
    saved = torch.load(os.path.join(folder, f"rank{rank % files}.pt"), weights_only=True)
    # Other initial weights: everything must come from the file.
    model = make_mlp(seed=123, widths=WIDTHS)
    model.load_state_dict(saved["model"])
    state = PowerSGDState(None, **options)
    state.load_state_dict(saved["hook"])
    ddp = make_ddp(model, hook, state, bucket_cap_mb=bucket_cap_mb, **ddp)
    opt = _optimizer(ddp)
    opt.load_state_dict(saved["opt"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(ddp, opt, data)
    return flat_params(model), [str(w.message) for w in caught if "PowerSGD" in str(w.message)]


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("powersgd-ckpt"))
    return folder, run_on_ranks(_original, 2, folder)


def test_exact_resume_in_fresh_processes(original):
    folder, uninterrupted = original
    assert uninterrupted[0][1] > 0  # error memory existed when saved
    for (expected, *_), (params, messages) in zip(
        uninterrupted, run_on_ranks(_resumed, 2, folder, 0.004)
    ):
        assert torch.equal(params, expected)
        assert messages == []


def test_exact_resume_of_the_single_round_variant(tmp_path):
    # Its state also holds P and which factor each matrix refines next.
    options = {**OPTIONS, "single_round": True}
    uninterrupted = run_on_ranks(_original, 2, str(tmp_path), options)
    resumed = run_on_ranks(_resumed, 2, str(tmp_path), 0.004, options)
    for (expected, *_), (params, messages) in zip(uninterrupted, resumed):
        assert torch.equal(params, expected) and messages == []


@pytest.mark.parametrize(
    ("single_round", "bucket_cap_mb"), [(False, 100), (True, 100), (False, 0.004), (True, 0.004)]
)
def test_exact_resume_of_the_batched_hook(tmp_path, single_round, bucket_cap_mb):
    # A fresh DDP's first bucket holds every parameter, in another order than the rebuilt one
    # the state was saved with: the gradients are gathered in the saved order (one bucket), or
    # the bucket is cut into the saved run's buckets (several), whose states it meets.
    options = {**OPTIONS, "single_round": single_round}
    folder, cap = str(tmp_path), bucket_cap_mb
    uninterrupted = run_on_ranks(_original, 2, folder, options, batched_powerSGD_hook, cap)
    resumed = run_on_ranks(_resumed, 2, folder, cap, options, batched_powerSGD_hook)
    for (expected, memory, *_), (params, messages) in zip(uninterrupted, resumed):
        assert memory > 0 and torch.equal(params, expected) and messages == []


def test_exact_resume_on_four_ranks(tmp_path):
    # Gloo's ring sums an element in an order that depends on where it lies in the buffer:
    # the steps before DDP rebuilds its buckets are cut as the saved run's were.
    folder = str(tmp_path)
    uninterrupted = run_on_ranks(_original, 4, folder)
    resumed = run_on_ranks(_resumed, 4, folder, 0.004, files=4)
    for (expected, memory, *_), (params, messages) in zip(uninterrupted, resumed):
        assert memory > 0 and torch.equal(params, expected) and messages == []


def test_resume_with_other_bucket_size_fits_per_parameter_state(original):
    folder, uninterrupted = original
    for (expected, *_), (params, messages) in zip(
        uninterrupted, run_on_ranks(_resumed, 2, folder, 100)
    ):
        assert messages == []  # nothing reset: the state is per parameter, not per bucket
        # Each matrix is compressed on its own and sums are elementwise: same trajectory.
        assert torch.equal(params, expected)


@pytest.mark.parametrize(
    "saved, resumed",
    [((0.004, True), (100, True)), ((100, True), (0.004, True)), ((0.004, True), (0.004, False))],
)
def test_resume_with_unused_parameter_search_and_other_buckets(tmp_path, saved, resumed):
    # With find_unused_parameters=True, DDP's first step already runs in buckets of the
    # bucket_cap_mb given; each parameter must still find its own state.
    folder, options = str(tmp_path), {**OPTIONS, "single_round": True}
    first = run_on_ranks(
        _original, 2, folder, options, powerSGD_hook, saved[0], find_unused_parameters=saved[1]
    )
    second = run_on_ranks(
        _resumed, 2, folder, resumed[0], options, find_unused_parameters=resumed[1]
    )
    for (expected, memory, *_), (params, messages) in zip(first, second):
        assert memory > 0 and messages == []
        assert torch.equal(params, expected)


def _numbers(rank, world_size, bucket_cap_mb, find_unused):
    model, state = make_mlp(widths=WIDTHS), PowerSGDState(None, **OPTIONS)
    ddp = make_ddp(model, powerSGD_hook, state, bucket_cap_mb, find_unused_parameters=find_unused)
    _train(ddp, _optimizer(ddp), batches(rank, 1))
    return {name: state.numbering.number_of(p) for name, p in model.named_parameters()}


def test_parameters_are_numbered_from_the_last_whatever_the_first_buckets():
    order = [name for name, _ in make_mlp(widths=WIDTHS).named_parameters()]
    expected = {name: len(order) - 1 - i for i, name in enumerate(order)}
    for cap, unused in [(0.004, False), (0.004, True), (0.02, True), (100, True)]:
        assert run_on_ranks(_numbers, 1, cap, unused) == [expected], (cap, unused)


def _other_model(rank, world_size, folder):
    saved = torch.load(os.path.join(folder, f"rank{rank}.pt"), weights_only=True)
    return _warnings_after_loading(rank, saved["hook"], widths=(IN, 64, 64, 48, OUT))


def test_state_of_another_model_is_reset_naming_the_parameter(original):
    for messages in run_on_ranks(_other_model, 2, original[0]):
        # The last layer is 8 x 48 here, 8 x 64 in the file: the second parameter from the end.
        assert any(
            "(8, 64) for parameter #1 (counted from DDP's last parameter" in m
            and "does not fit its gradient now (8, 48)" in m
            for m in messages
        ), messages


class _Pickled:
    """Pickles as a PowerSGDState with the attributes ``attrs``, as earlier releases did."""

    def __init__(self, attrs):
        self.attrs = attrs

    def __reduce__(self):
        return (object.__new__, (PowerSGDState,), self.attrs)


def test_resume_with_other_world_size_resets_error_memory_with_warning(original):
    folder, _ = original
    results = run_on_ranks(_resumed, 3, folder, 0.004)
    for params, messages in results:
        assert torch.isfinite(params).all() and torch.equal(params, results[0][0])
        assert len(messages) == 1
        assert "error-feedback memory" in messages[0] and "world size 2" in messages[0]
        assert "with 3" in messages[0] and "reset" in messages[0]


def _warnings_after_loading(rank, saved, widths=WIDTHS):
    """PowerSGD's warnings over two steps of a model of ``widths`` with ``saved`` loaded."""
    state = PowerSGDState(None, **OPTIONS)
    state.load_state_dict(saved)
    ddp = make_ddp(make_mlp(widths=widths), powerSGD_hook, state)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(ddp, _optimizer(ddp), batches(rank, 2))
    return [str(w.message) for w in caught if "PowerSGD" in str(w.message)]


def _one_file_for_all(rank, world_size, folder):
    # What a checkpoint written by one rank for all (Accelerate's save_state with the state
    # registered as it is) hands every rank: rank 0's state.
    return _warnings_after_loading(rank, _saved_state(folder))


def test_memory_saved_by_another_rank_is_reset_with_a_warning(original):
    folder, _ = original
    first, second = run_on_ranks(_one_file_for_all, 2, folder)
    assert first == []  # rank 0 gets its own memory back
    assert len(second) == 1 and "saved by rank 0 and loaded by rank 1" in second[0]
    assert "PerRankState" in second[0] and "reset" in second[0]


def test_a_state_past_its_start_without_memory_warns_on_load(original):
    folder, _ = original
    saved = {**_saved_state(folder), "error": {}}
    with pytest.warns(UserWarning, match="holds no error-feedback memory"):
        PowerSGDState(None, **OPTIONS).load_state_dict(saved)


def _saved_state(folder):
    return torch.load(os.path.join(folder, "rank0.pt"), weights_only=True)["hook"]


def _snapshot(state):
    buf = io.BytesIO()
    torch.save(state.state_dict(), buf)
    return buf.getvalue()


def test_state_dict_loads_with_weights_only_and_round_trips(original):
    sd = _saved_state(original[0])
    assert sd["kind"] == "powersgd" and sd["iter"] == HALF and sd["error"]
    state = PowerSGDState(None, **OPTIONS)
    state.load_state_dict(sd)
    again = state.state_dict()
    assert again["rng"]["pos"] == sd["rng"]["pos"]
    assert torch.equal(again["rng"]["keys"], sd["rng"]["keys"])
    for name in ("error", "q", "p"):
        assert again[name].keys() == sd[name].keys()
        assert all(torch.equal(again[name][k], sd[name][k]) for k in sd[name])


def test_pickled_state_drops_group_and_rebinds(original):
    assert all(rank[3] for rank in original[1])  # unpickled in the ranks: the default group
    state = pickle.loads(original[1][0][2])  # here: the default group if one is left, else None
    assert state.process_group is (dist.group.WORLD if dist.is_initialized() else None)
    assert state.iter == 2 * HALF
    assert state.error_dict and all(torch.isfinite(t).all() for t in state.error_dict.values())
    with pytest.raises(TypeError, match="ProcessGroup or None"):
        state.bind("not a group")


def _broken(sd, what):
    sd = dict(sd)
    if what == "missing-rng":
        del sd["rng"]
    elif what == "bad-tensor":
        sd["error"] = {**sd["error"], "0": "not a tensor"}
    elif what == "bad-iter":
        sd["iter"] = -4
    elif what == "bad-buckets":
        sd["buckets"] = [[0, 1], [1]]
    return sd


@pytest.mark.parametrize(
    ("what", "match"),
    [
        ("missing-rng", "malformed PowerSGD state dict.*'rng'"),
        ("bad-tensor", r"malformed.*error\['0'\] must be a floating-point tensor"),
        ("bad-iter", "malformed.*iter must be an integer >= 0"),
        ("bad-buckets", "malformed.*'buckets' names a parameter in two buckets"),
    ],
)
def test_malformed_state_dict_raises_and_changes_nothing(original, what, match):
    state = PowerSGDState(None, **OPTIONS)
    state.load_state_dict(_saved_state(original[0]))
    before = _snapshot(state)
    with pytest.raises(StateDictError, match=match):
        state.load_state_dict(_broken(_saved_state(original[0]), what))
    assert _snapshot(state) == before


def test_foreign_state_dicts_are_named(original):
    state = PowerSGDState(None, **OPTIONS)
    before = _snapshot(state)
    with pytest.raises(StateDictError, match="saved by a 'post_local_sgd' state"):
        state.load_state_dict({"kind": "post_local_sgd", "version": 1})
    with pytest.raises(StateDictError, match="not a commhooks state dict"):
        state.load_state_dict(make_mlp(widths=WIDTHS).state_dict())
    other = PowerSGDState(None, start_powerSGD_iter=3, matrix_approximation_rank=4)
    with pytest.raises(StateDictError, match="matrix_approximation_rank: saved 2, here 4"):
        other.load_state_dict(_saved_state(original[0]))
    assert _snapshot(state) == before


def _reject_other_options(rank, world_size):
    state = PowerSGDState(None, start_powerSGD_iter=0, matrix_approximation_rank=1 + rank)
    ddp = make_ddp(make_mlp(widths=WIDTHS), powerSGD_hook, state)
    x, y = batches(rank, 1)[0]
    torch.nn.functional.mse_loss(ddp(x), y).backward()
    dist.barrier()


def test_options_differing_between_ranks_are_named():
    with pytest.raises(Exception, match="matrix_approximation_rank: rank 0=1, rank 1=2"):
        run_on_ranks(_reject_other_options, 2)
