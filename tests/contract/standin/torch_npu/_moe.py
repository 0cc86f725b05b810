"""The fused MoE dispatch and combine of torch_npu (``torch_npu.npu_moe_distribute_dispatch_v2``
and ``torch_npu.npu_moe_distribute_combine_v2``), on the stand-in's HCCL.

As documented (op-plugin, ``docs/context/torch_npu-npu_moe_distribute_dispatch_v2.md``), the
pair exchanges tokens over the expert-parallel (EP) domain with an all-to-all-v: the dispatch
sends each token to the EP rank of each expert it was routed to, the combine sends the
experts' outputs back and sums them, weighted by ``expert_scales``. The EP domain is named,
not passed: ``group_ep`` is the name of an HCCL communicator (``get_hccl_comm_name``), looked
up when the operator runs (``_standin.communicator_named``). Like any device operator, a
stopped device fails them with FORCE STOP, also while one waits for its peers.

What the stand-in models: ``quant_mode=0``, no TP domain (``tp_world_size`` 0 or 1), no
shared experts, experts split evenly over the EP ranks (rank ``r`` holds experts
``r * L .. r * L + L - 1``, ``L = moe_expert_num // ep_world_size``). Its
``assist_info_for_combine`` has one row per received token copy, ``(local expert, source
rank, token, k)``, not the documented ``A * 128`` layout; ``ep_recv_counts`` counts the
copies received from each EP rank. The other outputs are empty tensors.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.distributed_c10d import AllToAllOptions

from torch_npu import _standin


def _domain(op: str, group_ep: str, ep_world_size: int, ep_rank_id: int,
            tp_world_size: int, options: dict[str, Any]) -> _standin.HcclGroup:
    _standin.record(op, group_ep=group_ep, ep_world_size=ep_world_size, ep_rank_id=ep_rank_id)
    _standin.DEVICE.launch(op)
    unmodelled = {k: v for k, v in options.items()
                  if k in ("quant_mode", "shared_expert_rank_num", "comm_quant_mode") and v}
    if tp_world_size > 1 or unmodelled:
        raise NotImplementedError(f"{op}: not modelled by the torch_npu stand-in: "
                                  f"tp_world_size={tp_world_size}, {unmodelled}")
    group = _standin.communicator_named(group_ep)
    if (group.size(), group.rank()) != (ep_world_size, ep_rank_id):
        raise RuntimeError(f"{op}: group_ep {group_ep!r} has rank {group.rank()} of "
                           f"{group.size()}, not ep_rank_id {ep_rank_id} of {ep_world_size}")
    return group


def _lexsort(*keys: torch.Tensor) -> torch.Tensor:
    """The order that sorts rows by ``keys[0]``, then ``keys[1]``, and so on."""
    order = torch.arange(len(keys[0]))
    for key in reversed(keys):
        order = order[torch.argsort(key[order], stable=True)]
    return order


def _all_to_all(group: _standin.HcclGroup, rows: torch.Tensor, send: list[int],
                recv: list[int]) -> torch.Tensor:
    out = rows.new_empty((sum(recv),) + tuple(rows.shape[1:]))
    group._run("alltoall_base", out, rows.contiguous(), recv, send, AllToAllOptions()).wait()
    return out


def npu_moe_distribute_dispatch_v2(x: torch.Tensor, expert_ids: torch.Tensor, group_ep: str,
                                   ep_world_size: int, ep_rank_id: int, moe_expert_num: int,
                                   *, tp_world_size: int = 0, expert_token_nums_type: int = 1,
                                   **options: Any) -> tuple[torch.Tensor, ...]:
    group = _domain("npu_moe_distribute_dispatch_v2", group_ep, ep_world_size, ep_rank_id,
                    tp_world_size, options)
    local = moe_expert_num // ep_world_size
    tokens, top_k = expert_ids.shape
    experts = expert_ids.reshape(-1).long()
    token_index = torch.arange(tokens).repeat_interleave(top_k)
    k_index = torch.arange(top_k).repeat(tokens)
    order = _lexsort(experts, token_index, k_index)
    dest = experts[order] // local
    send = torch.bincount(dest, minlength=ep_world_size)
    recv = torch.empty_like(send)
    group._run("alltoall_base", recv, send, [1] * ep_world_size, [1] * ep_world_size,
               AllToAllOptions()).wait()
    send_counts, recv_counts = send.tolist(), recv.tolist()
    meta = torch.stack([experts[order] % local, torch.full_like(dest, ep_rank_id),
                        token_index[order], k_index[order]], dim=1)
    rows = _all_to_all(group, x[token_index[order]], send_counts, recv_counts)
    info = _all_to_all(group, meta, send_counts, recv_counts)
    grouped = _lexsort(*info.unbind(1))  # by local expert, then source rank, token and k
    expert_token_nums = torch.bincount(info[:, 0], minlength=local)
    if expert_token_nums_type == 0:
        expert_token_nums = expert_token_nums.cumsum(0)
    empty = x.new_empty(0)
    return (rows[grouped], empty, info[grouped], expert_token_nums, recv, empty, empty)


def npu_moe_distribute_combine_v2(expand_x: torch.Tensor, expert_ids: torch.Tensor,
                                  assist_info_for_combine: torch.Tensor,
                                  ep_send_counts: torch.Tensor, expert_scales: torch.Tensor,
                                  group_ep: str, ep_world_size: int, ep_rank_id: int,
                                  moe_expert_num: int, *, tp_world_size: int = 0,
                                  **options: Any) -> torch.Tensor:
    group = _domain("npu_moe_distribute_combine_v2", group_ep, ep_world_size, ep_rank_id,
                    tp_world_size, options)
    local = moe_expert_num // ep_world_size
    tokens, top_k = expert_ids.shape
    info = assist_info_for_combine
    back = _lexsort(info[:, 1], info[:, 2], info[:, 3])  # by source rank, token and k
    send_counts = torch.bincount(info[:, 1], minlength=ep_world_size).tolist()
    if send_counts != ep_send_counts.tolist():
        raise RuntimeError("npu_moe_distribute_combine_v2: ep_send_counts does not match the "
                           "dispatch's assist_info_for_combine")
    recv_counts = torch.bincount(expert_ids.reshape(-1).long() // local,
                                 minlength=ep_world_size).tolist()
    rows = _all_to_all(group, expand_x[back], send_counts, recv_counts)
    where = _all_to_all(group, info[back][:, 2:], send_counts, recv_counts)
    out = torch.zeros((tokens,) + tuple(expand_x.shape[1:]), dtype=expand_x.dtype)
    weights = expert_scales.to(expand_x.dtype)
    for k in range(top_k):  # k by k, so that every token's sum has one fixed order
        mine = where[:, 1] == k
        out[where[mine, 0]] += weights[where[mine, 0], k].unsqueeze(-1) * rows[mine]
    return out
