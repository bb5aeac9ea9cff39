"""Streaming DiLoCo: options, fragments, the schedule against a reference, overlap, quantized
outer gradients, workers of several ranks, registration and checkpoints."""

import contextlib
import copy
import math
import pickle

import pytest
import torch
import torch.distributed as dist
from ddp_utils import batches, flat_params, make_ddp, make_mlp, streaming_diloco
from torch import nn

import commhooks
from commhooks import comm
from commhooks.averaging.diloco import DiLoCoOptions, split_by_module
from commhooks.testing import run_on_ranks

pytestmark = pytest.mark.timeout(120)


# -- options and fragments (no processes) -------------------------------------------------------
@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"sync_every": 0}, "sync_every must be >= 1"),
        ({"sync_every": 6, "fragments": 4}, "use sync_every=4"),
        ({"sync_every": 8, "fragments": 2, "fragment_sync_delay": 4}, "fragment_sync_delay <= 3"),
        ({"sync_every": 8, "bits": 2}, "None (full precision), 8 or 4"),
        ({"sync_every": 8, "fragment_update_alpha": 1.5}, "in [0, 1]"),
        ({"sync_every": 8, "fragments": [[]]}, "non-empty list of module"),
        ({"sync_every": 8, "outer_momentum": 1.0}, "outer_momentum must be in [0, 1)"),
        ({"sync_every": 8, "keep_inflight_steps": 1}, "must be True or False"),
        ({"sync_every": 8, "warmup_bits": 16}, "warmup_bits must be None (full precision), 8 or 4"),
    ],
)
def test_options_refuse_what_cannot_work_and_name_the_fix(options, says):
    with pytest.raises(ValueError, match=re_escape(says)):
        DiLoCoOptions(**options)


def re_escape(text):
    import re

    return re.escape(text)


def test_fragments_are_runs_of_whole_modules_in_order():
    named = list(make_mlp().named_parameters())  # modules 0, 2, 4, 6: 2112, 4160, 2080, 264
    assert split_by_module(named, 1) == [[n for n, _ in named]]
    assert split_by_module(named, 2) == [
        ["0.weight", "0.bias", "2.weight", "2.bias"],
        ["4.weight", "4.bias", "6.weight", "6.bias"],
    ]
    four = split_by_module(named, 4)
    assert [f[0].split(".")[0] for f in four] == ["0", "2", "4", "6"]
    given = split_by_module(named, (("0", "6.bias"), ("2", "4", "6.weight")))
    assert given == [
        ["0.weight", "0.bias", "6.bias"],
        ["2.weight", "2.bias", "4.weight", "4.bias", "6.weight"],
    ]
    with pytest.raises(ValueError, match="'6.bias' is in no fragment"):
        split_by_module(named, (("0", "2", "4", "6.weight"),))
    with pytest.raises(ValueError, match="in fragments"):
        split_by_module(named, (("0", "2", "4", "6"), ("6",)))
    with pytest.raises(ValueError, match="fragments <= 4"):
        split_by_module(named, 5)


def test_register_names_and_config():
    config = commhooks.HookConfig.from_dict(
        {"hook": "streaming_diloco", "sync_every": 8, "fragments": 2, "bits": 4, "warmup_bits": 8}
    )
    assert commhooks.HookConfig.from_json(config.to_json()) == config
    assert config.options["warmup_bits"] == 8
    with pytest.raises(ValueError, match="use hook 'streaming_diloco'"):
        commhooks.HookConfig("diloco", options={"sync_every": 8, "fragment_sync_delay": 1})
    with pytest.raises(ValueError, match="sync_every"):
        commhooks.HookConfig("diloco")


# -- the schedule against a reference ------------------------------------------------------------
def _delta(rank, step, name):
    """The scripted change of an inner step: different per rank, step and parameter."""
    return (rank + 1) * (step + 1) * 1e-2 * (1 + len(name) % 3)


def _scripted(rank, world_size, options, steps):
    model = make_mlp()
    inner = torch.optim.SGD(model.parameters(), lr=1.0)
    diloco = commhooks.StreamingDiLoCo(**options)
    diloco.attach(inner, model.named_parameters())
    for step in range(steps):
        for name, p in model.named_parameters():
            p.grad = torch.full_like(p, -_delta(rank, step, name))
        inner.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, diloco.plan


