"""The bench on cluster shapes, by hand: the flags and the launcher's variables that give a shape,
the bytes one machine's link sends for each collective and each hook, gloo's turns and a token
bucket in the step time, the two-hop choice, the per-shape answer, and the documentation's
table of bytes per machine. No process is started."""

import os
from pathlib import Path

import pytest

from commhooks import comm
from commhooks.bench import args, costmodel, paths, predict, report, summary, world
from commhooks.bench.rows import Row
from commhooks.bench.shape import Shape, place_rank

DOCS = Path(__file__).resolve().parents[1] / "docs"
MB = 1_000_000


def _parse_error(capsys, argv):
    with pytest.raises(SystemExit) as exc:
        args.parse(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_shape_flags_predict_for_machines_and_the_links_run_them(capsys):
    default = args.parse([])
    assert default.shape == Shape(2, 1) and default.shapes == [Shape(2, 1), Shape(2, 8)]
    assert default.predict_world == 2  # the first answer is today's, for the ranks run
    plan = args.parse(["--nnodes", "8", "--nproc-per-node", "8", "--intra-link", "100gbit"])
    assert plan.shapes == [Shape(8, 8)] and plan.shape == Shape(2, 1) and plan.ranks == 2
    assert plan.intra_link_bps == 100 * 10**9
    assert args.parse(["--world-size", "8"]).shapes == [Shape(8, 1)]
    assert args.parse(["--nproc-per-node", "4"]).shapes == [Shape(1, 4)]  # torchrun's nnodes 1
    # With a rate-limited link the shape itself runs: a namespace per machine.
    linked = args.parse(["--nnodes", "2", "--nproc-per-node", "2", "--bandwidth", "100mbit"])
    assert linked.shape == Shape(2, 2) and linked.ranks == 4 and linked.shapes == [Shape(2, 2)]
    # --world-size only predicts, as it always did: the links run the ranks of --ranks
    world = args.parse(["--world-size", "8", "--bandwidth", "100mbit"])
    assert world.shape == Shape(2, 1) and world.shapes == [Shape(8, 1)]
    err = _parse_error(capsys, ["--world-size", "4", "--nnodes", "2"])
    assert "--world-size W is --nnodes W --nproc-per-node 1" in err
    err = _parse_error(
        capsys, ["--nnodes", "2", "--nproc-per-node", "2", "--ranks", "4", "--bandwidth", "1gbit"]
    )
    assert "give --ranks or --nnodes/--nproc-per-node with --bandwidth" in err
    err = _parse_error(capsys, ["--nnodes", "2", "--nproc-per-node", "9", "--sweep", "1gbit"])
    assert "18 ranks on one machine" in err and "without --bandwidth" in err
    assert "at least 2 ranks" in _parse_error(capsys, ["--nnodes", "1"])


def test_the_launchers_variables_give_the_shape_and_a_rank_its_machine(monkeypatch):
    base = {"RANK": "3", "WORLD_SIZE": "16", "LOCAL_RANK": "3", "MASTER_ADDR": "node0"}
    launched = world.launcher_world({**base, "LOCAL_WORLD_SIZE": "8"})
    assert launched is not None and launched.shape == Shape(2, 8) and not launched.shape_note
    assert launched.shape.text() == "2 machines x 8 ranks"
    alone = world.launcher_world(base)  # no LOCAL_WORLD_SIZE: every rank a machine, said so
    assert alone is not None and alone.shape == Shape(16, 1)
    assert "LOCAL_WORLD_SIZE is not set" in (alone.shape_note or "")
    uneven = world.launcher_world({**base, "LOCAL_WORLD_SIZE": "3"})
    assert uneven is not None and uneven.shape == Shape(16, 1) and "unequal" in uneven.shape_note
    assert Shape(1, 2).text() == "1 machine x 2 ranks"
    # A local rank learns its machine as from a launcher (the hooks group ranks by it).
    for name in ("COMMHOOKS_MACHINE_ID", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.setenv(name, "")  # recorded, so the test's end removes what place_rank sets
        monkeypatch.delenv(name)
    place_rank(Shape(2, 2), ["ns-a", "ns-b"], 3)
    assert os.environ["COMMHOOKS_MACHINE_ID"] == "ns-b"
    assert (os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"]) == ("1", "2")


def _counted(kind_bytes: dict[str, float]) -> costmodel.Collectives:
    return costmodel.Collectives({k: 1.0 for k in kind_bytes}, kind_bytes)


def _per_machine(c, shape, backend="gloo", hops=False, measured=2):
    return costmodel.machine_bytes(costmodel.transfers(c, measured, shape, backend, hops))


def test_bytes_a_machines_link_sends_by_hand():
    s = 4 * MB  # a float32 allreduce of 4 MB, as 2 ranks count it
    allreduce = _counted({"all_reduce": s})
    # gloo's ring over W ranks: the machine's boundary rank forwards 2(W-1)/W of it
    assert _per_machine(allreduce, Shape(2, 1)) == pytest.approx(s)
    assert _per_machine(allreduce, Shape(2, 8)) == pytest.approx(2 * 15 / 16 * s)
    # NCCL's topology-aware allreduce: 2(N-1)/N whatever the ranks inside
    assert _per_machine(allreduce, Shape(2, 8), "nccl") == pytest.approx(s)
    assert _per_machine(allreduce, Shape(1, 8)) == 0.0  # nothing leaves one machine
    # int8: the all-to-all of the quantized bucket, then a ring all-gather of each rank's row
    sq = 1.015625 * MB  # 1M codes and a float32 scale per 256
    int8 = _counted({"all_to_all_single": sq, "all_gather_into_tensor": sq / 2})
    assert _per_machine(int8, Shape(2, 1)) == pytest.approx(sq)
    flat = _per_machine(int8, Shape(2, 8), "nccl")
    assert flat == pytest.approx((8 * 1 / 2 + 15 / 16) * sq)  # G(N-1)/N + (W-1)/W
    hops = _per_machine(int8, Shape(2, 8), "nccl", hops=True)
    assert hops == pytest.approx(2 * 1 / 2 * sq)  # 2(N-1)/N: the machine's share only
    # the all-to-all phase alone sends G times less in two hops; all of it 4.94 times less
    assert flat / hops == pytest.approx(4 + 15 / 16)
    # Collectives counted on the two hops (a machine of 2 summing inside first) read back as
    # the flat path's: the same bytes on every shape.
    hopped = costmodel.Collectives(
        {"reduce_scatter_tensor": 1, "all_to_all_single": 1, "all_gather_into_tensor": 2},
        {
            "reduce_scatter_tensor": 4 * MB,
            "all_to_all_single": sq / 2,
            "all_gather_into_tensor": sq / 4 + 2 * MB,
        },
    )
    for shape in (Shape(2, 8), Shape(8, 1)):
        again = costmodel.transfers(hopped, Shape(2, 2), shape, "gloo", False, True)
        assert costmodel.machine_bytes(again) == pytest.approx(_per_machine(int8, shape))


def test_gloo_takes_turns_and_a_token_bucket_starts_each_turn():
    # int8 on two ranks: 254 kB each way in the all-to-all and in the all-gather's two halves.
    row = 254_000.0
    c = _counted({"all_to_all_single": 2 * row, "all_gather_into_tensor": row})
    step = costmodel.LoopbackStep(0.010, c, 2)
    wire = costmodel.Link(1e8, wire_factor=1.0)
    one_way = 8 * row / 1e8
    # gloo: the late rank's payload, then the early one's; the all-gather 1.5 times
    assert costmodel.predicted_step_s(step, 2, wire, 0.0) == pytest.approx(
        0.010 + 2 * one_way + 1.5 * one_way
    )
    # NCCL sends both ways at once
    nccl = costmodel.Cluster(Shape(2), "nccl")
    assert costmodel.predicted_step_s(step, nccl, wire, 0.0) == pytest.approx(0.010 + 2 * one_way)
    # A 25 kB bucket passes at once at the start of each turn that begins on an idle link:
    # both turns of the all-to-all, the first and last of the all-gather's three.
    bucket = costmodel.Link(1e8, wire_factor=1.0, burst_bytes=25_000)
    saved = 4 * 8 * 25_000 / 1e8
    assert costmodel.predicted_step_s(step, 2, bucket, 0.0) == pytest.approx(
        0.010 + 3.5 * one_way - saved
    )
    # A large exchange goes as eight collectives at once: only the first piece takes turns.
    big = 3e6
    large = costmodel.LoopbackStep(
        0.010, _counted({"all_to_all_single": 2 * big, "all_gather_into_tensor": big}), 2
    )
    assert comm.exchange_pieces(big, "gloo") == 8
    big_way = 8 * big / 1e8
    assert costmodel.predicted_step_s(large, 2, wire, 0.0) == pytest.approx(
        0.010 + (2 / 8 + 7 / 8) * big_way + (1.5 / 8 + 7 / 8) * big_way
    )
    # Four ranks: every exchange has other peers, so both directions run at once.
    four = costmodel.LoopbackStep(0.010, _counted({"all_to_all_single": 4 * row}), 4)
    assert costmodel.predicted_step_s(four, 4, wire, 0.0) == pytest.approx(
        0.010 + 3 / 4 * 8 * 4 * row / 1e8
    )
    # Two hops on 2 x 2: each rank exchanges its share with its counterpart, two pairs at
    # once on the machine's link, whose turns fill each other's idle direction: no turns.
    hopping = costmodel.LoopbackStep(0.010, c, Shape(2, 1), lambda shape: shape.per_node > 1)
    two_by_two = costmodel.predicted_step_s(hopping, Shape(2, 2), wire, 0.0)
    # A machine sends its share across (N - 1) / N in each phase, one quantized row in all,
    # 2 * one_way, where the same bytes alone with turns would take 3.5 * one_way.
    assert two_by_two == pytest.approx(0.010 + 2 * one_way)
    # The inside of a machine, priced: the ring's intra-machine edges carry it too.
    ring = costmodel.LoopbackStep(0.0, _counted({"all_reduce": 4 * MB}), 2)
    inside = costmodel.Cluster(Shape(2, 2), "gloo", intra_bps=1e9)
    free = costmodel.Cluster(Shape(2, 2))
    priced = costmodel.predicted_step_s(ring, inside, wire, 0.0)
    assert priced - costmodel.predicted_step_s(ring, free, wire, 0.0) == pytest.approx(
        8 * 1.5 * 4 * MB / 1e9
    )


def test_two_hops_where_the_options_and_the_shape_allow(monkeypatch):
    monkeypatch.setattr(paths, "_takes_topology", lambda hook: hook == "int8")
    assert paths.two_hops("int8", {}, Shape(2, 2))
    assert paths.two_hops("int8", {"topology": "auto"}, Shape(8, 8))
    assert not paths.two_hops("int8", {"topology": "flat"}, Shape(2, 8))
    assert not paths.two_hops("int8", {}, Shape(8, 1))  # one rank a machine: flat
    assert not paths.two_hops("int8", {}, Shape(1, 8))  # one machine: flat
    assert not paths.two_hops("fp16", {}, Shape(2, 8))
    assert paths.two_hops_for("int8", {"topology": "flat"}) is None
    choice = paths.two_hops_for("int8", {})
    assert choice is not None and choice(Shape(2, 8)) and not choice(Shape(2, 1))


def test_diloco_hops_where_its_syncs_or_warmup_are_quantized():
    # Its syncs and warm-up are the quantized hook's average where bits are set (topology
    # "auto"), so on machines of several ranks they hop; float32 syncs are flat allreduces.
    assert paths.two_hops("streaming_diloco", {"bits": 4}, Shape(2, 2))
    assert paths.two_hops("diloco", {"warmup_bits": 8}, Shape(2, 2))
    assert not paths.two_hops("streaming_diloco", {"bits": 4}, Shape(2, 1))
    assert not paths.two_hops("diloco", {}, Shape(2, 2))
    hops = paths.two_hops_for("streaming_diloco", {"bits": 4})
    assert hops is not None and not paths.sums_gradients("streaming_diloco", hops)
    assert paths.sums_gradients("int8", paths.two_hops_for("int8", {}))


def _rows():
    """Two ranks on loopback: allreduce 60 ms for 4 MB, noop 40 ms, int8 62 ms."""
    losses = [3.0 - 0.1 * i for i in range(10)]
    sq = 1.015625 * MB

    def row(hook, ms, sent):
        return Row(
            hook=hook,
            bandwidth=None,
            ok=True,
            step_ms_median=ms,
            step_ms_mean=ms,
            step_ms=[[ms] * 4, [ms] * 4],
            payload_calls_per_step={k: 1.0 for k in sent},
            payload_bytes_per_step=sent,
            heldout_loss=losses[-1],
            losses=[[i, x, 0.1 * (i + 1)] for i, x in enumerate(losses)],
            gradient_bytes=4 * MB,
        )

    return [
        row("noop", 40.0, {}),
        row("allreduce", 60.0, {"all_reduce": 4 * MB}),
        row("int8", 62.0, {"all_to_all_single": sq, "all_gather_into_tensor": sq / 2}),
    ]


def test_the_default_answer_is_for_the_ranks_run_and_two_machines_of_eight(monkeypatch):
    monkeypatch.setattr(paths, "_takes_topology", lambda hook: hook == "int8")
    rows, plan = _rows(), args.parse(["--links", "100mbit,1gbit"])
    summary.analyse(rows, plan.sweep)
    answer = predict.predict(rows, plan)
    assert [s["shape"]["key"] for s in answer["shapes"]] == ["2x1", "2x8"]
    assert answer["recommendations"] == answer["shapes"][0]["recommendations"]
    big = answer["shapes"][1]["machine_bytes_per_step"]
    assert big["allreduce"] == pytest.approx(2 * 15 / 16 * 4 * MB)  # gloo's ring
    assert big["int8"] == pytest.approx(1.015625 * MB)  # two hops: the machine's share
    int8 = {r.hook: r for r in rows}["int8"]
    assert set(int8.by_shape) == {"2x1", "2x8"}
    assert int8.by_shape["2x1"]["predicted"] == int8.predicted  # the first answer, as of old
    lines = report.answer_lines(rows, answer, steps=10)
    assert all(len(line) <= report.WIDTH for line in lines)
    text = "\n".join(lines)
    assert "Predicted for 2 machines x 1 rank" in text and "sent/machine" in text
    assert "Which hook on which link, 2 machines x 8 ranks" in text


# -- the documentation's table of bytes per machine -------------------------------------------
N_PARAMS = 100_000_000
H = 32  # DiLoCo's inner steps per outer sync
SHAPES = (Shape(2, 1), Shape(8, 1), Shape(2, 8), Shape(8, 8))


def _quantized(bytes_per_element: float, per_step: float = 1.0) -> costmodel.Collectives:
    """The quantized average as two ranks count it: all-to-all of the quantized bucket, each
    rank's half of it all-gathered."""
    sq = N_PARAMS * bytes_per_element * per_step
    return _counted({"all_to_all_single": sq, "all_gather_into_tensor": sq / 2})


# hook: (collectives two ranks count per step, backend, two hops where G > 1)
TABLE = {
    "allreduce, gloo": (_counted({"all_reduce": 4 * N_PARAMS}), "gloo", False),
    "allreduce, NCCL": (_counted({"all_reduce": 4 * N_PARAMS}), "nccl", False),
    "fp16 / bf16, NCCL": (_counted({"all_reduce": 2 * N_PARAMS}), "nccl", False),
    "power_sgd rank 4, NCCL": (_counted({"all_reduce": 4 * N_PARAMS / 512}), "nccl", False),
    "int8, flat": (_quantized(1 + 4 / 256), "nccl", False),
    "int8, two hops": (_quantized(1 + 4 / 256), "nccl", True),
    "int4, flat": (_quantized(0.5 + 4 / 256), "nccl", False),
    "int4, two hops": (_quantized(0.5 + 4 / 256), "nccl", True),
    "int4 packed, two hops": (_quantized(15 / 32 + 4 / 256), "nccl", True),
    "diloco, float32": (_counted({"all_reduce": 4 * N_PARAMS / H}), "nccl", True),
    "streaming_diloco, int4": (_quantized(30 / 64 + 4 / 512, 1 / H), "nccl", True),
    "noop": (_counted({}), "nccl", False),
}


def _docs_table() -> dict[str, list[float]]:
    """The table of docs/benchmarks.md: per hook, MB a machine's link sends per step."""
    text = (DOCS / "benchmarks.md").read_text()
    section = text.split("## Bytes per machine", 1)[1].split("\n## ", 1)[0]
    table = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[1].replace(".", "").isdigit():
            table[cells[0].strip("`")] = [float(c) for c in cells[1:]]
    return table


def test_the_docs_table_of_bytes_per_machine_is_the_cost_models():
    table = _docs_table()
    assert set(table) == set(TABLE)
    for hook, (counted, backend, hops) in TABLE.items():
        model = [
            _per_machine(counted, shape, backend, hops and shape.per_node > 1) / MB
            for shape in SHAPES
        ]
        assert table[hook] == pytest.approx(model, rel=5e-3, abs=0.05), hook
    # What the table says in words: on 2 machines of 8, flat int8 sends 1.25 times NCCL's
    # float32 allreduce (G(N-1)/N + (W-1)/W of the codes against 2(N-1)/N of 4 bytes a
    # value), two hops 0.25 times; on one rank a machine the two paths are the same.
    nccl = table["allreduce, NCCL"]
    assert table["int8, flat"][2] / nccl[2] == pytest.approx(1.254, abs=0.002)
    assert table["int8, two hops"][2] / nccl[2] == pytest.approx(0.254, abs=0.002)
    assert table["int8, flat"][:2] == table["int8, two hops"][:2]
    assert table["int8, flat"][3] / table["int8, two hops"][3] == pytest.approx(4.56, abs=0.01)
    # a worker a machine: a DiLoCo sync crosses each link once, whatever the ranks inside
    assert table["diloco, float32"][0] == table["diloco, float32"][2]
