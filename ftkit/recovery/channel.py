"""The side channel the ranks run recovery rounds over: a key-value store every rank reaches.

``SideChannel`` is the protocol; ``StoreChannel`` is the real one (a client of the job's
``torch.distributed`` TCP store) and ``MemoryChannel`` the in-process stand-in (a world of one,
unit tests). A store client is not shared between threads: each thread that runs rounds (the
main thread and the monitor thread) has a channel of its own, which ``side_channels`` makes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol


class SideChannel(Protocol):
    """A key-value store every rank reaches. Each thread uses its own client."""

    def set(self, key: str, value: str) -> None: ...
    def get(self, key: str) -> bytes: ...
    def wait(self, keys: list[str], timeout_s: float) -> bool:
        """True once every key is set; False if ``timeout_s`` passed first."""
    def has(self, key: str) -> bool: ...


class StoreChannel:
    """A ``SideChannel`` over a ``torch.distributed`` store (a private client of it)."""

    def __init__(self, store: Any, prefix: str = "ftkit/") -> None:
        import torch.distributed as dist

        self._store = dist.PrefixStore(prefix, store)

    def set(self, key: str, value: str) -> None:
        self._store.set(key, value)

    def get(self, key: str) -> bytes:
        return self._store.get(key)

    def wait(self, keys: list[str], timeout_s: float) -> bool:
        import torch.distributed as dist

        try:
            self._store.wait(keys, timedelta(seconds=timeout_s))
            return True
        except (dist.DistStoreError, RuntimeError) as exc:
            # torch raises the same class for a timeout and for a broken store, and tells
            # them apart only in the message (a TCPStore raises DistStoreError, a FileStore,
            # as vLLM's file:// init method gives, a plain RuntimeError "Wait timeout").
            if "timeout" in str(exc).lower():
                return False
            raise

    def has(self, key: str) -> bool:
        return self._store.check([key])


class MemoryChannel:
    """An in-process ``SideChannel`` for a world of one (and for unit tests)."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()

    def set(self, key: str, value: str) -> None:
        with self._cond:
            self._data[key] = value.encode()
            self._cond.notify_all()

    def get(self, key: str) -> bytes:
        with self._cond:
            return self._data[key]

    def wait(self, keys: list[str], timeout_s: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: all(k in self._data for k in keys), timeout_s)

    def has(self, key: str) -> bool:
        with self._cond:
            return key in self._data


@dataclass(frozen=True)
class SideChannels:
    """One rank's side channels: the main thread's, and a maker of the monitor thread's
    (``None`` when the rank has no peers to hear from, so no monitor runs)."""

    main: SideChannel
    for_monitor: Callable[[], SideChannel] | None


def side_channels(store: Any | None) -> SideChannels:
    """Channels over ``store`` (one client per thread), or in memory when ``store`` is
    ``None`` (a world of one)."""
    if store is None:
        return SideChannels(MemoryChannel(), None)
    return SideChannels(StoreChannel(store.clone()), lambda: StoreChannel(store.clone()))
