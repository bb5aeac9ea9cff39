"""What the wheel holds: the library's packages and the bench's baselines, under one name."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from setuptools.config.pyprojecttoml import read_configuration

ROOT = Path(__file__).resolve().parents[1]


def _declared() -> dict[str, object]:
    tool: dict[str, dict[str, object]] = read_configuration(ROOT / "pyproject.toml")["tool"]
    return tool["setuptools"]


@pytest.mark.filterwarnings("ignore::UserWarning")  # setuptools: [tool.distutils] is new
def test_the_package_list_names_every_package_under_src_and_the_baselines() -> None:
    under_src = {
        ".".join(init.parent.relative_to(ROOT / "src").parts)
        for init in (ROOT / "src").rglob("__init__.py")
    }
    declared = set(_declared()["packages"])  # type: ignore[call-overload]
    assert declared == under_src | {"commhooks.bench.baselines"}
    mapped = _declared()["package-dir"]["commhooks.bench.baselines"]  # type: ignore[index]
    assert (ROOT / mapped / "__init__.py").is_file()


def test_a_checkout_imports_the_baselines_as_part_of_the_bench() -> None:
    done = subprocess.run(
        [sys.executable, "-c", "import commhooks.bench.baselines.floors as f; print(f.__file__)"],
        env={"PYTHONPATH": str(ROOT / "src")},
        capture_output=True,
        text=True,
        check=True,
    )
    assert Path(done.stdout.strip()).is_relative_to(ROOT / "baselines")


@pytest.mark.timeout(170)
def test_the_wheel_has_one_top_level_package_with_the_baselines_inside_the_bench(
    tmp_path: Path,
) -> None:
    tree = tmp_path / "tree"  # built from a copy: the build leaves the checkout as it was
    for part in ("src", "baselines"):
        shutil.copytree(ROOT / part, tree / part, ignore=shutil.ignore_patterns("__pycache__"))
    for part in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / part, tree / part)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), str(tree)],
        check=True, capture_output=True, cwd=tmp_path,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("commhooks-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"commhooks"}
    assert "commhooks/bench/baselines/__init__.py" in names
    assert "commhooks/bench/baselines/floors.py" in names
    assert "commhooks/compress/cpu_kernels/_blockquant.c" in names
    assert "commhooks/compress/cpu_kernels/_base13.c" in names
