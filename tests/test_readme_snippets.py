"""The README's code blocks run as written: each ```python block is extracted and executed in a
process of its own from an empty directory, as a user pasting it would (forked from a server that
imported torch and infinity once: tests/snippet_runner.py), so the README cannot go stale
silently. A block that is not meant to run on its own is fenced ```python no-run, or has
``<!-- no-run: why -->`` on the line before its fence (the form mkdocs renders; none in the README
today). The docs' snippets have their own test, tests/test_docs_snippets.py."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.snippet_runner import SnippetRunner

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```python([^\n]*)\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL)
NO_RUN = re.compile(r"<!--\s*no-run\b[^\n]*-->\s*$")


def python_blocks(path: Path) -> list[tuple[str, str]]:
    """(an id naming the file and line, the code) of each runnable ```python block."""
    text = path.read_text()
    blocks = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].splitlines()[-1:]  # the line right before the fence
        if "no-run" in match.group(1) or (before and NO_RUN.match(before[0].strip())):
            continue
        line = text.count("\n", 0, match.start()) + 1
        blocks.append((f"{path.name}:{line}", match.group(2)))
    return blocks


README_BLOCKS = python_blocks(ROOT / "README.md")


def run_block(runner: SnippetRunner, code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Runs ``code`` as a script in ``cwd`` in a process of its own (``runner``: see
    tests/snippet_runner.py), the repository importable as an installed package would be."""
    script = cwd / "snippet.py"
    script.write_text(code)
    return runner.run(script, cwd, {**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)


def test_the_readme_has_runnable_blocks():
    assert len(README_BLOCKS) >= 2, "the README's quickstarts are ```python blocks"


@pytest.mark.slow
@pytest.mark.parametrize("code", [c for _, c in README_BLOCKS], ids=[i for i, _ in README_BLOCKS])
def test_readme_block_runs_as_written(snippet_runner, tmp_path, code):
    done = run_block(snippet_runner, code, tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
