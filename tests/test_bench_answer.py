"""The bench's answer on hand-made rows: predictions per link, break-even, which hook to use,
time to allreduce's loss, noise flags, the report within 80 columns, and the records' JSON
round trips. No process is started."""

import json

import pytest

from commhooks.bench import args, predict, report, summary
from commhooks.bench.records import RankResult, RunOutcome, RunSpec
from commhooks.bench.rows import Row

MB = 1_000_000


def _row(hook, ms, payload, losses, bandwidth=None, spread=(0.0, 0.0)):
    """A successful row: mean and median step ``ms``, ``payload`` bytes allreduced per step."""
    low, high = spread
    steps = [ms - low, ms, ms, ms + high] if spread != (0.0, 0.0) else [ms] * 4
    return Row(
        hook=hook,
        bandwidth=bandwidth,
        ok=True,
        step_ms_median=ms,
        step_ms_mean=ms,
        step_ms=[steps, steps],
        payload_calls_per_step={"all_reduce": 1.0} if payload else {},
        payload_bytes_per_step={"all_reduce": float(payload)} if payload else {},
        heldout_loss=losses[-1],
        losses=[[i, loss, 0.1 * (i + 1)] for i, loss in enumerate(losses)],
    )


def _falling(start, rate, steps=10):
    return [start - rate * i for i in range(steps)]


def _plan(*argv):
    return args.parse(["--links", "100mbit,1gbit", *argv])


