"""The quantized hooks across machines of several ranks: two hops (sum within the machine, the
machine's share quantized across, gather within) against the flat path, on 4 gloo ranks made
2 machines of 2 by ``COMMHOOKS_MACHINE_ID``; uneven machines; checkpoints across shapes."""

import contextlib
import functools
import os
import threading
import warnings

import pytest
import torch
import torch.distributed as dist
from ddp_utils import batches, flat_grads, flat_params, make_ddp, make_mlp, train

import commhooks
from commhooks import QuantizationState, comm
from commhooks.testing import run_on_ranks

pytestmark = pytest.mark.timeout(150)
PIECES = comm.EXCHANGE_PIECES


def _machines(per_machine: list[int], rank: int) -> None:
    """Label rank ``rank``'s machine: the first ``per_machine[0]`` ranks share machine 0..."""
    bound = 0
    for machine, count in enumerate(per_machine):
        bound += count
        if rank < bound:
            os.environ[comm.topology.MACHINE_ID_VAR] = f"machine{machine}"
            return


def _two_by_two(rank: int) -> None:
    _machines([2, 2], rank)


def _steps(rank, world_size, bits, topology):
    """Train six steps; the per-kind bytes each step hands over, the first step's gradient,
    and the parameters after."""
    ddp = make_ddp(make_mlp(), bucket_cap_mb=0.004)
    state = commhooks.register(ddp, f"int{bits}", topology=topology)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    grads, sent = None, []
    for step, (x, y) in enumerate(batches(rank, 6)):
        opt.zero_grad(set_to_none=True)
        with comm.observe_collectives() as seen:
            torch.nn.functional.mse_loss(ddp(x), y).backward()
        sent.append(dict(seen.bytes))
        if step == 1:  # after DDP's bucket rebuild
            grads = flat_grads(ddp.module)
        opt.step()
    return {"two_hops": state.hops is not None, "sent": sent, "grads": grads,
            "params": flat_params(ddp.module)}  # fmt: skip


def _both_paths(rank, world_size, bits):
    return {topology: _steps(rank, world_size, bits, topology) for topology in ("auto", "flat")}


def _pieces_after_a_step(rank, world_size, machines):
    """The pieces a 1 MB exchange goes in on each group int8 exchanges on, after one step."""
    _machines(machines, rank)
    ddp = make_ddp(make_mlp(), bucket_cap_mb=0.004)
    state = commhooks.register(ddp, "int8")
    x, y = batches(rank, 1)[0]
    torch.nn.functional.mse_loss(ddp(x), y).backward()
    big = torch.empty(1 << 20, dtype=torch.uint8)
    if state.hops is None:
        found = {comm.pieces_for(big, g) for g in (dist.group.WORLD, state.issuer.group)}
        return {"flat": found.pop() if len(found) == 1 else found}
    groups = ("peers", "peers_follow", "intra", "intra_follow")
    return {g: comm.pieces_for(big, getattr(state.hops, g)) for g in groups}


@pytest.mark.parametrize(
    "machines, pieces",
    [
        ([2], {"flat": 1}),  # one machine: no slow link, exchanges whole
        ([1, 1], {"flat": PIECES}),  # two machines: gloo's turns, in pieces
        ([2, 2], {"peers": PIECES, "peers_follow": PIECES, "intra": 1, "intra_follow": 1}),
    ],
)
def test_exchanges_across_machines_go_in_pieces_and_within_one_whole(machines, pieces):
    for found in run_on_ranks(_pieces_after_a_step, sum(machines), machines):
        assert found == pieces


def _held_first_gather(rank, world_size):
    """Three steps of int8 on two hops, the third step's first all-gather across machines held
    back (on a thread of its own) until every bucket's all-to-all across has been issued, or
    5 s: whether it was let go by the all-to-alls, and the parameters after. (The first step
    has one bucket; DDP rebuilds them after it.)"""
    from commhooks.hooks.quantized import two_hops

    across, second_phase = two_hops._across, two_hops._second_phase
    issued, every, held = [], threading.Event(), []
    plan = {"hold": False, "buckets": 0}  # the last step holds; the one before counts

    def counted_across(state, share, hops):
        issued.append(share.bucket.index())
        if plan["hold"] and len(issued) == plan["buckets"]:
            every.set()
        return across(state, share, hops)

    def held_second_phase(state, share, hops):
        sent = second_phase(state, share, hops)
        if not plan["hold"] or held:
            return sent
        out = torch.futures.Future()
        held.append(False)

        def release():
            held[0] = every.wait(5)
            try:
                out.set_result(sent.value())
            except Exception as exc:  # a failed all-gather fails the step, as it would have
                out.set_exception(exc)

        sent.add_done_callback(lambda _: threading.Thread(target=release).start())
        return out

    two_hops._across, two_hops._second_phase = counted_across, held_second_phase
    try:
        ddp = make_ddp(make_mlp(), bucket_cap_mb=0.004)
        commhooks.register(ddp, "int8")
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        for step, (x, y) in enumerate(batches(rank, 3)):
            plan["hold"], plan["buckets"] = step == 2, len(issued)
            issued.clear()
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
    finally:
        two_hops._across, two_hops._second_phase = across, second_phase
    return {"held": held, "buckets": plan["buckets"], "params": flat_params(ddp.module)}


