"""The bench's pure parts: rate/duration parsing, flag validation, the ring cost model and the
break-even computation, on hand-computed cases."""

import dataclasses

import pytest

from commhooks.bench import args, costmodel, footprint, hookset, summary
from commhooks.bench.records import RankResult, RunOutcome
from commhooks.bench.rows import Row, make_row, pool_memory_runs, pool_runs
from commhooks.bench.units import format_rate, parse_duration, parse_rate


@pytest.mark.parametrize(
    "text,bits",
    [
        ("100mbit", 100_000_000),
        ("1gbit", 1_000_000_000),
        ("1Gbit/s", 1_000_000_000),
        ("2.5gbit", 2_500_000_000),
        ("500kbit", 500_000),
        (" 50MBIT ", 50_000_000),
    ],
)
def test_parse_rate_accepts_bit_units(text, bits):
    assert parse_rate(text) == bits


@pytest.mark.parametrize("text", ["100", "fast", "-5mbit", "100mb", "mbit", "1e9"])
def test_parse_rate_rejects_with_the_accepted_form(text):
    with pytest.raises(ValueError, match=r"e\.g\. 50mbit"):
        parse_rate(text)


def test_parse_rate_refuses_bps_as_ambiguous():
    with pytest.raises(ValueError, match="bytes/s"):
        parse_rate("100mbps")


def test_parse_rate_refuses_too_slow():
    with pytest.raises(ValueError, match="too slow"):
        parse_rate("10kbit")


def test_parse_duration_and_format_rate():
    assert parse_duration("5ms") == pytest.approx(0.005)
    assert parse_duration("250us") == pytest.approx(250e-6)
    assert parse_duration("0.1s") == pytest.approx(0.1)
    with pytest.raises(ValueError, match="5ms"):
        parse_duration("5")
    assert format_rate(None) == "loopback"
    assert format_rate(100_000_000) == "100mbit"
    assert format_rate(2_500_000_000) == "2.5gbit"


