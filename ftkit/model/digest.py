"""Content digests of model directories, for cache keys."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

_CHUNK = 1 << 20


def directory_digest(path: str | Path) -> str:
    """SHA-256 over every file's relative path and bytes, in sorted order.

    A memo file in the directory's parent is not used: real models are hashed once per
    process and the result kept in memory (``_memo``), keyed by path, sizes and mtimes.
    """
    root = Path(path)
    files = sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))
    stamp = json.dumps([(str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns)
                        for p in files])
    key = (str(root.resolve()), stamp)
    if key in _memo:
        return _memo[key]
    h = hashlib.sha256()
    for p in files:
        h.update(str(p.relative_to(root)).encode() + b"\0")
        with open(p, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
        h.update(b"\0")
    _memo[key] = h.hexdigest()
    return _memo[key]


_memo: dict[tuple[str, str], str] = {}
