"""The quantized hook and PyTorch's uint8 drop-ins on real gloo ranks (world sizes 2 and 3).

Starting ranks costs more than the checks, so one run per world size makes every measurement
(``_measure``) and each test asserts on its share; the arithmetic they are held to (exact
averages, PyTorch's reference algorithm) is computed here, in the test process.
"""

import os
import pickle
import warnings

import pytest
import torch
from ddp_utils import FakeBucket, batches, flat_params, make_ddp, make_mlp, train

from commhooks import (
    QuantizationState,
    StateDictError,
    allreduce_hook,
    quantization_perchannel_hook,
    quantization_pertensor_hook,
    quantized_hook,
    register,
)
from commhooks.testing import run_on_ranks

LENGTHS = (1, 7, 300, 1031)
BLOCK = 64
ENV = {"OMP_NUM_THREADS": "1"}


def _grad(rank: int, n: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rank ``rank``'s gradient: deterministic, different per rank, of widely varying size."""
    gen = torch.Generator().manual_seed(1000 * seed + 10 * rank + n)
    return (torch.randn(n, generator=gen) * torch.linspace(0.01, 3, n)).to(dtype)


def _call(hook, state, bucket) -> torch.Tensor:
    return hook(state, bucket).wait().clone()


# -- what the ranks measure ----------------------------------------------------------------------
def _single_steps(rank: int) -> dict:
    """One fresh step per bucket length, bits and dtype, plus an empty bucket."""
    out = {}
    for bits in (8, 4):
        state = QuantizationState(None, bits=bits, block_size=BLOCK)
        for i, n in enumerate(LENGTHS):
            for dtype in (torch.float32, torch.float16, torch.bfloat16):
                bucket = FakeBucket([_grad(rank, n, dtype=dtype)], index=i)
                out[bits, n, dtype] = _call(quantized_hook, state, bucket)
        out[bits, 0] = _call(quantized_hook, state, FakeBucket([], index=9))
    return out


def _feedback_trace(rank: int, steps: int, constant: bool, bits: int) -> list[dict]:
    """Per step: the gradient, what was applied, and both memories after the step."""
    state = QuantizationState(None, bits=bits, block_size=BLOCK)
    bucket = FakeBucket([torch.zeros(300)])
    trace = []
    for step in range(steps):
        grad = _grad(rank, 300, seed=0 if constant else step)
        bucket.set_buffer(grad.clone())
        applied = _call(quantized_hook, state, bucket)
        trace.append(
            {
                "applied": applied,
                "error": {k: t.clone() for k, t in state.error.items()},
                "owner_error": {k: t.clone() for k, t in state.owner_error.items()},
            }
        )
    return trace


def _non_finite(rank: int) -> dict:
    """A finite step, then a step with inf and NaN, against plain allreduce of the same; with
    the defaults, and with the repair."""
    out: dict = {}
    for policy in ("propagate", "repair"):
        state = QuantizationState(None, bits=4, block_size=BLOCK, on_nonfinite=policy)
        bucket = FakeBucket([_grad(rank, 300)])
        _call(quantized_hook, state, bucket)
        before = state.state_dict()
        bad = _grad(rank, 300, seed=1)
        bad[5 + rank] = float("nan")
        bad[200] = float("inf") if rank == 0 else -float("inf")  # inf + -inf: NaN
        bad[250] = float("inf")
        bucket.set_buffer(bad.clone())
        result = _call(quantized_hook, state, bucket)
        plain = _call(allreduce_hook, None, FakeBucket([bad.clone()]))
        out[policy] = {"result": result, "plain": plain, "before": before}
        out[policy]["after"] = state.state_dict()
    return out


def _warmup(rank: int) -> dict:
    state = QuantizationState(None, warmup_steps=2)
    bucket = FakeBucket([torch.zeros(100)])
    out = []
    for step in range(3):
        grad = _grad(rank, 100, seed=step)
        bucket.set_buffer(grad.clone())
        out.append(
            (_call(quantized_hook, state, bucket), _call(allreduce_hook, None, FakeBucket([grad])))
        )
    return {"steps": out, "iter": state.iter}


def _drop_ins(rank: int) -> dict:
    from torch.distributed.algorithms.ddp_comm_hooks import quantization_hooks as theirs

    out = {}
    for n in (1000, 1031):
        grad = _grad(rank, n)
        out["tensor", n] = _call(quantization_pertensor_hook, None, FakeBucket([grad]))
        out["channel", n] = _call(quantization_perchannel_hook, None, FakeBucket([grad]))
        bucket = FakeBucket([grad])
        out["channel7", n] = (
            quantization_perchannel_hook(None, bucket, bucket_size=7).wait().clone()
        )
    try:
        theirs.quantization_pertensor_hook(None, FakeBucket([_grad(rank, 100)])).wait()
        out["pytorch"] = "ran"
    except Exception as exc:  # noqa: BLE001 - the failure is what is measured
        out["pytorch"] = f"{type(exc).__name__}: {exc}"
    return out


def _training(rank: int) -> dict:
    out = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name in ("allreduce", "int8", "int4"):
            ddp = make_ddp(make_mlp())  # several buckets, rebuilt after the first step
            state = register(ddp, name)
            out[name] = (train(ddp, batches(rank, 8)), flat_params(ddp.module))
            if name != "allreduce":
                out[name + " memory"] = (len(state.error), state.iter)
    out["warnings"] = [str(w.message) for w in caught if "Quantization" in str(w.message)]
    for hook in (quantization_pertensor_hook, quantization_perchannel_hook):
        ddp = make_ddp(make_mlp(), hook)
        out[hook.__name__] = (train(ddp, batches(rank, 3)), flat_params(ddp.module))
    return out


def _measure(rank: int, world_size: int) -> dict:
    return {
        "single": _single_steps(rank),
        "feedback": _feedback_trace(rank, 4, constant=False, bits=8),
        "constant": _feedback_trace(rank, 20, constant=True, bits=4),
        "non_finite": _non_finite(rank),
        "warmup": _warmup(rank),
        "drop_ins": _drop_ins(rank),
        "training": _training(rank),
    }


@pytest.fixture(scope="module", params=[2, 3])
def measured(request) -> tuple[int, list[dict]]:
    world = request.param
    return world, run_on_ranks(_measure, world, env=ENV, timeout=300)


# -- the tests -------------------------------------------------------------------------------------
def _same_on_every_rank(values: list[torch.Tensor]) -> bool:
    return all(torch.equal(v, values[0]) for v in values)


def test_single_step_is_within_the_bound_and_the_same_on_every_rank(measured):
    world, ranks = measured
    for bits in (8, 4):
        qmax = 127 if bits == 8 else 7
        for n in LENGTHS:
            grads = [_grad(r, n) for r in range(world)]
            exact = torch.stack(grads).mean(0)
            # Per element: half a step of each quantization; the average's block absmax is at
            # most the mean of the ranks' (see quantized_hook).
            padded = (n + BLOCK - 1) // BLOCK * BLOCK
            absmax = torch.stack([torch.nn.functional.pad(g, (0, padded - n)) for g in grads])
            absmax = absmax.abs().view(world, -1, BLOCK).amax(2).mean(0)
            bound = absmax.repeat_interleave(BLOCK)[:n] / qmax * (1 + 1e-5)
            for dtype in (torch.float32, torch.float16, torch.bfloat16):
                results = [r["single"][bits, n, dtype] for r in ranks]
                assert _same_on_every_rank(results), (bits, n, dtype)
                assert results[0].dtype == dtype and results[0].shape == (n,)
                rounding = 0 if dtype == torch.float32 else torch.finfo(dtype).eps * exact.abs()
                if dtype != torch.float32:  # the inputs were rounded to dtype first
                    exact = torch.stack([_grad(r, n, dtype=dtype).float() for r in range(world)])
                    exact = exact.mean(0)
                error = (results[0].float() - exact).abs()
                assert bool((error <= bound + 2 * rounding).all()), (bits, n, dtype)
            if n > 1:
                assert results[0].float().sub(exact).abs().max() > 0  # it did quantize
        assert all(r["single"][bits, 0].numel() == 0 for r in ranks)


def _memory_total(trace_step: list[dict], n: int) -> torch.Tensor:
    """The ranks' mean first memory plus the owners' second memory, as one vector."""
    world = len(trace_step)
    total = sum(s["error"].get(0, torch.zeros(n)) for s in trace_step) / world
    for s in trace_step:
        for key, piece in s["owner_error"].items():
            first, stop = map(int, key.split(":")[1].split("-"))
            total[first:stop] += piece
    return total


def test_error_feedback_keeps_what_quantization_dropped(measured):
    world, ranks = measured
    previous = torch.zeros(300)
    for step in range(4):
        per_rank = [r["feedback"][step] for r in ranks]
        assert _same_on_every_rank([s["applied"] for s in per_rank])
        exact = torch.stack([_grad(r, 300, seed=step) for r in range(world)]).mean(0)
        memory = _memory_total(per_rank, 300)
        assert memory.abs().max() > 0
        torch.testing.assert_close(
            per_rank[0]["applied"] + memory, exact + previous, rtol=0, atol=1e-5
        )
        previous = memory


def test_error_feedback_averages_a_constant_gradient_exactly_over_steps_at_int4(measured):
    world, ranks = measured
    true = torch.stack([_grad(r, 300) for r in range(world)]).mean(0)
    applied = torch.stack([s["applied"] for s in ranks[0]["constant"]])
    one_step = (applied[0] - true).norm() / true.norm()
    mean = (applied.mean(0) - true).norm() / true.norm()
    assert mean <= 0.02 and mean < one_step / 4, (mean, one_step)


def test_non_finite_gradients_come_out_non_finite_and_spare_the_memory(measured):
    _, ranks = measured
    for r in ranks:
        for policy, found in r["non_finite"].items():
            result, plain = found["result"], found["plain"]
            if policy == "repair":  # sent again as plain allreduce
                torch.testing.assert_close(result, plain, rtol=0, atol=0, equal_nan=True)
            else:  # non-finite wherever plain allreduce is, as decoded from its blocks
                assert not result[~plain.isfinite()].isfinite().any()
            before, after = found["before"], found["after"]
            assert before["error"].keys() == after["error"].keys()
            assert all(torch.equal(before["error"][k], after["error"][k]) for k in before["error"])
            assert all(
                torch.equal(before["owner_error"][k], after["owner_error"][k])
                for k in before["owner_error"]
            )


def test_warmup_steps_are_plain_allreduce(measured):
    _, ranks = measured
    for r in ranks:
        steps = r["warmup"]["steps"]
        assert all(torch.equal(mine, plain) for mine, plain in steps[:2])
        assert not torch.equal(*steps[2])
        assert r["warmup"]["iter"] == 3


def _reference(grads: list[torch.Tensor], channel: int | None) -> torch.Tensor:
    """PyTorch's algorithm, step by step, with its own observers and backend functions."""
    from torch.ao.quantization import MinMaxObserver, PerChannelMinMaxObserver
    from torch.distributed.algorithms.ddp_comm_hooks import quantization_hooks as theirs

    total = None
    for g in grads:
        if channel is None:
            observer = MinMaxObserver()
            observer(g)
            s, z = observer.calculate_qparams()
            sz = torch.FloatTensor([s, z])
            q = theirs._quantize_per_tensor_backend(g, sz[0], sz[1])
            part = theirs._dequantize_per_tensor_backend(q, sz[0], sz[1])
        else:
            pad = channel - len(g) % channel
            rows = torch.nn.functional.pad(g, (0, pad)).view(-1, channel)
            observer = PerChannelMinMaxObserver()
            observer(rows)
            sz = torch.stack(observer.calculate_qparams())
            q = theirs._quantize_per_channel_backend(rows, sz[0], sz[1])
            part = theirs._dequantize_per_channel_backend(q, sz[0], sz[1])
        total = part if total is None else total + part
    return torch.flatten(total)[: len(grads[0])] / len(grads)


def test_drop_ins_compute_pytorchs_numbers_on_gloo_where_pytorchs_fail(measured):
    world, ranks = measured
    for n in (1000, 1031):
        grads = [_grad(r, n) for r in range(world)]
        for kind, channel in (("tensor", None), ("channel", 512), ("channel7", 7)):
            results = [r["drop_ins"][kind, n] for r in ranks]
            assert _same_on_every_rank(results)
            assert torch.equal(results[0], _reference(grads, channel)), (kind, n)
    assert all("IndexError" in r["drop_ins"]["pytorch"] for r in ranks)


def test_training_with_registered_names_stays_in_sync(measured):
    _, ranks = measured
    for name in ("int8", "int4"):
        assert _same_on_every_rank([r["training"][name][1] for r in ranks])
        mine, plain = ranks[0]["training"][name][1], ranks[0]["training"]["allreduce"][1]
        assert 0 < (mine - plain).abs().max() < 0.05
        assert ranks[0]["training"][name + " memory"] == (8, 8)  # a memory for each parameter
        losses, plain_losses = ranks[0]["training"][name][0], ranks[0]["training"]["allreduce"][0]
        assert max(abs(a - b) for a, b in zip(losses, plain_losses)) < 0.01
    assert all(r["training"]["warnings"] == [] for r in ranks)
    for hook in (quantization_pertensor_hook, quantization_perchannel_hook):  # on DDP, on gloo
        assert _same_on_every_rank([r["training"][hook.__name__][1] for r in ranks])


# -- checkpoints -----------------------------------------------------------------------------------
CHECKPOINTED = {
    "int8": {},
    "int4_stochastic": {"bits": 4, "rounding": "stochastic"},
    # Parameters numbered in the warm-up's first buckets, as after the restart (numbered in
    # the buckets DDP rebuilt, every memory was taken for another model's and reset).
    "int8_warmup": {"warmup_steps": 2},
}
HALF = 4


def _optimizer(ddp):
    return torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)


