"""The runner of the README's and the docs' blocks (tests/snippet_runner.py) gives each script
what ``python snippet.py`` run from its directory would: its argv, path, cwd, environment and
``__main__``, the interpreter's exit (atexit, the status of ``sys.exit`` or of an exception), and
nothing left over from the script before it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.snippet_runner import SnippetRunner


def _run(runner: SnippetRunner, where: Path, code: str, timeout: float = 300, **env: str):
    where.mkdir()
    script = where / "snippet.py"
    script.write_text(code)
    return runner.run(script, where, {**os.environ, **env}, timeout)


def test_a_script_runs_as_its_own_main_program(snippet_runner, tmp_path):
    first = _run(
        snippet_runner,
        tmp_path / "first",
        "import atexit, os, sys\n"
        "import infinity\n"
        "print(sys.argv, sys.path[0], os.getcwd(), __name__, __file__, os.environ['GIVEN'])\n"
        "os.environ['LEFT'] = '1'\n"
        "infinity.LEFT = 1\n"
        "atexit.register(lambda: print('at exit'))\n"
        "print('to stderr', file=sys.stderr)\n"
        "sys.exit(3)\n",
        GIVEN="given",
    )
    script, where = tmp_path / "first" / "snippet.py", str(tmp_path / "first")
    assert first.returncode == 3, first.stderr
    assert first.stdout.splitlines() == [
        f"{[str(script)]} {where} {where} __main__ {script} given",
        "at exit",
    ]
    assert first.stderr == "to stderr\n"

    second = _run(
        snippet_runner,
        tmp_path / "second",
        "import os, sys\nimport infinity\n"
        "print(os.environ.get('LEFT'), hasattr(infinity, 'LEFT'), sys.stdin.read())\n"
        "raise ValueError('the snippet failed')\n",
    )
    assert second.returncode == 1
    assert second.stdout == "None False \n"
    assert second.stderr.rstrip().endswith("ValueError: the snippet failed"), second.stderr


def test_a_script_past_its_timeout_is_killed_and_the_next_runs(snippet_runner, tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        _run(snippet_runner, tmp_path / "sleeps", "import time\ntime.sleep(600)\n", timeout=1)
    done = _run(snippet_runner, tmp_path / "next", "print('ran')\n")
    assert (done.returncode, done.stdout) == (0, "ran\n")
