"""The CPU backend's device recovery (no process group needed)."""

from __future__ import annotations

import weakref

import torch

from ftkit.backends.cpu import CpuBackend


class _Node:
    pass


def test_an_oom_recovery_frees_tensors_left_in_reference_cycles():
    node = _Node()
    node.itself = node
    node.activations = torch.zeros(1 << 16)
    freed = weakref.ref(node.activations)
    del node
    CpuBackend(rank=0).recover_device(("oom",))
    assert freed() is None