def _original(rank, world_size, folder):
    out = {}
    for name, options in CHECKPOINTED.items():
        model, state = make_mlp(), QuantizationState(None, **options)
        ddp = make_ddp(model, quantized_hook, state, bucket_cap_mb=25)
        opt = _optimizer(ddp)
        train(ddp, batches(rank, HALF), optimizer=opt)
        saved = {"model": model.state_dict(), "opt": opt.state_dict(), "hook": state.state_dict()}
        torch.save(saved, os.path.join(folder, f"{name}-{rank}.pt"))
        train(ddp, batches(rank, 2 * HALF)[HALF:], optimizer=opt)
        copy = pickle.loads(pickle.dumps(state))
        out[name] = flat_params(model), copy.state_dict(), state.state_dict()
    return out


def _resumed(rank, world_size, folder):
    out = {}
    for name, options in CHECKPOINTED.items():
        saved = torch.load(os.path.join(folder, f"{name}-{rank}.pt"), weights_only=True)
        model = make_mlp(seed=7)
        model.load_state_dict(saved["model"])
        state = QuantizationState(None, **options)
        state.load_state_dict(saved["hook"])
        ddp = make_ddp(model, quantized_hook, state, bucket_cap_mb=25)
        opt = _optimizer(ddp)
        opt.load_state_dict(saved["opt"])
        train(ddp, batches(rank, 2 * HALF)[HALF:], optimizer=opt)
        out[name] = flat_params(model)
    # The other rank's file: its memories are not this rank's, and are reset with a warning.
    other = QuantizationState(None)
    saved = torch.load(os.path.join(folder, f"int8-{1 - rank}.pt"), weights_only=True)
    other.load_state_dict(saved["hook"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quantized_hook(other, FakeBucket([torch.ones(10)])).wait()
    out["moved"] = len(other.error), [str(w.message) for w in caught]
    return out


def _same_state(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, dict):
            if not _same_state(x, y):
                return False
        elif isinstance(x, torch.Tensor):
            if not torch.equal(x, y):
                return False
        elif x != y:
            return False
    return True


def test_checkpoint_resumes_exactly_in_fresh_processes(tmp_path):
    folder = str(tmp_path)
    uninterrupted = run_on_ranks(_original, 2, folder, env=ENV)
    for rank, resumed in enumerate(run_on_ranks(_resumed, 2, folder, env=ENV)):
        for name in CHECKPOINTED:
            params, pickled, state_dict = uninterrupted[rank][name]
            assert torch.equal(resumed[name], params), (rank, name)
            assert _same_state(pickled, state_dict)
        count, messages = resumed["moved"]
        assert count == 1 and any(f"saved by rank {1 - rank} of 2" in m for m in messages)
    saved = torch.load(os.path.join(folder, "int4_stochastic-1.pt"), weights_only=True)["hook"]
    assert saved["rank"] == 1 and saved["generators"].shape[0] == 2 and saved["error"]


@pytest.mark.parametrize(
    ("entry", "value", "match"),
    [
        ("owner_error", None, "missing entry 'owner_error'"),  # None: the entry is removed
        ("error", {"0": torch.full((3,), float("nan"))}, "inf or NaN"),
        ("owner_error", {"x": torch.zeros(2)}, "'x' is not a valid key"),
        ("iter", 2.5, "iter' must be an integer"),
        ("buckets", [[0], "1"], "'buckets' must be a list of buckets"),
        ("generators", torch.zeros(2, 3, dtype=torch.uint8), "not a generator state"),
        ("kind", "powersgd", "saved by a 'powersgd' state"),
    ],
)
def test_bad_state_dicts_are_refused_and_change_nothing(entry, value, match):
    state = QuantizationState(None, rounding="stochastic")
    state.error.record(0, torch.ones(3))
    state.owner_error.record("0:0-2", torch.ones(2))
    state.iter = 4
    good = {**state.state_dict(), "generators": torch.stack([torch.Generator().get_state()] * 2)}
    broken = {k: v for k, v in good.items() if k != entry}
    if value is not None:
        broken[entry] = value
    with pytest.raises(StateDictError, match=match):
        state.load_state_dict(broken)
    assert state.iter == 4 and torch.equal(state.error.get(0, torch.zeros(3)), torch.ones(3))
    state.load_state_dict(good)  # the unbroken dict loads
    assert len(state.owner_error) == 1


# -- options ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"bits": 2}, "bits must be one of 8, 4"),
        ({"block_size": 100}, "block_size must be a multiple of 8"),
        ({"block_size": 0}, "block_size must be an integer in"),
        ({"rounding": "up"}, "rounding must be one of 'nearest', 'stochastic'"),
        ({"error_feedback": "yes"}, "error_feedback must be True or False"),
        ({"warmup_steps": -1}, "warmup_steps must be an integer >= 0"),
        ({"blocksize": 64}, "Did you mean 'block_size'"),
    ],
)
def test_bad_options_are_refused_with_the_fix(options, match):
    with pytest.raises(ValueError, match=match):
        QuantizationState(None, **options)


