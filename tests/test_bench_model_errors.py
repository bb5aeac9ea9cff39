"""The bench's errors about what it was given, found before any hook runs: an output file that
cannot be written, and a ``--model`` that cannot be trained, each one line with the fix and a
non-zero exit, on one process and under torchrun."""

import os

import pytest

from commhooks.bench import cli


# -- 11: output files ---------------------------------------------------------------------------
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
@pytest.mark.parametrize("flag", ["--json", "--plot"])
def test_an_unwritable_output_is_refused_before_the_run(flag, capsys):
    if flag == "--plot":
        pytest.importorskip("matplotlib")  # refused first for want of it otherwise
    path = "/proc/x.json" if flag == "--json" else "/proc/x.png"
    with pytest.raises(SystemExit) as exited:
        cli.main(["--hooks", "allreduce", "--steps", "2", flag, path])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"{flag} '{path}': it cannot be written" in err and "Traceback" not in err


def test_a_directory_is_refused_as_an_output_and_a_writable_path_leaves_nothing(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli.main(["--hooks", "allreduce", "--json", str(tmp_path)])
    assert f"is a directory: give a file in it, e.g. '{tmp_path}/bench.json'" in (
        capsys.readouterr().err
    )
    from commhooks.bench import args

    args.parse(["--hooks", "allreduce", "--json", str(tmp_path / "out.json")])
    assert list(tmp_path.iterdir()) == []  # the probe is gone, and no file was made
