"""Fixtures of the serving tests. The server itself: ``_server.vllm_server`` (import it as
``from _server import vllm_server``; every test directory here has a ``conftest`` module)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def tiny_model() -> str:
    from ftkit import build_tiny_model

    return str(build_tiny_model())