def test_options_read_as_attributes_and_stay_read_only():
    state = QuantizationState(None, bits=4, block_size=128)
    assert (state.bits, state.block_size, state.error_feedback) == (4, 128, True)
    assert state.settings.as_dict()["rounding"] == "nearest"
    with pytest.raises(AttributeError, match="read-only"):
        state.bits = 8
    with pytest.raises(TypeError, match="needs a commhooks.QuantizationState"):
        quantized_hook(None, FakeBucket([torch.zeros(2)]))


def _mismatched(rank, world_size):
    options = {"bits": 8} if rank == 0 else {"bits": 4, "block_size": 128}
    try:
        quantized_hook(QuantizationState(None, **options), FakeBucket([torch.ones(10)])).wait()
    except ValueError as exc:
        return str(exc)
    return "accepted"


def test_options_differing_between_ranks_raise_on_every_rank():
    for message in run_on_ranks(_mismatched, 2, env=ENV):
        assert "configured differently" in message
        assert "bits: rank 0=8, rank 1=4" in message and "block_size" in message


ABSURD = (("int8", {"block_size": BLOCK}), ("int4", {"block_size": BLOCK}))


def test_loaded_memories_of_parameters_no_longer_trained_are_dropped_after_a_step():
    # Left awaiting their check, they kept every later step on the per-key path and were
    # saved again in every checkpoint.
    from ddp_utils import resume_with_the_first_layer_frozen

    ranks = run_on_ranks(resume_with_the_first_layer_frozen, 2, "int8", {"block_size": BLOCK})
    for r in ranks:
        assert r["saved"] == [str(n) for n in range(8)]
        assert r["kept"] == [str(n) for n in range(6)] and not r["checking"]
        dropped = [w for w in r["warnings"] if "met no gradient in a whole step" in w]
        assert len(dropped) == 2, r["warnings"]  # the rank's own and the owner's pieces
        assert "2 loaded" in dropped[0] and "parameter #6 (" in dropped[0]
        assert "keys [6, 7])" in dropped[0] and "of parameter #" in dropped[1]


