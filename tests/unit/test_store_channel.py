"""``StoreChannel.wait`` tells a timeout from a broken store with every store vLLM may hand the
workers: a TCPStore raises ``DistStoreError`` on a timeout, a FileStore (vLLM's ``file://``
init method, as under ``vllm serve`` on CPU) a plain ``RuntimeError``."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from ftkit.recovery.channel import StoreChannel


def test_a_filestore_timeout_is_a_timeout(tmp_path):
    channel = StoreChannel(dist.FileStore(str(tmp_path / "store"), 1))
    assert channel.wait(["never"], 0.2) is False
    channel.set("here", "1")
    assert channel.wait(["here"], 0.2) is True


def test_a_tcpstore_timeout_is_a_timeout():
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    channel = StoreChannel(store)
    assert channel.wait(["never"], 0.2) is False


def test_another_store_error_is_raised():
    class Broken:
        def wait(self, keys, timeout):
            raise RuntimeError("Connection reset by peer")

    channel = StoreChannel.__new__(StoreChannel)
    channel._store = Broken()
    with pytest.raises(RuntimeError, match="reset"):
        channel.wait(["x"], 0.2)