def _reference(world, options, steps, plan):
    """Every rank's parameters, simulated in float64 from the paper's description."""
    every, count = options["sync_every"], len(plan)
    delay, alpha = options.get("fragment_sync_delay", 0), options.get("fragment_update_alpha", 0)
    keep = options.get("keep_inflight_steps", False) and delay > 0
    lr, momentum = 0.7, 0.9
    start = {n: p.detach().double() for n, p in make_mlp().named_parameters()}
    local = [copy.deepcopy(start) for _ in range(world)]
    glob, buf = copy.deepcopy(start), {}
    applies = {
        f: {(f + 1) * every // count + k * every for k in range(steps)} for f in range(count)
    }
    flight = None
    for step in range(steps):
        for r in range(world):
            for n in local[r]:
                local[r][n] += _delta(r, step, n)
        inner = step + 1
        for f in range(count):
            if inner + delay in applies[f]:
                avg = {n: sum(glob[n] - local[r][n] for r in range(world)) / world for n in plan[f]}
                issued = [{n: local[r][n].clone() for n in plan[f]} for r in range(world)]
                flight = (f, inner + delay, avg, issued)
        if flight is not None and flight[1] == inner:
            for n, g in flight[2].items():
                buf[n] = g.clone() if n not in buf else momentum * buf[n] + g
                glob[n] = glob[n] - lr * (g + momentum * buf[n])
                for r in range(world):
                    # With keep_inflight_steps, the steps taken since the issue stay.
                    moved = local[r][n] - flight[3][r][n] if keep else 0
                    target = glob[n] + moved
                    local[r][n] = target + alpha * (local[r][n] - target)
            flight = None
    return local


CASES = [
    {"sync_every": 4},
    {"sync_every": 6, "fragments": 2, "fragment_sync_delay": 2, "fragment_update_alpha": 0.5},
    {"sync_every": 8, "fragments": 4, "fragment_sync_delay": 1},
    {"sync_every": 8, "fragments": 4, "fragment_sync_delay": 1, "keep_inflight_steps": True},
    {
        "sync_every": 6,
        "fragments": 2,
        "fragment_sync_delay": 2,
        "fragment_update_alpha": 0.5,
        "keep_inflight_steps": True,
    },
]


@pytest.mark.parametrize("options", CASES)
def test_schedule_overlap_outer_nesterov_and_blend_match_the_reference(options):
    steps = 13
    results = run_on_ranks(_scripted, 2, options, steps)
    plan = results[0][1]
    assert len(plan) == options.get("fragments", 1)
    want = _reference(2, options, steps, plan)
    for rank, (params, _) in enumerate(results):
        for n, p in params.items():
            torch.testing.assert_close(p.double(), want[rank][n], rtol=1e-5, atol=1e-5)


# -- overlap: issued at one step, applied at a later one -------------------------------------------
def _collectives_per_step(rank, world_size):
    model = make_mlp()
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    diloco = commhooks.StreamingDiLoCo(sync_every=8, fragments=2, fragment_sync_delay=3, bits=4)
    diloco.attach(inner, model.named_parameters())
    calls, kept = [], []
    for x, y in batches(rank, 9):
        inner.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        with comm.observe_collectives() as seen:
            inner.step()
        first = {n: p.detach().clone() for n, p in model.named_parameters() if n.startswith("0.")}
        calls.append(seen.calls.get("all_to_all_single", 0))  # a sync's first phase
        kept.append((diloco.in_flight is not None, first))
    diloco.finish()  # fragment 0 (issued after inner step 9) applied now, on every rank
    assert diloco.in_flight is None
    kept.append((False, {n: p.detach().clone() for n, p in model.named_parameters()}))
    return calls, kept, {n: t.clone() for n, t in diloco.snapshot.items()}


def test_a_fragment_is_issued_without_waiting_and_applied_delay_steps_later():
    results = run_on_ranks(_collectives_per_step, 2)
    # Fragment 0 is applied after inner steps 4 and 12 and issued after 1 and 9; fragment 1
    # after 8 and 5. (The second phase starts whenever the first completes: not counted.)
    for calls, kept, _ in results:
        assert calls == [1, 0, 0, 0, 1, 0, 0, 0, 1]
        flying = [True, True, True, False, True, True, True, False, True]
        assert [f for f, _ in kept[:9]] == flying
    (_, kept0, glob0), (_, kept1, glob1) = results
    for n in glob0:
        assert torch.equal(glob0[n], glob1[n])  # the global parameters are the same bits
        if n.startswith("0."):
            assert not torch.equal(kept0[2][1][n], kept1[2][1][n])  # in flight: still local
            assert torch.equal(kept0[3][1][n], kept1[3][1][n])  # applied at step 4: global
            assert not torch.equal(kept0[8][1][n], kept1[8][1][n])  # issued again at step 9
            assert torch.equal(kept0[9][1][n], kept1[9][1][n])  # applied by finish()


# -- quantized outer gradients and registration on DDP ------------------------------------------
def _registered(rank, world_size, bits, steps):
    ddp = make_ddp(make_mlp())
    diloco = commhooks.register(
        ddp, "streaming_diloco", sync_every=4, fragments=2, fragment_sync_delay=1, bits=bits
    )
    inner = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    diloco.attach(inner, ddp.module.named_parameters())
    data = batches(rank, 4)
    losses = []
    with comm.observe_collectives() as seen:
        for step in range(steps):
            x, y = data[step % len(data)]
            inner.zero_grad()
            loss = nn.functional.mse_loss(ddp(x), y)
            loss.backward()
            inner.step()
            losses.append(float(loss))
    memories = [len(q.state_dict()["error"]) for q in diloco.quantizers]
    size = sum(p.numel() for p in ddp.parameters())
    issuers = {id(q.issuer) for q in diloco.quantizers}  # one follow-up group for all
    return (
        type(diloco).__name__,
        losses,
        sum(seen.bytes.values()),
        size,
        memories,
        diloco.state_dict(),
        len(issuers),
    )


def _bench_model_syncs(rank, world_size, cycles):
    """The bench's default model under streaming DiLoCo (its settings, int4), ``cycles`` whole
    sync cycles of inner steps with made-up gradients: the bytes handed to collectives."""
    from commhooks.bench.tasks import CharTransformer

    torch.manual_seed(0)
    model = CharTransformer(context=64)
    diloco = commhooks.StreamingDiLoCo(
        sync_every=8, fragments=4, fragment_sync_delay=1, keep_inflight_steps=True, bits=4
    )
    inner = torch.optim.SGD(model.parameters(), lr=1e-3)
    diloco.attach(inner, model.named_parameters())
    gen = torch.Generator().manual_seed(rank)
    with comm.observe_collectives() as seen:
        for _ in range(8 * cycles):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=gen)
            inner.step()
    size = sum(p.numel() for p in model.parameters())
    return dict(seen.calls), dict(seen.bytes), size


