"""``commhooks bench --fsdp``: the hooks on an FSDP2 model, each rank a machine."""

import json

import pytest

from commhooks import fsdp
from commhooks.bench import args, cli, hookset


def test_fsdp_bench_runs_the_hooks_on_a_sharded_model(tmp_path):
    path = tmp_path / "fsdp.json"
    argv = ["--fsdp", "--task", "synthetic", "--params", "200k", "--hooks",
            "allreduce,power_sgd_single_round", "--steps", "6", "--warmup", "2",
            "--json", str(path)]  # fmt: skip
    assert cli.main(argv) == 0
    doc = json.loads(path.read_text())
    assert doc["settings"]["fsdp"] is True
    rows = {r["hook"]: r for r in doc["results"]}
    assert all(r["ok"] for r in rows.values()), [r.get("error") for r in rows.values()]
    grad = rows["allreduce"]["gradient_bytes"]
    assert rows["allreduce"]["bytes_per_step"] == pytest.approx(grad)  # FSDP2's own: nothing
    assert 0 < rows["power_sgd_single_round"]["bytes_per_step"] < grad / 2
    assert "noop" in rows  # added for the prediction for 2 machines of 8 ranks
    # Each hook that averages does so across the ranks: every rank's model is the same.
    for hook in rows.keys() - {"noop"}:
        losses = rows[hook]["heldout_loss_per_rank"]
        assert losses[0] == pytest.approx(losses[1], abs=1e-6), hook


def test_fsdp_default_hooks_skip_those_without_meaning_on_shards():
    plan = args.parse(["--fsdp"])
    expected = [h for h in hookset.DEFAULT_HOOKS if h in fsdp.hook_names()]
    assert plan.fsdp and plan.hooks == expected
    assert "post_local_sgd" not in plan.hooks
    assert any("post_local_sgd" in note and "skipped" in note for note in plan.notes)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--hooks", "allreduce,batched_power_sgd"], "does not take batched_power_sgd"),
        (["--hooks", "floor_sync"], "does not take floor_sync"),
        (["--compare-torch"], "--compare-torch"),
    ],
)
def test_fsdp_bench_refuses_what_fsdp_cannot_run(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        args.parse(["--fsdp", *argv])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