def test_a_buckets_exchange_across_does_not_wait_for_an_earlier_buckets_gathers():
    """The all-to-alls across machines go one after another on the link while earlier buckets'
    all-gathers are under way: each group's follow-ups keep their own order."""
    ranks = run_on_ranks(_held_first_gather, 4, prepare=_two_by_two, timeout=140)
    for out in ranks:
        assert out["buckets"] >= 3
        assert out["held"] == [True]  # let go by the last all-to-all, not by the 5 s
        assert torch.equal(out["params"], ranks[0]["params"])


def _exact_second_step_gradient(rank, world_size):
    """The second step's averaged gradient with plain allreduce (the same data and model)."""
    ddp = make_ddp(make_mlp(), bucket_cap_mb=0.004)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for step, (x, y) in enumerate(batches(rank, 2)):
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        if step == 1:
            return flat_grads(ddp.module)
        opt.step()


@pytest.mark.parametrize("bits", [8, 4])
def test_two_hops_send_half_the_flat_codes_across_and_agree_everywhere(bits):
    ranks = run_on_ranks(_both_paths, 4, bits, prepare=_two_by_two, timeout=140)
    for out in ranks:
        assert out["auto"]["two_hops"] and not out["flat"]["two_hops"]
        # Every rank holds the same bits, on either path.
        assert torch.equal(out["auto"]["params"], ranks[0]["auto"]["params"])
        assert torch.equal(out["flat"]["params"], ranks[0]["flat"]["params"])
        # Codes exchanged across machines: a machine's share, not every rank's bucket.
        for two, flat in zip(out["auto"]["sent"][1:], out["flat"]["sent"][1:]):
            assert two["all_to_all_single"] <= 0.55 * flat["all_to_all_single"], (two, flat)
            assert "reduce_scatter_tensor" in two and "reduce_scatter_tensor" not in flat


def _groups_after_loads(rank, world_size):
    """How many process groups each path's state makes when it loads its own state dict of an
    earlier step three times mid-run, and whether the ranks still agree after."""
    from torch.distributed import distributed_c10d

    made = {}
    for topology in ("auto", "flat"):
        ddp = make_ddp(make_mlp(), bucket_cap_mb=0.004)
        state = commhooks.register(ddp, "int8", topology=topology)
        train(ddp, batches(rank, 2))
        saved = state.state_dict()
        before = len(distributed_c10d._world.pg_map)
        for seed in (3, 4, 5):
            train(ddp, batches(rank, 1, seed=seed))
            state.load_state_dict(saved)  # a step count the ranks agree on again
        train(ddp, batches(rank, 1, seed=6))
        made[topology] = (len(distributed_c10d._world.pg_map) - before, flat_params(ddp.module))
    return made


def test_a_state_loaded_at_another_step_keeps_its_groups():
    # Each load at another step checks the ranks again; it made the path's groups again too
    # (one follow-up group flat, four on two hops), never destroyed: file descriptors and
    # gloo's threads, a load at a time.
    ranks = run_on_ranks(_groups_after_loads, 4, prepare=_two_by_two, timeout=140)
    for out in ranks:
        for topology, (made, params) in out.items():
            assert made == 0, (topology, made)
            assert torch.equal(params, ranks[0][topology][1])


@pytest.mark.parametrize("bits", [8, 4])
def test_two_hops_average_within_the_quantization_bound(bits):
    ranks = run_on_ranks(_both_paths, 4, bits, prepare=_two_by_two, timeout=140)
    exact = run_on_ranks(_exact_second_step_gradient, 4, prepare=_two_by_two)[0]
    qmax = 127 if bits == 8 else 7
    for out in ranks:
        for path in ("auto", "flat"):
            error = (out[path]["grads"] - exact).abs().max()
            # Two roundings of at most half a step each, of blocks no larger than the largest
            # gradient, plus what error feedback carried from the first step.
            assert error <= 3 * exact.abs().max() / qmax, (path, float(error))