def test_int4_outer_gradients_average_under_an_eighth_of_sync_every_of_allreduces_bytes():
    from commhooks.bench.costmodel import Collectives, wire_bytes

    cycles = 2
    calls, sent, size = run_on_ranks(_bench_model_syncs, 2, cycles)[0]
    assert calls == {"all_to_all_single": 4 * cycles, "all_gather_into_tensor": 4 * cycles}
    steps = 8 * cycles
    diloco = wire_bytes(Collectives(calls, sent), 2) / steps  # what a rank sends, a step
    allreduce = wire_bytes(Collectives({"all_reduce": 1}, {"all_reduce": 4 * size}), 2)
    # The goal: at most 1 / (8 sync_every); 13 levels packed with a float32 scale per 512
    # values take 3.8125 bits a value, 0.0149 with the rows' padding (int4 with a scale per
    # 256 values, 4.125 bits, would be 0.0161).
    assert diloco / allreduce <= 1 / (8 * 8)
    assert diloco / allreduce == pytest.approx(3.8125 / 32 / 8, rel=0.01)


def test_int4_outer_gradients_send_an_eighth_and_train_like_full_precision():
    steps = 24
    quantized = run_on_ranks(_registered, 2, 4, steps)
    plain = run_on_ranks(_registered, 2, None, steps)
    name, losses, sent, size, memories, state, issuers = quantized[0]
    assert name == "StreamingDiLoCo"
    assert memories == [4, 4]  # each fragment keeps what its int4 average left out
    assert issuers == 1
    syncs = steps // 4 * 2  # both fragments every 4 steps, each carrying half of the model
    full = plain[0][2]
    assert full == pytest.approx(syncs / 2 * size * 4, rel=0.01)  # float32: 4 bytes an element
    # What each collective is handed: the all-to-all every row (this rank's own too), the
    # all-gather one, at 3.75 bits (13 levels, eight codes to 30 bits) plus a float32 scale
    # every 512 elements, rows padded to whole blocks (6272 and 2344 elements into 2 x 3584
    # and 2 x 1536): 1.5 x 10240 x 3.8125 / 8.
    assert sent == syncs / 2 * 1.5 * 10240 * 3.8125 / 8
    assert state["snapshot"].keys() == {n for n, _ in make_mlp().named_parameters()}
    for rank in (1,):
        for n, t in quantized[rank][5]["snapshot"].items():
            assert torch.equal(t, state["snapshot"][n])  # every rank holds the same global bits
    for run in (quantized, plain):
        early = sum(r[1][0] for r in run) / 2
        late = sum(sum(r[1][-4:]) / 4 for r in run) / 2
        assert late < 0.9 * early
    q_late = sum(sum(r[1][-4:]) for r in quantized)
    p_late = sum(sum(r[1][-4:]) for r in plain)
    assert q_late == pytest.approx(p_late, rel=0.05)


