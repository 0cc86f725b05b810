"""ftkit's public surface: what ``import ftkit`` gives, and that the front ends, the benchmarks
and the examples use nothing else."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import ftkit

ROOT = Path(__file__).resolve().parents[2]
#: Code outside the library that may use only the public surface. (The benchmark-only legacy
#: plugin imports nothing of ftkit at all: it stands for the earlier design.)
CONSUMERS = [ROOT / "cli", ROOT / "benchmarks", ROOT / "examples"]


def private_imports(source: str) -> list[str]:
    """Every import in ``source`` that reaches past ``ftkit``'s public names."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "ftkit":
                found += [f"ftkit.{a.name}" for a in node.names if a.name not in ftkit.__all__]
            elif node.module.startswith("ftkit."):
                found.append(f"from {node.module} import ...")
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("ftkit.")]
    return found


def consumer_files() -> list[Path]:
    return sorted(p for root in CONSUMERS for p in root.rglob("*.py")
                  if ".venv" not in p.parts and "build" not in p.parts)


def test_every_public_name_resolves_and_is_listed():
    assert ftkit.__all__ == sorted(set(ftkit.__all__))
    for name in ftkit.__all__:
        assert getattr(ftkit, name) is not None, name
    assert set(ftkit.__all__) <= set(dir(ftkit))
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        ftkit.not_a_name  # noqa: B018


def test_import_ftkit_loads_neither_vllm_nor_torch():
    """ftkit's vLLM plugin runs in every vLLM process: the package itself must be cheap."""
    code = ("import sys, ftkit; ftkit.ScenarioRunner; ftkit.load_scenario; "
            "print(sorted(m for m in ('vllm', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("path", consumer_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_front_ends_benchmarks_and_examples_use_only_the_public_surface(path):
    assert private_imports(path.read_text(encoding="utf-8")) == []


@pytest.mark.parametrize("source,expected", [
    ("from ftkit.runner import ScenarioRunner", ["from ftkit.runner import ..."]),
    ("import ftkit.vllm.engine", ["ftkit.vllm.engine"]),
    ("def f():\n    from ftkit import _EXPORTS", ["ftkit._EXPORTS"]),
    ("from ftkit import ScenarioRunner, load_scenario", []),
    ("import ftkit", []),
])
def test_the_check_sees_private_imports(source, expected):
    assert private_imports(source) == expected
