"""Each rank's record of faults fired and recoveries run: JSON lines, one file per rank.

The file is the only channel that survives the engine's death, so every event is written
and flushed as it happens. Readers merge the files of all ranks (``read_events``).
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any


class EventLog:
    def __init__(self, rank: int, directory: str | None) -> None:
        self.rank = rank
        self._lock = threading.Lock()
        self._path = Path(directory) / f"rank{rank}-{os.getpid()}.jsonl" if directory else None
        self.events: list[dict[str, Any]] = []

    def emit(self, event: str, **fields: Any) -> None:
        record = {"event": event, "rank": self.rank, "time": time.time(), **fields}
        with self._lock:
            self.events.append(record)
            if self._path is not None:
                with open(self._path, "a", encoding="utf-8") as f:
                    f.write(json.dumps(record) + "\n")


def read_events(directory: str | Path) -> list[dict[str, Any]]:
    """Every event of every rank in ``directory``, ordered by time."""
    events: list[dict[str, Any]] = []
    for path in sorted(Path(directory).glob("rank*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                try:
                    events.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a line cut short by a killed process
    events.sort(key=lambda e: e.get("time", 0.0))
    return events