def _parse_error(capsys, argv):
    with pytest.raises(SystemExit) as exit_info:
        args.parse(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_unknown_hook_lists_valid_names(capsys):
    err = _parse_error(capsys, ["--hooks", "allreduce,fp17"])
    assert "fp17" in err and "valid hooks" in err
    assert "allreduce" in err and "torch_power_sgd" in err and "noop" in err


def test_bad_flags_say_what_is_accepted(capsys):
    assert "e.g. 50mbit" in _parse_error(capsys, ["--bandwidth", "100megs"])
    assert "not both" in _parse_error(capsys, ["--bandwidth", "1gbit", "--sweep", "1gbit"])
    assert "at least one step" in _parse_error(capsys, ["--steps", "4", "--warmup", "4"])
    assert "at least 1" in _parse_error(capsys, ["--steps", "0"])
    assert "at least 2" in _parse_error(capsys, ["--world-size", "1"])
    assert "--predict" in _parse_error(capsys, ["--ranks", "64"])
    assert "needs --bandwidth" in _parse_error(capsys, ["--latency", "5ms"])
    assert ".png" in _parse_error(capsys, ["--plot", "out.jpg"])
    assert "between 1 and 100" in _parse_error(capsys, ["--repeat", "0"])
    assert "--no-offload needs --bandwidth" in _parse_error(capsys, ["--no-offload"])


def test_default_plan_and_predict_world():
    plan = args.parse([])
    assert plan.bandwidths == [None] and plan.ranks == 2 and plan.task == "stdlib-lm"
    assert {"noop", "allreduce", "fp16", "bf16"} <= set(plan.hooks)
    assert set(plan.hooks) | set(plan.skipped) == set(
        ["noop", "allreduce", "fp16", "bf16", "power_sgd", "power_sgd_single_round"]
        + ["post_local_sgd", "int8", "int4", "diloco", "streaming_diloco"]
    )
    assert (plan.steps, plan.warmup) == (40, 5)
    assert plan.offload and not args.parse(["--no-offload", "--bandwidth", "1gbit"]).offload
    assert args.parse(["--steps", "3"]).warmup == 1  # a tiny budget still times some steps
    assert args.parse(["--steps", "1"]).warmup == 0
    plan = args.parse(["--predict", "10gbit", "--world-size", "64", "--compare-torch"])
    assert (plan.predict_bps, plan.predict_world, plan.ranks) == (10**10, 64, 2)
    assert "torch_fp16" in plan.hooks and "torch_power_sgd" in plan.hooks
    # Every PowerSGD variant is compared with PyTorch's PowerSGD.
    for hook in ("power_sgd", "power_sgd_single_round", "batched_power_sgd"):
        assert any("power_sgd" in h for h in hookset.torch_counterparts([hook])), hook
        plan = args.parse(["--hooks", hook, "--compare-torch"])
        assert any(h.startswith("torch_") and "power_sgd" in h for h in plan.hooks), hook
    # The quantized hooks are compared with PyTorch's quantization hooks.
    for hook in ("int8", "int4"):
        assert hookset.torch_counterparts([hook]) == [
            "torch_quantize_per_tensor",
            "torch_quantize_per_channel",
        ]
    plan = args.parse(["--sweep", "1gbit,50mbit,100mbit", "--hooks", "allreduce"])
    assert plan.bandwidths == [50_000_000, 100_000_000, 1_000_000_000] and plan.sweep


def _coll(calls, nbytes):
    return costmodel.Collectives({"all_reduce": calls}, {"all_reduce": nbytes})


def test_ring_allreduce_two_ranks_by_hand():
    # p=2: each rank sends 2*(1)/2 * 1 MB = 1 MB; 8e6 bit at 100 Mbit/s = 80 ms;
    # latency: 2(p-1) = 2 rounds per call, 1 call, 5 ms each = 10 ms.
    c = _coll(1, 1_000_000)
    assert costmodel.wire_bytes(c, 2) == pytest.approx(1_000_000)
    t = costmodel.comm_time_s(c, 2, 100e6, latency_s=0.005, wire_factor=1.0)
    assert t == pytest.approx(0.080 + 0.010)


def test_ring_allreduce_four_ranks_by_hand():
    # p=4, two calls moving 1.2 MB in all: 2*3/4 * 1.2 MB = 1.8 MB -> 14.4 ms at 1 Gbit/s;
    # latency 2*3 rounds per call * 2 calls * 1 ms = 12 ms; compute 50 ms, overhead 3 ms.
    c = _coll(2, 1_200_000)
    assert costmodel.wire_bytes(c, 4) == pytest.approx(1_800_000)
    t = costmodel.predict_step_s(0.050, c, 4, 1e9, 0.001, overhead_s=0.003, wire_factor=1.0)
    assert t == pytest.approx(0.050 + 0.003 + 0.0144 + 0.012)
    # the default wire factor adds the TCP/IP/Ethernet headers of full 1500-byte frames
    bare = costmodel.comm_time_s(c, 4, 1e9, 0.0, wire_factor=1.0)
    assert costmodel.comm_time_s(c, 4, 1e9) == pytest.approx(bare * 1514 / 1448)


@pytest.mark.parametrize("kind", ["all_gather", "all_gather_into_tensor", "all_gather_single"])
def test_other_collectives_and_single_rank(kind):
    c = costmodel.Collectives({kind: 1}, {kind: 1000})
    assert costmodel.wire_bytes(c, 4) == pytest.approx(3000)  # (p-1) * contribution
    assert costmodel.comm_time_s(_coll(1, 10**6), 1, 1e9) == 0.0


def test_an_all_gather_counted_on_two_ranks_keeps_its_whole_on_sixteen():
    # The quantized hooks gather one whole bucket: on 16 ranks each hands over a sixteenth of
    # what each handed over on 2, so the backend's per-byte work is the link's bytes, not 8x.
    c = costmodel.Collectives({"all_gather_into_tensor": 1}, {"all_gather_into_tensor": 1000})
    there = costmodel.wire_bytes(c, 16, measured=2)
    assert there == pytest.approx(15 / 16 * 2000)
    assert there == pytest.approx(costmodel.machine_bytes(costmodel.transfers(c, 2, 16)))
    assert costmodel.wire_bytes(c, 2, measured=2) == costmodel.wire_bytes(c, 2) == 1000


def test_break_even_bandwidth_by_hand():
    # hook: 0.2 s + 1 MB/B, allreduce: 0.1 s + 8 MB/B (B in bytes... here bit/s units cancel):
    # equal where 0.1 = 7e6 / B, i.e. B = 7e7; the hook sends less, so it wins below that.
    bws = [5e7, 1e8, 1e9]
    hook = [(b, 0.2 + 1e6 / b) for b in bws]
    ref = [(b, 0.1 + 8e6 / b) for b in bws]
    bw, verdict = summary.fitted_break_even_bps(hook, ref)
    assert bw == pytest.approx(7e7)
    assert "below" in verdict
    bw, verdict = summary.fitted_break_even_bps([(b, 0.05 + 1e6 / b) for b in bws], ref)
    assert bw is None and "every bandwidth" in verdict
    assert summary.fitted_break_even_bps(hook[:1], ref[:1])[0] is None


def test_sweep_without_allreduce_says_what_to_add():
    rows = [
        Row(hook=h, bandwidth=bw, ok=True, step_ms_median=ms)
        for h, bw, ms in [("noop", 10**8, 70.0), ("noop", 10**9, 69.0), ("fp16", 10**8, 90.0)]
    ]
    rows.append(Row(hook="fp16", bandwidth=10**9, ok=True, step_ms_median=80.0))
    sweep = summary._sweep(rows)
    for hook in ("noop", "fp16"):
        assert sweep[hook]["break_even_bandwidth"] is None
        assert "add allreduce to --hooks" in sweep[hook]["verdict"]


def _fake_run(step_s, wire=None):
    rank = RankResult(
        rank=0,
        step_s=step_s,
        losses=[[i, 3.0 - i * 0.1, 0.1 * (i + 1)] for i in range(len(step_s))],
        heldout_loss=2.5,
        peak_memory_bytes=1000,
        payload_calls={"all_reduce": 2 * len(step_s)},
        payload_bytes={"all_reduce": 1_000_000 * len(step_s)},
        gradient_bytes=4_000_000,
        wire=wire,
    )
    return RunOutcome(ok=True, ranks=[rank, dataclasses.replace(rank, rank=1)])


def test_make_row_figures_by_hand():
    row = make_row("fp16", None, _fake_run([0.1, 0.3, 0.2, 0.4]), {})
    assert row.step_ms_median == pytest.approx(250.0)
    assert row.step_ms_p25 == pytest.approx(175.0) and row.step_ms_p75 == pytest.approx(325.0)
    assert row.bytes_per_step == pytest.approx(1_000_000)  # two ranks: 2(p-1)/p = 1
    assert row.compression_ratio == pytest.approx(4.0)
    assert "payload" in row.bytes_source
    # 4 steps: 4.2 MB and 3000 packets on the wire -> payload 4.2e6 - 3000 * 66 per 4 steps
    wire = {"tx_bytes": 4_200_000, "tx_packets": 3000, "rx_bytes": 0, "rx_packets": 0}
    row = make_row("fp16", 10**8, _fake_run([0.1, 0.3, 0.2, 0.4], wire), {})
    assert row.bytes_per_step == pytest.approx(1_050_000)
    assert row.wire_vs_analytic == pytest.approx((4_200_000 - 3000 * 66) / 4 / 1_000_000)


def test_repeated_runs_pool_their_steps_and_counters():
    wire = {"tx_bytes": 4_200_000, "tx_packets": 3000, "rx_bytes": 10, "rx_packets": 1}
    first, second = _fake_run([0.1, 0.3], wire), _fake_run([0.2, 0.4], wire)
    second.ranks[1].peak_memory_bytes = 5000
    pooled = pool_runs([first, second])
    row = make_row("fp16", 10**8, pooled, {})
    assert row.repeats == 2 and row.timed_steps == 4
    assert row.step_ms_median == pytest.approx(250.0)  # as one run of [0.1, 0.3, 0.2, 0.4]
    assert row.bytes_per_step == pytest.approx(2 * 4_200_000 / 4)
    assert row.peak_memory_bytes == 5000
    failed = RunOutcome(ok=False, error="boom")
    assert pool_runs([first, failed]) is failed  # one failed round fails the hook
    assert pool_runs([first]) is first
    assert args.parse(["--repeat", "3"]).repeat == 3 and args.parse([]).repeat == 1


def test_a_memory_run_gives_the_peak_and_a_failed_one_leaves_the_timed_peak_with_a_note():
    timed = _fake_run([0.1, 0.2])
    memory = _fake_run([0.3, 0.4])
    memory.ranks[0].peak_memory_bytes, memory.ranks[1].peak_memory_bytes = 700, 800
    row = make_row("fp16", None, timed, {}, memory)
    assert row.peak_memory_bytes == 800 and row.peak_memory_bytes_per_rank == [700, 800]
    assert row.peak_rss_bytes == 1000 and row.step_ms_median == pytest.approx(150.0)
    row = make_row(
        "fp16", None, timed, {"note": "single bucket"}, RunOutcome(ok=False, error="oom")
    )
    assert row.peak_memory_bytes == row.peak_rss_bytes == 1000
    assert row.note == "single bucket; memory run failed (oom): peak memory from the timed runs"
    assert make_row("fp16", None, timed, {}).peak_memory_bytes == 1000


def test_memory_runs_pool_to_each_ranks_median():
    runs = [_fake_run([0.1]) for _ in range(3)]
    for run, (a, b) in zip(runs, [(700, 900), (650, 800), (720, 3000)]):
        run.ranks[0].peak_memory_bytes, run.ranks[1].peak_memory_bytes = a, b
    pooled = pool_memory_runs(runs)
    assert [r.peak_memory_bytes for r in pooled.ranks] == [700, 900] and pooled.repeats == 3
    failed = RunOutcome(ok=False, error="boom")
    assert pool_memory_runs([runs[0], failed]) is failed and pool_memory_runs(runs[:1]) is runs[0]


def test_memory_flag_defaults_to_live_where_glibc_is_and_says_why_not(monkeypatch, capsys):
    assert args.parse([]).memory == "live" and args.parse(["--memory", "rss"]).memory == "rss"
    assert "invalid choice" in _parse_error(capsys, ["--memory", "exact"])
    monkeypatch.setattr(footprint, "can_map_afresh", lambda: False)
    plan = args.parse([])
    assert plan.memory == "rss" and any("not glibc" in n for n in plan.notes)
    assert "run with --memory rss" in _parse_error(capsys, ["--memory", "live"])


def test_failed_row_and_plain_text_fallbacks(monkeypatch, capsys, tmp_path):
    from commhooks.bench import report

    ok = make_row("allreduce", None, _fake_run([0.1, 0.2, 0.3]), {})
    bad = make_row("torch_bf16", None, RunOutcome(ok=False, error="TypeError: no"), {})
    assert bad.ok is False and bad.step_ms_median is None and bad.error
    for name in ("rich", "rich.console", "rich.table", "matplotlib", "matplotlib.pyplot"):
        monkeypatch.setitem(__import__("sys").modules, name, None)
    report.print_report([ok, bad], {}, {}, "title", wide=False, reach_steps=3)
    out = capsys.readouterr().out
    assert "allreduce" in out and "FAILED torch_bf16 @ loopback: TypeError: no" in out
    # Without matplotlib, --plot is refused before anything runs.
    note = _parse_error(capsys, ["--plot", str(tmp_path / "p.png")])
    assert "matplotlib is not installed" in note and not (tmp_path / "p.png").exists()


# -- the prediction from loopback, by hand -------------------------------------------------------
def _step(step_s, payload, world=2, calls=1):
    collectives = costmodel.Collectives({"all_reduce": calls}, {"all_reduce": payload})
    return costmodel.LoopbackStep(step_s, collectives, world)


def test_prediction_from_loopback_by_hand():
    allreduce, noop = _step(0.060, 1_000_000), _step(0.040, 0)
    # k: 20 ms more than noop for the 1 MB each of two ranks sends -> 20 ns per byte
    k = costmodel.backend_s_per_byte(allreduce, noop)
    assert k == pytest.approx(2e-8)
    bare = costmodel.Link(100e6, 0.0, wire_factor=1.0)
    # Two ranks, as measured: the loopback step plus 8 Mbit at 100 Mbit/s = 80 ms.
    assert costmodel.predicted_step_s(allreduce, 2, bare, k) == pytest.approx(0.060 + 0.080)
    # Four ranks: each sends 2 * 3/4 * 1 MB = 1.5 MB; compute 60 - 20 = 40 ms, the backend's
    # work 1.5 MB * 20 ns = 30 ms, the link 12 Mbit / 100 Mbit/s = 120 ms, latency 6 rounds.
    link = costmodel.Link(100e6, 0.001, wire_factor=1.0)
    expected = 0.040 + 0.030 + 0.120 + 6 * 0.001
    assert costmodel.predicted_step_s(allreduce, 4, link, k) == pytest.approx(expected)
    # A link's default wire factor adds the headers of full Ethernet frames, and half an
    # acknowledgement per segment (in a ring, each rank receives what it sends).
    headers = costmodel.predicted_step_s(allreduce, 2, costmodel.Link(100e6), k)
    assert headers == pytest.approx(0.060 + 0.080 * (1514 + 33) / 1448)
    # No allreduce excess (a noisy loopback run): no per-byte work, never negative.
    assert costmodel.backend_s_per_byte(noop, allreduce) == 0.0


def test_break_even_by_hand():
    link = costmodel.Link(1.0, 0.0, wire_factor=1.0)
    allreduce = _step(0.060, 1_000_000)
    # fp16: 5 ms more compute, half the bits: 0.065 + 4e6 / B = 0.060 + 8e6 / B at 800 Mbit/s.
    fp16 = _step(0.065, 500_000)
    assert costmodel.break_even_bps(fp16, allreduce, 2, link, 0.0) == pytest.approx(8e8)
    # The backend's per-byte work k is in the loopback steps already: at the world size
    # measured it changes nothing.
    assert costmodel.break_even_bps(fp16, allreduce, 2, link, 1e-8) == pytest.approx(8e8)
    assert costmodel.break_even_bps(_step(0.050, 500_000), allreduce, 2, link, 0.0) is None
    assert costmodel.break_even_bps(_step(0.070, 1_000_000), allreduce, 2, link, 0.0) == 0.0
    assert costmodel.break_even_bps(_step(0.070, 2_000_000), allreduce, 2, link, 0.0) == 0.0
    # At four ranks the allreduce sends 1.5 MB and fp16 0.75 MB: 6e6 bits apart -> 1.2 Gbit/s.
    assert costmodel.break_even_bps(fp16, allreduce, 4, link, 0.0) == pytest.approx(1.2e9)
    # With k = 10 ns/B: allreduce 50 + 15 ms, fp16 60 + 7.5 ms -> 6e6 / 2.5 ms = 2.4 Gbit/s.
    assert costmodel.break_even_bps(fp16, allreduce, 4, link, 1e-8) == pytest.approx(2.4e9)


class _SlowHeldOut:
    """A task whose held-out evaluation takes 0.3 s, far longer than a training step."""

    def __init__(self) -> None:
        import torch

        self.model = torch.nn.Linear(2, 1)
        self.batch = torch.ones(4, 2)

    def train_batch(self, rank: int, step: int) -> object:
        return self.batch

    def loss(self, batch: object, model: object) -> object:
        return self.model(self.batch).pow(2).mean()

    def heldout_loss(self, model: object, device: object) -> float:
        import time

        time.sleep(0.3)
        return 1.5


def test_the_loss_timeline_is_training_time_without_the_heldout_evaluation():
    # A hook that trains past the held-out step must not pay for the evaluation in its time
    # to allreduce's loss: allreduce's run ends at that step, before the evaluation.
    import torch

    from commhooks.bench.records import RunSpec
    from commhooks.bench.worker import Training

    spec = RunSpec(
        hook="noop", options={}, task="synthetic", params=0, seed=0, steps=4, warmup=0,
        heldout_at=2, lr=0.1, bucket_cap_mb=25.0,
    )  # fmt: skip
    task = _SlowHeldOut()
    run = Training(spec, 0, task, task.model, torch.optim.SGD(task.model.parameters(), lr=0.1),
                   lambda: None)  # fmt: skip
    for step in range(4):
        run.step(step, timed=False)
    times = [t for _, _, t in run.losses]
    assert run.heldout_loss == 1.5
    assert max(b - a for a, b in zip(times, times[1:])) < 0.2, times


def test_rates_just_under_a_unit_are_said_in_the_next_one():
    assert format_rate(999.6e6) == "1gbit"  # not 1e+03mbit
    assert format_rate(999.4e6) == "999mbit"
    assert format_rate(1.23456e9) == "1.23gbit"
    assert format_rate(25e9) == "25gbit" and format_rate(None) == "loopback"


@pytest.mark.parametrize("flag", ["--link", "--links", "--bandwidth", "--sweep", "--intra-link"])
def test_an_empty_or_bad_rate_is_refused_naming_its_flag(capsys, flag):
    # An empty value was once read as no flag at all: --link '' ran the whole default bench.
    assert f"{flag} needs at least one rate" in _parse_error(capsys, [flag, ""])
    assert f"{flag}: bad rate 'fast'" in _parse_error(capsys, [flag, "fast"])


def test_numbers_that_are_not_finite_and_a_stray_params_are_refused(capsys):
    for flag in ("--timeout", "--lr", "--bucket-cap-mb"):
        for value in ("nan", "inf"):
            assert f"{flag} must be a positive number" in _parse_error(capsys, [flag, value])
    assert "add --task synthetic" in _parse_error(capsys, ["--params", "1M"])
    assert args.parse(["--task", "synthetic", "--params", "1M"]).params == 10**6