@pytest.fixture(scope="module")
def absurd():
    from ddp_utils import resume_each_with_absurd_memory

    return run_on_ranks(resume_each_with_absurd_memory, 2, ABSURD, env=ENV, timeout=120)


@pytest.mark.parametrize("case", range(len(ABSURD)), ids=[h for h, _ in ABSURD])
def test_an_absurd_loaded_memory_is_reset_at_the_first_step_naming_the_key(absurd, case):
    ranks = [r[case] for r in absurd]
    for r in ranks:
        assert r["finite"] and max(r["losses"]) < 10, r["losses"]
        assert not r["still_checking"]  # a one-off check: later steps make none
    reset = [w for w in ranks[0]["warnings"] if "out of all proportion" in w]
    assert reset and all("loaded error-feedback memory" in w for w in reset)
    named = {k for k in ranks[0]["keys"] if any(f"(key '{k}')" in w for w in reset)}
    first = {k for k in ranks[0]["keys"] if ":" not in k}
    assert first <= named  # every filled memory of a parameter was reset, each named
    # The second memory's pieces that DDP's first-step buckets cut otherwise are dropped
    # unused; the others are reset as they meet this rank's gradient of their elements.
    assert named - first
    assert not any("out of all proportion" in w for w in ranks[1]["warnings"])


def test_a_state_pickled_under_the_names_of_the_last_release_unpickles():
    # The memories' key describer moved from state.py (``_describe``) to layout.py; a state
    # pickled before names the old place.
    state = QuantizationState(None, bits=4, block_size=64)
    data = pickle.dumps(state, protocol=2)  # names its globals as text
    now = b"ccommhooks.hooks.quantized.layout\ndescribe_key\n"
    assert now in data
    copy = pickle.loads(data.replace(now, b"ccommhooks.hooks.quantized.state\n_describe\n"))
    assert copy.settings == state.settings
    assert copy.error.describe("3:0-8") == state.error.describe("3:0-8") != "3:0-8"