def _loopback_rows():
    """allreduce 60 ms for 1 MB, noop 40 ms, fp16 65 ms for 0.5 MB and the same losses as
    allreduce, power_sgd 80 ms for 10 kB but losses that lag behind."""
    reference = _falling(3.0, 0.1)
    return [
        _row("noop", 40.0, 0, _falling(3.0, 0.05)),
        _row("allreduce", 60.0, MB, reference),
        _row("fp16", 65.0, MB // 2, reference),
        _row("power_sgd", 80.0, 10_000, _falling(3.0, 0.06)),
    ]


def _answer(rows, plan):
    summary.analyse(rows, plan.sweep)
    return predict.predict(rows, plan)


def test_rows_get_predictions_per_link_and_break_even():
    rows, plan = _loopback_rows(), _plan()
    answer = _answer(rows, plan)
    by_hook = {r.hook: r for r in rows}
    wf = (1514 + 33) / 1448
    fp16 = by_hook["fp16"].predicted
    assert set(fp16) == {str(10**8), str(10**9)}
    # 65 ms + 0.5 MB * 8 * wf at 100 Mbit/s; allreduce 60 ms + 1 MB * 8 * wf
    assert fp16[str(10**8)]["step_ms"] == pytest.approx(65 + 40 * wf)
    assert fp16[str(10**8)]["speedup_vs_allreduce"] == pytest.approx(
        (60 + 80 * wf) / (65 + 40 * wf)
    )
    assert by_hook["allreduce"].predicted[str(10**9)]["speedup_vs_allreduce"] == 1.0
    # fp16 saves 4 Mbit * wf per step and costs 5 ms: it pays below 0.8 Gbit/s * wf
    assert by_hook["fp16"].break_even_bps == pytest.approx(8e8 * wf)
    assert by_hook["noop"].break_even_bps is None  # faster at every rate
    assert answer["backend_ns_per_byte"] == pytest.approx(20.0)
    assert answer["world_size"] == 2 and answer["links"] == [10**8, 10**9]


def test_another_world_size_scales_bytes_and_the_backends_work():
    rows, plan = _loopback_rows(), _plan("--world-size", "4")
    _answer(rows, plan)
    allreduce = {r.hook: r for r in rows}["allreduce"].predicted[str(10**8)]
    # 40 ms compute + 1.5 MB * 20 ns + 12 Mbit * wf at 100 Mbit/s
    assert allreduce["step_ms"] == pytest.approx(40 + 30 + 120 * (1514 + 33) / 1448)


def test_link_rows_carry_the_loopback_prediction_and_its_error():
    rows = _loopback_rows()
    link = _row("fp16", 130.0, MB // 2, _falling(3.0, 0.1), bandwidth=10**8)
    rows.append(link)
    _answer(rows, _plan("--bandwidth", "100mbit"))
    # From loopback, never from the link's own figures: 0.5 MB at 100 Mbit/s, less the 25 kB
    # the link's token bucket lets through at once when the allreduce starts it.
    predicted = 65 + 40 * (MB // 2 - 25_000) / (MB // 2) * (1514 + 33) / 1448
    assert link.prediction["step_ms"] == pytest.approx(predicted)
    assert link.prediction["error"] == pytest.approx(predicted / 130.0 - 1)
    assert link.predicted == {r.hook: r for r in rows[:4]}["fp16"].predicted


def test_recommendation_is_the_least_time_to_allreduces_loss():
    rows = _loopback_rows()
    answer = _answer(rows, _plan())
    by_hook = {r.hook: r for r in rows}
    # fp16 trains as allreduce does: it reaches allreduce's final loss at the same step.
    assert by_hook["fp16"].steps_to_allreduce_loss == by_hook["allreduce"].steps_to_allreduce_loss
    assert by_hook["power_sgd"].steps_to_allreduce_loss is None
    slow, fast = answer["recommendations"]
    assert slow["hook"] == "fp16" and "100mbit: fp16" in slow["text"]
    wf = (1514 + 33) / 1448
    ratio = (65 + 40 * wf) / (60 + 80 * wf)
    assert slow["time_to_loss_vs_allreduce"] == pytest.approx(ratio)
    assert fast["hook"] == "allreduce"  # at 1 Gbit/s fp16 is slower: 65 + 4.2 > 60 + 8.4
    # noop never is a recommendation, however fast; power_sgd never reached the loss
    assert answer["not_reaching_allreduce_loss"] == ["power_sgd"]
    only = _answer(_loopback_rows(), _plan("--link", "1gbit"))
    assert [r["bandwidth"] for r in only["recommendations"]] == [10**9]
    assert only["prediction"]["bandwidth"] == 10**9


def test_time_to_allreduces_loss_by_hand():
    # allreduce ends at 2.1 (mean of its last 5 losses: 2.5..2.1 -> 2.3)
    reference = _row("allreduce", 60.0, MB, _falling(3.0, 0.1))
    faster = _row("fp16", 60.0, MB, _falling(3.0, 0.2))
    rows = [reference, faster]
    summary.analyse(rows, sweep=False)
    # fp16's 5-step means: 2.6 at index 4, 2.4 at 5, 2.2 at 6 <= 2.3
    assert faster.steps_to_allreduce_loss == 7
    assert faster.time_to_allreduce_loss_s == pytest.approx(0.7)
    assert reference.steps_to_allreduce_loss == 10
    assert summary.smoothed([1.0, 2.0, 3.0], window=2) == [None, 1.5, 2.5]
    assert summary.first_reaching([None, 3.0, 1.0], 2.0) == 2


def test_noise_is_flagged_with_what_to_do():
    quiet = _row("allreduce", 60.0, MB, _falling(3.0, 0.1), spread=(1.0, 1.0))
    busy = _row("fp16", 60.0, MB, _falling(3.0, 0.1), spread=(30.0, 40.0))
    floor = _row("noop", 70.0, 0, _falling(3.0, 0.1))
    summary.analyse([quiet, busy, floor], sweep=False)
    assert busy.noise["noisy"] and "spread" in busy.noise["reasons"][0]
    assert "faster than noop" in quiet.noise["reasons"][0]  # 60 ms against noop's 70
    assert "--repeat" in quiet.noise["suggestion"] and "--lockstep" in quiet.noise["suggestion"]
    assert floor.noise == {
        "noisy": False,
        "relative_spread": 0.0,
        "reasons": [],
        "suggestion": None,
    }
    compact = "\n".join(report.results_lines([quiet, busy, floor], "title", wide=False))
    assert "noisy: 2 of 3 rows" in compact and "--repeat 3" in compact
    wide = report.results_lines([quiet, busy, floor], "title", wide=True)
    assert any(line.startswith("noisy fp16 @ loopback: step times spread") for line in wide)


def test_report_fits_80_columns_and_wide_shows_every_column():
    rows = _loopback_rows()
    rows.append(_row("torch_batched_power_sgd", 123456.0, MB, _falling(3.0, 0.1)))
    rows.append(_row("power_sgd_single_round", 95.0, 10_000, _falling(3.0, 0.1), bandwidth=10**8))
    answer = _answer(rows, _plan("--links", "10mbit,100mbit,1gbit,10gbit,25gbit,100gbit"))
    compact = report.results_lines(rows, "a title " * 20, wide=False)
    lines = compact + report.answer_lines(rows, answer, steps=10)
    assert max(len(line) for line in lines) <= 80, max(lines, key=len)
    assert "100gbit" in "\n".join(lines) and "pays below" in "\n".join(lines)
    wide = report.results_lines(rows, "title", wide=True)
    for column in ("x noop", "compression", "peak mem", "predicted", "error", "held-out loss"):
        assert column in wide[1]


def test_records_round_trip_through_json():
    spec = RunSpec(
        hook="power_sgd",
        options={"matrix_approximation_rank": 2},
        task="synthetic",
        params=10**6,
        seed=0,
        steps=10,
        warmup=2,
        heldout_at=10,
        lr=1e-3,
        bucket_cap_mb=25.0,
        host_ends=["a", "b"],
    )
    rank = RankResult(
        rank=1,
        step_s=[0.1, 0.2],
        losses=[[0, 3.0, 0.1]],
        heldout_loss=2.5,
        peak_memory_bytes=10,
        payload_calls={"all_reduce": 2},
        payload_bytes={"all_reduce": 800},
        wire=None,
        gradient_bytes=4000,
    )
    outcome = RunOutcome(ok=True, ranks=[rank], repeats=2)
    rows = _loopback_rows()
    _answer(rows, _plan())
    for record in (spec, rank, outcome, *rows):
        assert type(record).from_dict(json.loads(json.dumps(record.to_dict()))) == record
    with pytest.raises(ValueError, match="unknown field"):
        RunSpec.from_dict({**spec.to_dict(), "threads": 4})
    with pytest.raises(ValueError, match="RankResult"):
        RankResult.from_dict({"rank": 0})


def test_the_hooks_predictions_need_are_added_with_a_note():
    # Every run predicts for 2 machines of 8 ranks, which takes noop's step; speedups over
    # allreduce only where asked for.
    noop = "added hook 'noop': predictions for another shape need it"
    assert _plan_notes("--hooks", "fp16") == [noop]
    assert _plan_notes("--hooks", "noop,fp16") == []
    assert _plan_notes("--hooks", "fp16", "--sweep", "1gbit") == [
        noop,
        "added hook 'allreduce': speedups are over it",
    ]
    notes = _plan_notes("--hooks", "fp16", "--link", "1gbit", "--world-size", "8")
    assert len(notes) == 2 and "another shape" in notes[0]
    plan = args.parse(["--link", "3gbit"])
    assert plan.links == [10**8, 10**9, 3 * 10**9, 10**10, 25 * 10**9]
    assert plan.recommend_bps == [3 * 10**9] and plan.predict_world == plan.ranks == 2


def _plan_notes(*argv):
    return args.parse(list(argv)).notes


def test_hooks_other_than_the_references_train_longer():
    assert args.parse([]).reach_steps == 100 and args.parse(["--steps", "10"]).reach_steps == 25
    with pytest.raises(SystemExit):
        args.parse(["--steps", "10", "--reach-steps", "9"])


def test_plot_draws_the_prediction_and_the_measured_links(tmp_path):
    pytest.importorskip("matplotlib")
    from commhooks.bench.plot import write_plot

    rows = _loopback_rows()
    rows += [
        _row("allreduce", 150.0, MB, _falling(3.0, 0.1), bandwidth=10**8),
        _row("fp16", 110.0, MB // 2, _falling(3.0, 0.1), bandwidth=10**8),
    ]
    answer = _answer(rows, _plan("--bandwidth", "100mbit"))
    path = tmp_path / "bench.png"
    write_plot(str(path), rows, answer, "title")
    assert path.read_bytes()[:4] == b"\x89PNG" and path.stat().st_size > 20_000


def test_the_plots_legend_leaves_every_panels_axis_label_readable():
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from commhooks.bench.plot import draw

    names = ["noop", "allreduce", "fp16", "bf16", "power_sgd", "power_sgd_single_round"]
    names += ["post_local_sgd", "int8", "int4", "diloco", "streaming_diloco"]
    rows = [_row(name, 60.0 + i, MB // (i + 1), _falling(3.0, 0.1)) for i, name in enumerate(names)]
    fig = draw(rows, _answer(rows, _plan()), "title")
    fig.canvas.draw()  # where the axis labels go is settled when drawn
    renderer = fig.canvas.get_renderer()
    legend = fig.legends[0].get_window_extent(renderer)
    assert len(fig.legends[0].get_texts()) == len(names)
    for ax in fig.axes:
        label = ax.xaxis.label.get_window_extent(renderer)
        assert legend.y1 < label.y0, f"the legend covers {ax.get_xlabel()!r}"
    plt.close(fig)


def _timed(row, step_s):
    row.losses = [[i, loss, step_s * (i + 1)] for i, (_, loss, _) in enumerate(row.losses)]
    return row


def test_each_measured_link_says_which_hook_reached_allreduces_loss_first():
    # On the link allreduce steps in 130 ms and fp16 in 100 ms with losses falling twice as
    # fast: fp16 reaches allreduce's final loss at step 7 (0.7 s) against step 10 (1.3 s).
    rows = _loopback_rows() + [
        _timed(_row("allreduce", 130.0, MB, _falling(3.0, 0.1), bandwidth=10**8), 0.13),
        _timed(_row("fp16", 100.0, MB // 2, _falling(3.0, 0.2), bandwidth=10**8), 0.1),
        _timed(_row("noop", 40.0, 0, _falling(3.0, 0.5), bandwidth=10**8), 0.04),
    ]
    answer = _answer(rows, _plan("--bandwidth", "100mbit"))
    measured = answer["on_measured_links"]["100000000"]
    assert measured["hook"] == "fp16"  # noop, faster still, is never an answer
    assert measured["time_to_loss_vs_allreduce"] == pytest.approx(0.7 / 1.3)
    text = "On the 100mbit link, measured: use fp16; it reached allreduce's loss in 0.7s, 0.54x"
    assert measured["text"].startswith(text)
    lines = report.answer_lines(rows, answer, steps=10)
    assert any(line.startswith("On the 100mbit link, measured: use fp16") for line in lines)
    assert "on_measured_links" not in _answer(_loopback_rows(), _plan())