def _in_order(rank, world_size, machines):
    """Two steps with the machines given as ``machines``: the second step's gradient, and the
    parameters after."""
    ddp = make_ddp(make_mlp(), bucket_cap_mb=0.004)
    state = commhooks.register(ddp, "int8", topology=commhooks.Topology(machines))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for x, y in batches(rank, 2):
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    hops = state.hops
    places = (hops.local, hops.machine) == (dist.get_rank(hops.intra), dist.get_rank(hops.peers))
    return places, flat_grads(ddp.module), flat_params(ddp.module)


@pytest.mark.parametrize("machines", [[[1, 0], [3, 2]], [[2, 3], [0, 1]], [[0, 3], [1, 2]]])
def test_a_topology_in_any_order_averages_the_same_shares_everywhere(machines):
    # Ranks listed out of order, machines out of order, a machine of ranks 0 and 3: the
    # process groups order their ranks, so a rank's share and row are its places in them.
    ranks = run_on_ranks(_in_order, 4, machines, timeout=140)
    exact = run_on_ranks(_exact_second_step_gradient, 4)[0]
    for places, grads, params in ranks:
        assert places and torch.equal(params, ranks[0][2])
        assert (grads - exact).abs().max() <= 3 * exact.abs().max() / 127
    assert commhooks.Topology(machines) == commhooks.Topology(sorted(map(sorted, machines)))


def _uneven(rank, world_size):
    ddp = make_ddp(make_mlp(), bucket_cap_mb=0.004)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = commhooks.register(ddp, "int8")
        train(ddp, batches(rank, 2))
    return state.hops is None, [str(w.message) for w in caught], flat_params(ddp.module)


def test_machines_of_unequal_size_take_the_flat_path_with_a_warning():
    ranks = run_on_ranks(_uneven, 3, prepare=functools.partial(_machines, [2, 1]))
    for flat, messages, params in ranks:
        assert flat and torch.equal(params, ranks[0][2])
        assert any("unequal numbers of ranks" in m and "flat path" in m for m in messages)


def test_a_topology_is_given_as_ranks_or_a_mesh_and_checked_when_built():
    topology = commhooks.Topology([[0, 1], [2, 3]])
    assert topology.describe() == "2 machines x 2 ranks" and topology.two_hops()
    assert QuantizationState(None, topology=topology).settings.topology == topology
    with pytest.raises(ValueError, match="unequal numbers of ranks"):
        QuantizationState(None, topology=commhooks.Topology([[0, 1], [2]]))
    with pytest.raises(ValueError, match="each rank once"):
        commhooks.Topology([[0, 1], [1, 2]])
    with pytest.raises(ValueError, match="must be 'auto'"):
        QuantizationState(None, topology="ring")

    class Mesh:  # a 2-D DeviceMesh's shape of ranks
        mesh = torch.tensor([[0, 1], [2, 3]])

    assert QuantizationState(None, topology=Mesh()).settings.topology == topology
    assert commhooks.HookConfig("int8", options={"topology": "flat"}).options == {
        "topology": "flat"
    }
    for bad in ([[0, 1.0]], [[True, 1]], [["0", "1"]]):  # not read as ranks 0 and 1
        with pytest.raises(ValueError, match="topology: Topology takes one list of integer"):
            QuantizationState(None, topology=bad)
    with pytest.raises(ValueError, match=r"its rank lists \(one list of global ranks per"):
        QuantizationState(None, topology=[0, 1])


def test_a_configs_topology_is_saved_as_rank_lists_and_read_back_from_json_and_yaml():
    # A Topology (or a mesh) in a HookConfig could not be written to JSON or YAML at all.
    lists = [[0, 1], [2, 3]]
    assert QuantizationState(None, topology=lists).settings.topology.as_lists() == lists
    for given in (commhooks.Topology([[3, 2], [1, 0]]), lists, ((0, 1), (2, 3))):
        config = commhooks.HookConfig("int4", options={"topology": given})
        assert config.options["topology"] == commhooks.Topology(lists)
        assert config.to_dict()["topology"] == lists
        assert commhooks.HookConfig.from_json(config.to_json()) == config
        assert commhooks.HookConfig.from_yaml(config.to_yaml()) == config
    read = commhooks.HookConfig.from_yaml("hook: int8\ntopology: [[0, 1], [2, 3]]\n")
    assert read.options["topology"] == commhooks.Topology(lists)


