"""The size limits of the library's modules (docs/architecture.md): no file of infinity/ or swap/
over 800 lines, no class there with more than 35 methods. A part that outgrows them is split
into objects that each own their state, not left to grow; the import layers themselves are
import-linter's contracts (pyproject.toml, run by make lint)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("infinity", "swap")
MAX_LINES = 800
MAX_METHODS = 35


def _sources() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def _methods(node: ast.ClassDef) -> int:
    return sum(isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) for item in node.body)


def oversized(
    paths: list[Path], max_lines: int = MAX_LINES, max_methods: int = MAX_METHODS
) -> list[str]:
    """Every file over ``max_lines`` lines and class over ``max_methods`` methods (properties,
    static and overloaded signatures count: each is a ``def`` a reader meets)."""
    found = []
    for path in paths:
        text = path.read_text(encoding="utf-8")
        name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        lines = len(text.splitlines())
        if lines > max_lines:
            found.append(f"{name}: {lines} lines (at most {max_lines})")
        for node in ast.walk(ast.parse(text, filename=str(path))):
            if isinstance(node, ast.ClassDef) and _methods(node) > max_methods:
                found.append(
                    f"{name}:{node.lineno} class {node.name}: {_methods(node)} methods "
                    f"(at most {max_methods})"
                )
    return found


def test_no_module_or_class_of_the_library_is_over_its_limit():
    sources = _sources()
    assert len(sources) > 50  # the packages were found
    assert oversized(sources) == []


def test_the_check_finds_a_long_file_and_a_large_class(tmp_path):
    big = tmp_path / "big.py"
    methods = "".join(f"    def m{i}(self):\n        return {i}\n" for i in range(4))
    big.write_text("class Big:\n" + methods + "\n" * 5)
    assert oversized([big], max_lines=100, max_methods=3) == [
        f"{big}:1 class Big: 4 methods (at most 3)"
    ]
    assert oversized([big], max_lines=8, max_methods=4) == [f"{big}: 14 lines (at most 8)"]
    assert oversized([big], max_lines=14, max_methods=4) == []
