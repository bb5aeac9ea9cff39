"""The README and the documentation say what the code does.

The README's bench sample is a real run's output: it must be exactly what the bench's report
code prints today from that run's figures (``docs/assets/bench-sample.json``), so that a change
of the output's format, or a placeholder, fails here until the sample is taken again.
"""

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from commhooks.bench import args, conclusion, report
from commhooks.bench.rows import Row

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
SAMPLE_JSON = DOCS / "assets" / "bench-sample.json"
SAMPLE_START = "<!-- --8<-- [start:bench-sample] -->"
SAMPLE_END = "<!-- --8<-- [end:bench-sample] -->"


def readme() -> str:
    return README.read_text()


def bench_sample() -> str:
    """The text of the README's bench sample, inside its code fence."""
    text = readme()
    section = text[text.index(SAMPLE_START) + len(SAMPLE_START) : text.index(SAMPLE_END)]
    match = re.fullmatch(r"\s*```text\n(.*?)\n```\s*", section, re.S)
    assert match, f"the bench sample is not one ```text block:\n{section}"
    return match.group(1)


def sample_document() -> dict[str, Any]:
    document: dict[str, Any] = json.loads(SAMPLE_JSON.read_text())
    return document


def _plan_argv(argv: list[str]) -> list[str]:
    """The run's flags without its output files, which need not exist here."""
    out, skip = [], False
    for arg in argv[2:]:  # "commhooks", "bench"
        if skip:
            skip = False
        elif arg in ("--json", "--plot"):
            skip = True
        elif not arg.startswith(("--json=", "--plot=")):
            out.append(arg)
    return out


def test_readme_is_a_front_page_of_at_most_250_lines() -> None:
    lines = readme().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move detail into docs/"
    assert lines[0] == "# commhooks"


def test_readme_opens_with_the_main_job_and_the_test_command_that_ci_runs() -> None:
    blocks = re.findall(r"```bash\n(.*?)```", readme(), re.S)
    main_job, tests = blocks[0], blocks[1]
    assert "pip install" in main_job and main_job.rstrip().endswith("commhooks bench")
    test_command = tests.rstrip().split("&&")[-1].strip()
    assert test_command == "python -m pytest -q"
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    ci_commands = [line.strip() for line in ci if line.strip() and not line.startswith("#")]
    assert ci_commands[-1] == "python3 -m pytest -q", "CI must end with the README's test command"
    assert any(line.startswith('python3 -m pip install -q -e ".[test') for line in ci_commands)
    assert any("mkdocs build --strict" in line for line in ci_commands)


def test_the_bench_sample_is_what_the_report_prints_from_the_sample_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    sample = bench_sample()
    assert not re.search(r"\b[A-Z]+_[A-Z_]+\b", sample), "a placeholder in the bench sample"
    document = sample_document()
    rows = [Row.from_dict(r) for r in document["results"]]
    plan = args.parse(_plan_argv(document["environment"]["argv"]))
    comparisons = {k: document[k] for k in ("sweep",) if k in document}
    report.print_report(
        rows,
        comparisons,
        document["answer"],
        conclusion.title(plan),
        wide=False,
        reach_steps=document["settings"]["reach_steps"],
    )
    printed = capsys.readouterr().out.rstrip("\n")
    assert sample == printed, (
        "README.md's bench sample is not what `commhooks bench` prints today. Run the bench, "
        "paste the last screen from its title line to the end of its answer, and save its "
        "--json (without per-step lists) as docs/assets/bench-sample.json.\n"
        f"printed now:\n{printed}"
    )


def test_the_bench_sample_shows_the_tables_and_the_answer() -> None:
    sample = bench_sample().splitlines()
    header = [name for name, _ in report.LOOPBACK_COLUMNS]
    assert re.split(r"\s{2,}", sample[sample.index("measured on loopback:") + 1]) == header
    # The answer for the two ranks run, and for the usual cluster: 2 machines of 8 GPUs.
    assert "Which hook on which link, 2 machines x 1 rank (predicted time to loss):" in sample
    assert "Which hook on which link, 2 machines x 8 ranks (predicted time to loss):" in sample
    assert all(len(line) <= report.WIDTH for line in sample)
    assert (DOCS / "assets" / "bench-speedup.png").stat().st_size < 200_000


def _relative_links(text: str) -> list[str]:
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    return [link for link in links if not re.match(r"[a-z]+:", link) and not link.startswith("#")]


def test_readme_links_point_at_files_that_exist() -> None:
    links = _relative_links(readme())
    assert any(link.startswith("docs/") for link in links)
    for link in links:
        path = ROOT / link.split("#")[0]
        assert path.exists(), f"README.md links to {link}, which does not exist"


def _test_functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}


def test_every_test_the_documentation_names_exists() -> None:
    cited = set()
    for page in DOCS.rglob("*.md"):
        cited |= set(re.findall(r"(test_\w+\.py)::(test_\w+)", page.read_text()))
    assert len(cited) >= 20
    for file, name in sorted(cited):
        assert name in _test_functions(ROOT / "tests" / file), f"docs cite {file}::{name}"


@pytest.mark.timeout(120)
def test_the_custom_hook_example_agrees_with_allreduce() -> None:
    src = [str(ROOT / "src")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*src, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "custom_hook.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "agrees with allreduce_hook on every rank" in done.stdout


def _resolves(name: str) -> bool:
    """Whether ``name`` (``commhooks.a.b``) is a module, or a module's attribute, that exists."""
    import importlib

    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(found, attr):
                return False
            found = getattr(found, attr)
        return True
    return False


def test_every_commhooks_name_the_package_writes_can_be_imported():
    # Error messages and docstrings tell users what to import: a name that moved must not
    # stay in a message (as commhooks.integrations.PerRankState once did).
    names = set()
    for path in (ROOT / "src" / "commhooks").rglob("*.py"):
        names |= set(re.findall(r"\bcommhooks(?:\.[A-Za-z_]\w*)+", path.read_text()))
    assert len(names) > 50
    assert [n for n in sorted(names) if not _resolves(n)] == []
    assert not _resolves("commhooks.integrations.PerRankState")