# -- the warm-up's gradients in 8 bits ----------------------------------------------------------
def _warmup(rank, world_size, warmup_bits):
    # SGD: the weights' change is the averaged gradients', which int8 moves by about 1%.
    ddp, inner, diloco = _build(4, sgd=True, warmup_steps=3, warmup_bits=warmup_bits)
    sent, memories, params, issuers = [], [], [], set()
    for x, y in batches(rank, 5):
        inner.zero_grad()
        with comm.observe_collectives() as seen:
            nn.functional.mse_loss(ddp(x), y).backward()
        issuers.add(None if (kept := diloco.warmup_quantizer) is None else id(kept.issuer))
        inner.step()
        sent.append(dict(seen.bytes))
        kept = diloco.warmup_quantizer
        memories.append(None if kept is None else len(kept.state_dict()["error"]))
        params.append(torch.cat([p.detach().reshape(-1) for p in ddp.parameters()]))
    fragment = diloco.quantizers[0].issuer  # fragment 0 was issued after the first inner step
    return sent, memories, params, issuers - {None} == {id(fragment)}


def test_the_warmup_averages_gradients_in_8_bits_and_leaves_every_rank_the_same_weights():
    quantized = run_on_ranks(_warmup, 2, 8)
    plain = run_on_ranks(_warmup, 2, None)
    for sent, memories, _, shared in quantized:
        assert shared  # the warm-up's average and the fragments': one follow-up group
        assert all("all_reduce" not in s and s["all_to_all_single"] > 0 for s in sent[:3])
        # After the warm-up each rank is its own worker: its hook sends nothing. (A fragment's
        # second phase, started on a backend thread, may land in the next backward.)
        assert all(set(s) <= {"all_gather_into_tensor"} for s in sent[3:])
        assert memories == [8, 8, None, None, None]  # one per parameter, dropped at the end
    for sent, memories, _, _ in plain:
        assert all(set(s) == {"all_reduce"} for s in sent[:3]) and memories == [None] * 5
    # Codes of one byte and a float32 scale per 256 values, against four bytes a value.
    ratio = sum(quantized[0][0][0].values()) / sum(plain[0][0][0].values())
    assert 0.3 < ratio < 0.45
    (_, _, q0, _), (_, _, q1, _) = quantized
    for step in range(3):
        assert torch.equal(q0[step], q1[step])  # every rank decodes the same average
    assert not torch.equal(q0[3], q1[3])  # then the workers train apart
    start = _initial_parameters()
    q_change, p_change = q0[2] - start, plain[0][2][2] - start
    assert not torch.equal(q_change, p_change)
    assert (q_change - p_change).norm() < 0.02 * p_change.norm()


