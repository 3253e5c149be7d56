"""The wheel a user installs: built from the repository as it stands, installed into a fresh
venv that already has torch (the project venv's packages, reached through a .pth line, so nothing
is downloaded), it holds only the library's own top-level packages, and each console script
answers ``--help``."""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.snippet_runner import SnippetRunner

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
#: what the console scripts import before the wheel's own packages (seconds of each one's start)
THIRD_PARTY = ("numpy", "torch", "torch.distributed.checkpoint")
#: what a build must not see: caches, environments and outputs that a clean clone lacks (a stale
#: build/lib would otherwise reach the wheel)
LEFT_OUT = shutil.ignore_patterns(
    ".git",
    ".venv",
    "*_cache",
    ".hypothesis",
    "__pycache__",
    "build",
    "dist",
    "site",
    "*.egg-info",
    "demo-output",
    "out",
)


def _run(command: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600, check=False
    )


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, str]]:
    """(the wheel, the fresh venv's bin directory, the environment to run it in)."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"
    shutil.copytree(ROOT, source, ignore=LEFT_OUT)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PIP_NO_INDEX"] = "1"  # offline: the build backend (setuptools) is the project venv's
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    dist = tmp / "dist"
    built = _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(dist)]
        + [str(source)],
        tmp,
        env,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = dist.glob("*.whl")

    target = tmp / "venv"
    venv.EnvBuilder(with_pip=False).create(target)
    python = target / "bin" / "python"
    purelib = _run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp, env
    )
    # A plain path line, not a site directory: the project venv's own .pth files (its editable
    # install of this repository among them) are not run, so `infinity` can only be the wheel's.
    project_packages = sysconfig.get_paths()["purelib"]
    Path(purelib.stdout.strip(), "project-packages.pth").write_text(project_packages + "\n")
    install = _run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", str(wheel)],
        tmp,
        env,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    return wheel, target / "bin", env


def test_the_wheel_has_no_generic_top_level_package(installed):
    wheel, _, _ = installed
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    top = {name.split("/")[0] for name in names}
    info = {name for name in top if name.endswith(".dist-info")}
    assert len(info) == 1, top
    assert top - info == {"infinity", "swap"}
    # the command-line package is in it (the console scripts' modules), the benchmarks are not
    assert "infinity/cli/demo.py" in names and "infinity/cli/disk/fio.py" in names
    # the fused optimizer kernel's source, built where the wheel is used
    assert "infinity/training/fused_adam.c" in names
    assert not any(name.startswith("tools/") for name in names)
    # the license text ships, and the metadata names it by its SPDX expression
    (info_dir,) = info
    assert f"{info_dir}/licenses/LICENSE" in names
    with zipfile.ZipFile(wheel) as archive:
        metadata = archive.read(f"{info_dir}/METADATA").decode()
    assert "License-Expression: Apache-2.0" in metadata.splitlines()


@pytest.fixture(scope="module")
def wheel_python(installed, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SnippetRunner]:
    """Runs scripts on the fresh venv's python, forked from a server that imported torch and
    what infinity imports of it (tests/snippet_runner.py), not infinity: each script imports the
    wheel's."""
    _, bin_dir, env = installed
    log = tmp_path_factory.mktemp("wheel-scripts") / "stderr"
    runner = SnippetRunner(env, log, bin_dir / "python", THIRD_PARTY)
    yield runner
    runner.close()


def test_each_console_script_runs_help_from_the_installed_wheel(installed, wheel_python, tmp_path):
    wheel, bin_dir, env = installed
    with zipfile.ZipFile(wheel) as archive:
        (entry_points,) = [
            n for n in archive.namelist() if n.endswith(".dist-info/entry_points.txt")
        ]
        parser = configparser.ConfigParser()
        parser.read_string(archive.read(entry_points).decode())
    scripts = dict(parser["console_scripts"])
    assert set(scripts) == {
        "infinity-bench",
        "infinity-train",
        "infinity-export",
        "infinity-generate",
        "infinity-plan",
    }
    assert all(target.startswith("infinity.cli.") for target in scripts.values()), scripts
    where = _run(
        [
            str(bin_dir / "python"),
            "-c",
            "import importlib.util, infinity, swap; print(infinity.__file__, swap.__file__); "
            "print(importlib.util.find_spec('tools'))",
        ],
        tmp_path,
        env,
    )
    assert where.returncode == 0, where.stderr
    packages, tools = where.stdout.splitlines()
    for path in packages.split():
        assert Path(path).is_relative_to(bin_dir.parent), where.stdout
    # so a console script that imported the repository's tools/ would fail below
    assert tools == "None", where.stdout
    for name in scripts:
        # run from an empty folder: the repository's checkout is not on the path
        done = wheel_python.run(bin_dir / name, tmp_path, env, timeout=600, args=("--help",))
        assert done.returncode == 0, f"{name}: {done.stdout}{done.stderr}"
        assert done.stdout.startswith("usage: "), f"{name}: {done.stdout}"