def _given(rank, world_size, machines):
    """One step with the topology ``machines`` given: what the step raised, if anything."""
    ddp = make_ddp(make_mlp(), bucket_cap_mb=0.004)
    commhooks.register(ddp, "int8", topology=commhooks.Topology(machines))
    try:
        train(ddp, batches(rank, 1))
    except Exception as exc:
        return str(exc)
    return None


def test_a_topology_of_other_ranks_than_the_groups_is_refused_at_the_first_step():
    # Two ranks take one hop whatever the topology says, but one naming ranks the group does
    # not hold is a mistake (a launcher's shape for another job), refused rather than ignored.
    for error in run_on_ranks(_given, 2, [[0, 1], [2, 3]]):
        assert (
            error and "holds ranks [0, 1, 2, 3]" in error and "hook's group holds [0, 1]" in error
        )
    assert run_on_ranks(_given, 2, [[0], [1]]) == [None, None]


def _saved_then_loaded(rank, world_size, folder):
    """Save a two-hop state after training, then load it into the flat path of the same
    ranks: the memories, a machine's share, are reset with a warning naming both shapes."""
    ddp = make_ddp(make_mlp(), bucket_cap_mb=0.004)
    state = commhooks.register(ddp, "int8", warmup_steps=1)
    with warnings.catch_warnings(record=True) as fresh:
        warnings.simplefilter("always")
        train(ddp, batches(rank, 3))
    path = os.path.join(folder, f"state{rank}.pt")
    state.save(path)
    again = make_ddp(make_mlp(), bucket_cap_mb=0.004)
    flat = commhooks.register(again, "int8", topology="flat", warmup_steps=1)
    flat.load(path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(again, batches(rank, 1))
    same = make_ddp(make_mlp(), bucket_cap_mb=0.004)  # and into the same shape: kept
    resumed = commhooks.register(same, "int8", warmup_steps=1)
    resumed.load(path)
    with warnings.catch_warnings(record=True) as quiet:
        warnings.simplefilter("always")
        train(same, batches(rank, 3))
    messages = [[str(w.message) for w in found] for found in (fresh, caught, quiet)]
    return (*messages, sorted(map(str, state.error)), sorted(map(str, resumed.error)))


def test_a_checkpoint_of_another_shape_resets_the_memories_naming_both(tmp_path):
    for fresh, caught, quiet, saved, resumed in run_on_ranks(
        _saved_then_loaded, 4, str(tmp_path), prepare=_two_by_two, timeout=140
    ):
        reset = [m for m in caught if "were reset" in m]
        assert reset and "2 machines x 2 ranks, two hops" in reset[0] and "'flat'" in reset[0]
        # A share holds parts of parameters, cut otherwise once DDP rebuilds its buckets and
        # again after a restart: each part's memory is its own, so neither training nor a
        # resume of the same shape warns (memories of parts that fit no more were called
        # another model's and reset, at the second step of every run; and after a warm-up,
        # whose parameters were numbered in the buckets DDP rebuilt, at every resume).
        assert not fresh and not quiet, (fresh, quiet)
        # Every memory saved is there after the resume (with those of the parts DDP's first
        # buckets cut, kept for the next restart, whose first step cuts them again).
        assert any(":" in key for key in saved) and set(saved) <= set(resumed)


RESUMED = {
    "int8": ("int8", {}),
    "int4": ("int4", {"packed": True, "rounding": "stochastic"}),
    "int8, flat": ("int8", {"topology": "flat"}),
}


def _trained(rank, world_size, folder, resume, ddp_options):
    """Six steps on 2 x 2, saved after the third; with ``resume``, the last three from that
    file, in fresh processes, their collectives completing as NCCL's do (a GPU's control
    flow). Whether two hops ran, the parameters after, the warnings."""
    out = {}
    for name, (hook, options) in RESUMED.items():
        path = os.path.join(folder, f"{name}-{rank}.pt")
        model = make_mlp(seed=7)
        saved = torch.load(path, weights_only=True) if resume else None
        if saved is not None:
            model.load_state_dict(saved["model"])
        ddp = make_ddp(model, **ddp_options)
        state = commhooks.register(ddp, hook, **options)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        data = batches(rank, 6)
        if saved is None:
            train(ddp, data[:3], optimizer=opt)
            saved = {"model": model.state_dict(), "opt": opt.state_dict()}
            torch.save({**saved, "hook": state.state_dict()}, path)
        else:
            state.load_state_dict(saved["hook"])
            opt.load_state_dict(saved["opt"])
        inline = comm.completing_inline() if resume else contextlib.nullcontext()
        with warnings.catch_warnings(record=True) as caught, inline:
            warnings.simplefilter("always")
            train(ddp, data[3:], optimizer=opt)
        out[name] = state.hops is not None, flat_params(model), [str(w.message) for w in caught]
    return out


@pytest.mark.parametrize(
    "ddp_options",
    [
        {"bucket_cap_mb": 25},
        {"bucket_cap_mb": 0.004},
        {"bucket_cap_mb": 0.004, "static_graph": True},
    ],
    ids=["one bucket", "three buckets", "three buckets, static graph"],
)
def test_a_run_on_either_path_resumes_bit_for_bit_in_fresh_processes(tmp_path, ddp_options):
    # A fresh DDP's first step (two with a static graph) hands over one bucket of every
    # parameter, listed backwards: the state cuts it into the buckets of the saved run's last
    # step until DDP hands those over itself, and each share is cut from its bucket laid out
    # by parameter number, so the steps after the restart quantize the same blocks, and meet
    # the same memories, as the uninterrupted run (the resumed one on a GPU's control flow,
    # whose bits are gloo's).
    args = str(tmp_path), False, ddp_options
    whole = run_on_ranks(_trained, 4, *args, prepare=_two_by_two, timeout=140)
    args = str(tmp_path), True, ddp_options
    again = run_on_ranks(_trained, 4, *args, prepare=_two_by_two, timeout=140)
    for ran, resumed in zip(whole, again):
        for name in RESUMED:
            two_hops = "flat" not in name
            assert ran[name][0] == resumed[name][0] == two_hops, name
            assert torch.equal(ran[name][1], resumed[name][1]), name
            assert ran[name][2] == resumed[name][2] == [], name


# -- streaming DiLoCo with workers of two ranks: each rank syncs half of each fragment ----------
def _diloco_shares(rank, world_size, bits):
    """Workers [0, 1] and [2, 3]: the bytes this rank hands to collectives across workers per
    sync, every rank's parameters after each step, and the model's element count."""
    import torch.distributed as dist

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    ddp = make_ddp(make_mlp(), process_group=pairs[rank // 2])
    diloco = commhooks.register(
        ddp, "streaming_diloco", sync_every=4, fragments=2, fragment_sync_delay=1, bits=bits
    )
    inner = torch.optim.SGD(ddp.parameters(), lr=0.05)
    diloco.attach(inner, ddp.module.named_parameters())
    history, across = [], 0
    with comm.observe_collectives() as seen:
        for x, y in batches(rank, 8):
            inner.zero_grad()
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            during = dict(seen.bytes)
            inner.step()  # the syncs: issued and applied in the optimizer's step hook
            crossing = ("all_reduce", "all_to_all_single")
            across += sum(seen.bytes.get(k, 0) - during.get(k, 0) for k in crossing)
            history.append(flat_params(ddp.module))
    return across, history, sum(p.numel() for p in ddp.parameters())


@pytest.mark.parametrize("bits", [None, 4])
def test_diloco_workers_of_two_ranks_each_sync_half_of_each_fragment(bits):
    ranks = run_on_ranks(_diloco_shares, 4, bits, timeout=140)
    numel = ranks[0][2]
    for across, _, _ in ranks:
        # Eight inner steps: each fragment synced twice, the model twice in all. A rank hands
        # over half of it (float32; or 4-bit codes and a float32 scale per 256), not all of it;
        # 4-bit rows of whole blocks pad this small model's shares by up to a third.
        per_element = 4 if bits is None else 0.5 + 4 / 256
        whole = 2 * numel * per_element
        assert 0.45 * whole <= across <= (0.55 if bits is None else 0.7) * whole, (across, whole)
    history = [h for _, h, _ in ranks]
    for step in range(8):  # one worker, the same bits, whichever share a rank carried
        assert torch.equal(history[0][step], history[1][step]), step
        assert torch.equal(history[2][step], history[3][step]), step
    first = 2112 + 4160  # fragment 0: modules 0 and 2, applied after inner steps 2 and 6
    for step in (1, 5):
        assert torch.equal(history[0][step][:first], history[2][step][:first]), step
        assert not torch.equal(history[0][step][first:], history[2][step][first:]), step