def _initial_parameters():
    return torch.cat([p.detach().reshape(-1) for p in make_mlp().parameters()])


def _inline_or_not(rank, world_size):
    """On 4 ranks, workers of two ([0, 1] and [2, 3]), whose ranks sync a share each."""
    workers = [dist.new_group([0, 1]), dist.new_group([2, 3])] if world_size == 4 else [None]
    out = []
    for inline in (False, True):
        model = make_mlp(widths=(32,) + (8,) * 12)
        ddp = make_ddp(model, bucket_cap_mb=0.00001, process_group=workers[rank // 2])
        inner, diloco = streaming_diloco(ddp)
        with comm.completing_inline() if inline else contextlib.nullcontext():
            _train_some(ddp, inner, diloco, batches(rank, 9), range(9))
            diloco.finish()
        out.append(flat_params(ddp.module))
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_with_collectives_completing_as_on_nccl_the_results_are_gloos(world_size):
    # NCCL's control flow on the CPU (futures complete as they are issued, follow-ups held to
    # a step's last bucket, 24 buckets): the int8 warm-up and the int4 fragments, overlapped,
    # give the same bits as on gloo, with workers of one rank or of two.
    results = run_on_ranks(_inline_or_not, world_size)
    for gloo, inline in results:
        assert torch.isfinite(inline).all()
        assert torch.equal(gloo, inline)
    if world_size == 4:  # a worker's ranks hold the same bits
        assert torch.equal(results[0][1], results[1][1])
        assert torch.equal(results[2][1], results[3][1])


# -- workers of several ranks ------------------------------------------------------------------
def _workers(rank, world_size, use_mesh, options=None, steps=6):
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = pairs[rank // 2]
    model = make_mlp()
    if use_mesh:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("across", "within"))
        diloco = commhooks.StreamingDiLoCo(
            sync_every=4, fragments=2, fragment_sync_delay=1, mesh=mesh
        )
        groups = [comm.global_ranks(diloco.process_group), comm.global_ranks(diloco.worker_group)]
        return groups, None
    ddp = make_ddp(model, process_group=mine)
    diloco = commhooks.register(
        ddp, "streaming_diloco", sync_every=4, fragments=2, fragment_sync_delay=1, **(options or {})
    )
    groups = [comm.global_ranks(diloco.process_group), comm.global_ranks(diloco.worker_group)]
    inner = torch.optim.SGD(ddp.parameters(), lr=0.05)
    diloco.attach(inner, ddp.module.named_parameters())
    history = []
    for x, y in batches(rank, steps):
        inner.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        inner.step()
        history.append(torch.cat([p.detach().reshape(-1) for p in ddp.parameters()]))
    return groups, history


def test_a_worker_of_two_ranks_averages_gradients_inside_and_fragments_across():
    results = run_on_ranks(_workers, 4, False)
    for rank, (groups, _) in enumerate(results):
        assert groups == [[rank % 2, rank % 2 + 2], [rank // 2 * 2, rank // 2 * 2 + 1]]
    history = [h for _, h in results]
    first = 2112 + 4160  # fragment 0: modules 0 and 2, applied after inner steps 2 and 6
    for step in range(6):
        assert torch.equal(history[0][step], history[1][step])  # one worker, the same bits
        assert torch.equal(history[2][step], history[3][step])
    assert not torch.equal(history[0][0], history[2][0])  # workers train apart
    assert torch.equal(history[0][1][:first], history[2][1][:first])  # until fragment 0 syncs
    assert not torch.equal(history[0][1][first:], history[2][1][first:])
    meshed = run_on_ranks(_workers, 4, True)
    assert [g for g, _ in meshed] == [g for g, _ in results]


def test_workers_of_two_ranks_warm_up_in_int8_together_then_train_apart():
    options = {"warmup_steps": 2, "warmup_bits": 8, "bits": 4}
    history = [h for _, h in run_on_ranks(_workers, 4, False, options, 4)]
    for step in range(4):
        assert torch.equal(history[0][step], history[1][step])  # one worker, the same bits
        assert torch.equal(history[2][step], history[3][step])
        together = torch.equal(history[0][step], history[2][step])
        assert together == (step < 2), step  # the warm-up's average spans both workers


# -- checkpoints: bitwise resume with a fragment in flight; hostile state refused ---------------
def _train_some(ddp, inner, diloco, data, steps):
    for step in steps:
        x, y = data[step]
        inner.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        inner.step()


def _build(bits, keep=False, bucket_cap_mb=0.004, sgd=False, **warmup):
    ddp = make_ddp(make_mlp(), bucket_cap_mb=bucket_cap_mb)
    diloco = commhooks.register(
        ddp,
        "streaming_diloco",
        sync_every=4,
        fragments=2,
        fragment_sync_delay=1,
        bits=bits,
        keep_inflight_steps=keep,
        **warmup,
    )
    params = ddp.parameters()
    inner = torch.optim.SGD(params, lr=0.05) if sgd else torch.optim.AdamW(params, lr=3e-3)
    diloco.attach(inner, ddp.module.named_parameters())
    return ddp, inner, diloco


def _save_and_resume(rank, tmp, data, cut, build, at_cut=None):
    """Train on ``data``, saving after ``cut`` steps; then rebuild, load and train from the
    save to the end again. The straight and the resumed parameters, the saved averager's
    state and the resumed averager."""
    ddp, inner, diloco = build()
    _train_some(ddp, inner, diloco, data, range(cut))
    if at_cut is not None:
        at_cut(diloco)
    path = f"{tmp}/rank{rank}.pt"
    torch.save(
        {
            "model": ddp.module.state_dict(),
            "inner": inner.state_dict(),
            "diloco": diloco.state_dict(),
        },
        path,
    )
    _train_some(ddp, inner, diloco, data, range(cut, len(data)))
    straight = [p.detach().clone() for p in ddp.parameters()]
    saved = torch.load(path, weights_only=True)
    ddp2, inner2, diloco2 = build()
    ddp2.module.load_state_dict(saved["model"])
    inner2.load_state_dict(saved["inner"])
    diloco2.load_state_dict(saved["diloco"])
    _train_some(ddp2, inner2, diloco2, data, range(cut, len(data)))
    resumed = [p.detach().clone() for p in ddp2.parameters()]
    return straight, resumed, saved["diloco"], diloco2


def _in_flight_at_the_save(diloco):
    assert diloco.in_flight is not None  # fragment 1, issued after inner step 7, applied at 8
    pickled = pickle.loads(pickle.dumps(diloco))  # waits for the fragment, keeps its average
    assert pickled.in_flight.apply_at == 8 and pickled.worker_group is None


def _resume(rank, world_size, bits, tmp, keep):
    straight, resumed, saved, _ = _save_and_resume(
        rank, tmp, batches(rank, 14), 7, lambda: _build(bits, keep), _in_flight_at_the_save
    )
    return all(torch.equal(a, b) for a, b in zip(straight, resumed)), saved


@pytest.mark.parametrize(("bits", "keep"), [(None, False), (4, False), (4, True)])
def test_resume_is_bitwise_with_a_fragment_in_flight(bits, keep, tmp_path):
    results = run_on_ranks(_resume, 2, bits, str(tmp_path), keep)
    for same, state in results:
        assert same
        assert state["in_flight"]["fragment"] == 1 and state["in_flight"]["apply_at"] == 8
        assert len(state["quantizers"]) == (0 if bits is None else 2)
        assert ("local" in state["in_flight"]) == keep
    if bits is not None and not keep:
        _refuses_hostile_state(results[0][1])
    if keep:
        _checks_the_kept_outer_gradient(results[0][1])


def _resume_in_warmup(rank, world_size, tmp):
    """Saved after 2 of 3 warm-up steps in 4 bits: the warm-up's memories travel with it. (One
    bucket: DDP's rebuild of several after the first step moves which rank owns which
    elements, and the quantized average drops its second memory where they moved.)"""
    warmup = {"warmup_steps": 3, "warmup_bits": 4, "bucket_cap_mb": 25}
    straight, resumed, saved, diloco = _save_and_resume(
        rank, tmp, batches(rank, 9), 2, lambda: _build(4, **warmup)
    )
    return straight, resumed, saved, diloco.warmup_quantizer


def test_resume_in_a_quantized_warmup_keeps_its_error_memories(tmp_path):
    results = run_on_ranks(_resume_in_warmup, 2, str(tmp_path))
    for straight, resumed, state, left in results:
        assert all(torch.equal(a, b) for a, b in zip(straight, resumed))
        assert (
            state["warmup_quantizer"]["iter"] == 2 and len(state["warmup_quantizer"]["error"]) == 8
        )
        assert left is None  # the warm-up ended after the resume: its memories went with it
    good = results[0][2]
    kept = _fresh(warmup_steps=3, warmup_bits=4)
    kept.load_state_dict(good)
    assert kept.warmup_quantizer is not None
    memory = kept.warmup_quantizer.state_dict()["error"]
    for name, tensor in good["warmup_quantizer"]["error"].items():
        assert torch.equal(memory[name], tensor)
    dropped = _fresh(warmup_steps=3)
    dropped.load_state_dict(good)  # saved in 4 bits, resumed in float32: nothing to remember
    assert dropped.warmup_quantizer is None
    for bad in ("nope", {**good["warmup_quantizer"], "iter": -1}):
        with pytest.raises(commhooks.StateDictError, match="'warmup_quantizer'"):
            kept.load_state_dict({**good, "warmup_quantizer": bad})


def _fresh(bits=4, keep=False, **warmup):
    return commhooks.StreamingDiLoCo(
        sync_every=4,
        fragments=2,
        fragment_sync_delay=1,
        bits=bits,
        keep_inflight_steps=keep,
        **warmup,
    )


def _checks_the_kept_outer_gradient(good):
    """A fragment in flight saved with keep_inflight_steps: its own outer gradient is checked
    like its average, and loads either way (kept only where the option is on)."""
    flight = good["in_flight"]
    for bad in (torch.zeros(3), flight["local"].double(), "nope"):
        with pytest.raises(commhooks.StateDictError, match="'local'"):
            _fresh(keep=True).load_state_dict({**good, "in_flight": {**flight, "local": bad}})
    kept = _fresh(keep=True)
    kept.load_state_dict(good)
    assert kept.in_flight is not None and torch.equal(kept.in_flight.local, flight["local"])
    dropped = _fresh(keep=False)
    dropped.load_state_dict(good)
    assert dropped.in_flight is not None and dropped.in_flight.local is None
    without = {k: v for k, v in flight.items() if k != "local"}
    older = _fresh(keep=True)
    older.load_state_dict({**good, "in_flight": without})
    assert older.in_flight is not None and older.in_flight.local is None


def _refuses_hostile_state(good):
    averager = _fresh()
    averager.load_state_dict(good)
    before = copy.deepcopy(averager.state_dict())
    bad_entries = {
        "kind": "periodic_model_averager",
        "sync_every": 8,
        "snapshot": {"0.weight": torch.full((64, 32), math.nan)},
        "plan": [["0.weight"], ["nonexistent"]],
        "in_flight": {"fragment": 1, "apply_at": 8, "average": torch.zeros(3)},
        "outer_optimizers": [{}],
        "quantizers": [],
        "step": -1,
    }
    for key, value in bad_entries.items():
        with pytest.raises(commhooks.StateDictError) as raised:
            averager.load_state_dict({**good, key: value})
        assert (
            key in str(raised.value)
            or "saved by" in str(raised.value)
            or "snapshot" in str(raised.value)
        ), (key, raised.value)
        after = averager.state_dict()
        assert after.keys() == before.keys() and after["step"] == before["step"]
        for n, t in before["snapshot"].items():
            assert torch.equal(after["snapshot"][n], t)
    with pytest.raises(commhooks.StateDictError, match="sync_every=8"):
        commhooks.StreamingDiLoCo(sync_every=8, fragments=2, bits=4).load_state_dict(good)
    with pytest.raises(commhooks.StateDictError, match="with bits=None"):
        _fresh(bits=None).load_state_dict(good)
