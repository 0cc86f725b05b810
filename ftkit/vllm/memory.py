"""What a memory error can hit in a vLLM worker, and how to repair it.

A device reports an uncorrectable memory error (UCE) as an address range. ``RunnerMemory``
tells, for such a range, what lives there: KV cache blocks (which block ids), model weights
(which parameters), or neither (activations and other transient buffers, which a re-run
recomputes). The Ascend backend will hand it the addresses ``_get_uce_addr`` reports; the CPU
fault model hands it the addresses it corrupted.

Repairs: KV blocks are recomputed by the runner state (``V1RunnerState.mark_kv_lost``); a hit
parameter is reloaded from the model checkpoint through the model's own ``load_weights``, which
fuses and shards the checkpoint tensors exactly as at start.

The same class gives the CPU fault model its targets (the blocks a request owns, a parameter's
bytes), so an injected error lands where the classification will look for it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ftkit.backends.base import MemoryFault
from ftkit.errors import FtkitError

log = logging.getLogger("ftkit")

#: Bytes of a parameter the CPU fault model corrupts at most (one page of HBM).
UCE_REGION_BYTES = 4096
#: The value a device reset leaves in the KV cache on the CPU fault model.
POISON = 3.0


@dataclass
class MemoryHits:
    """What a set of memory faults hit."""

    kv_blocks: set[int] = field(default_factory=set)
    params: set[str] = field(default_factory=set)
    #: Faults in neither the KV cache nor the weights (activations, scratch buffers).
    other: int = 0


#: Why a parameter without a checkpoint tensor of its own name is not reloaded.
NOT_RELOADABLE = ("vLLM builds it from several checkpoint tensors in a layout of its own, as "
                  "it does an MoE layer's fused experts, which ftkit does not rebuild yet")


def _missing_reason(missing: set[str]) -> str:
    return f"the checkpoint has no tensor {', '.join(sorted(missing))} ({NOT_RELOADABLE})"


class RunnerMemory:
    """The KV cache and weights of one rank's model runner, by address."""

    def __init__(self, runner: Any, model_path: str | None) -> None:
        self.runner = runner
        self.model_path = model_path

    # --- the KV cache ---------------------------------------------------------------------------

    def kv_tensors(self) -> list[torch.Tensor]:
        return [t for t in getattr(self.runner, "kv_caches", []) if isinstance(t, torch.Tensor)]

    @property
    def num_blocks(self) -> int:
        return int(self.runner.kv_cache_config.num_blocks)

    def _block_dim(self, kv: torch.Tensor) -> int:
        # The block dimension is the one whose size is the number of blocks (dimension 0 in
        # the CPU layout, 1 behind a leading K/V dimension in flash-attention layouts).
        for dim, size in enumerate(kv.shape):
            if size == self.num_blocks:
                return dim
        raise FtkitError(f"cannot find the block dimension of a KV cache of shape "
                         f"{tuple(kv.shape)} ({self.num_blocks} blocks)")

    def block_of(self, address: int) -> int | None:
        """The KV block id that holds ``address``, or ``None`` if it is not in the KV cache."""
        for kv in self.kv_tensors():
            start = kv.data_ptr()
            end = start + _extent_bytes(kv)
            if not start <= address < end:
                continue
            dim = self._block_dim(kv)
            block_bytes = kv.stride(dim) * kv.element_size()
            index = (address - start) // block_bytes
            return int(index % kv.shape[dim])
        return None

    def block_region(self, block_id: int, layer: int = 0) -> tuple[torch.Tensor, MemoryFault]:
        """The view of one block in one layer's KV cache, and its address range."""
        kv = self.kv_tensors()[layer]
        view = kv.select(self._block_dim(kv), block_id)
        return view, MemoryFault(view.data_ptr(), _extent_bytes(view))

    def poison_kv(self) -> None:
        """What a device reset leaves in the KV cache: every block overwritten (with one
        finite value: stale contents a correct recovery never reads)."""
        for kv in self.kv_tensors():
            kv.fill_(POISON)

    def request_blocks(self, match: Callable[[str], bool]) -> list[int]:
        """The block ids (first KV group) of the first request whose id ``match`` accepts."""
        for req_id, state in self.runner.requests.items():
            if match(req_id):
                return list(state.block_ids[0]) if state.block_ids else []
        return []

    def owners(self, block_ids: set[int]) -> list[str]:
        """The requests whose KV lives (partly) in these blocks."""
        return [req_id for req_id, state in self.runner.requests.items()
                if any(b in block_ids for ids in state.block_ids for b in ids)]

    # --- the weights ----------------------------------------------------------------------------

    def parameters(self) -> dict[str, torch.Tensor]:
        """The model's parameters that hold their data (CPU linear layers keep theirs packed
        elsewhere and leave an empty parameter behind)."""
        return {name: p for name, p in self.runner.get_model().named_parameters()
                if p.numel() > 0}

    def parameter_names(self) -> list[str]:
        return list(self.parameters())

    def param_of(self, address: int) -> str | None:
        for name, p in self.parameters().items():
            start = p.data_ptr()
            if start <= address < start + p.numel() * p.element_size():
                return name
        return None

    def default_uce_parameter(self) -> str:
        """The parameter the CPU fault model hits unless told otherwise: the final norm's
        weight (every logit depends on it, so a missed repair cannot go unnoticed)."""
        params = self.parameters()
        norms = sorted((n for n in params if n.endswith("norm.weight")),
                       key=lambda n: (n.count("."), n))
        if not norms:
            raise FtkitError("the model has no norm weight to hit; name a parameter in "
                             "params.parameter")
        return norms[0]

    def param_region(self, name: str) -> tuple[torch.Tensor, MemoryFault]:
        params = self.parameters()
        if name not in params:
            raise FtkitError(f"model has no parameter {name!r} holding data; known: "
                             f"{', '.join(sorted(params))}")
        flat = params[name].data.view(-1)
        count = max(1, min(flat.numel(), UCE_REGION_BYTES // flat.element_size()))
        region = flat[:count]
        return region, MemoryFault(region.data_ptr(), count * flat.element_size())

    def reload_params(self, names: set[str]) -> list[str]:
        """Reload the named parameters from the checkpoint; returns the names reloaded."""
        model = self.runner.get_model()
        wanted = {ckpt: name for name in names for ckpt in self._checkpoint_names(model, name)}
        tensors = list(self._read_checkpoint(set(wanted)))
        missing = set(wanted) - {n for n, _ in tensors}
        if missing:
            raise FtkitError(_missing_reason(missing))
        with torch.no_grad():
            model.load_weights(tensors)
        return sorted(names)

    def not_reloadable(self, name: str) -> str | None:
        """Why a memory error in parameter ``name`` could not be repaired by reloading it
        from the checkpoint (``None``: it can)."""
        try:
            wanted = set(self._checkpoint_names(self.runner.get_model(), name))
            found = {key for key, _ in self._checkpoint_entries(wanted)}
        except FtkitError as exc:
            return str(exc)
        missing = wanted - found
        return _missing_reason(missing) if missing else None

    @staticmethod
    def _checkpoint_names(model: Any, name: str) -> list[str]:
        # vLLM fuses some checkpoint tensors into one parameter (qkv_proj from q/k/v_proj).
        packed = getattr(model, "packed_modules_mapping", {}) or {}
        module, _, leaf = name.rpartition(".")
        parent, _, last = module.rpartition(".")
        if last in packed:
            return [f"{parent}.{part}.{leaf}" for part in packed[last]]
        return [name]

    def _read_checkpoint(self, names: set[str]):
        """The checkpoint tensors of ``names`` that exist: (name, tensor)."""
        for key, handle in self._checkpoint_entries(names):
            yield key, handle.get_tensor(key)

    def _checkpoint_entries(self, names: set[str]):
        """Those of ``names`` the checkpoint holds, each with its open file (read from the
        files' headers: no tensor data is loaded)."""
        from safetensors import safe_open

        if self.model_path is None:
            raise FtkitError("the model's checkpoint directory is unknown")
        root = Path(self.model_path)
        index = root / "model.safetensors.index.json"
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            files = {weight_map[n] for n in names if n in weight_map}
        else:
            files = {p.name for p in root.glob("*.safetensors")}
        for file in sorted(files):
            with safe_open(str(root / file), framework="pt") as f:
                for key in f.keys():
                    if key in names:
                        yield key, f

    # --- activations ----------------------------------------------------------------------------

    def activation_region(self) -> tuple[torch.Tensor, MemoryFault]:
        """A buffer of the step that is neither KV nor weights: the runner's input-token
        buffer, which every step fills anew."""
        buf = self.runner.input_ids
        tensor = getattr(buf, "gpu", buf)
        return tensor, MemoryFault(tensor.data_ptr(), _extent_bytes(tensor))

    # --- classification -------------------------------------------------------------------------

    def classify(self, faults: list[MemoryFault]) -> MemoryHits:
        """What each fault's address range hits (its first and last byte are looked at)."""
        hits = MemoryHits()
        for fault in faults:
            found = False
            for address in {fault.address, fault.address + max(fault.size, 1) - 1}:
                block = self.block_of(address)
                if block is not None:
                    hits.kv_blocks.add(block)
                    found = True
                    continue
                param = self.param_of(address)
                if param is not None:
                    hits.params.add(param)
                    found = True
            # A range that spans blocks: every block between its ends is hit too.
            hits.kv_blocks |= self._blocks_between(fault)
            if not found:
                hits.other += 1
        return hits

    def _blocks_between(self, fault: MemoryFault) -> set[int]:
        first = self.block_of(fault.address)
        last = self.block_of(fault.address + max(fault.size, 1) - 1)
        if first is None or last is None or last < first:
            return set()
        return set(range(first, last + 1))


def _extent_bytes(t: torch.Tensor) -> int:
    """Bytes from a tensor's first element to just past its last (views included)."""
    if t.numel() == 0:
        return 0
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return (last + 1) * t.element_size()
