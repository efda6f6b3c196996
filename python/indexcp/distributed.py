"""ICP decode of one rank with the exchange through a ``torch.distributed`` process group (the
convenience form of the split publish / all-gather / merge; plan.hpp DecodePlan, spec/indexer.md
5). The all-gather is ``torch.distributed.all_gather_into_tensor`` on ``group`` (NCCL for CUDA
tensors, e.g. gloo for CPU tensors); every rank of the group calls it with the same shapes.
The replicated path exchanges nothing and runs the plan's ``run``."""

import torch
import torch.distributed as dist

from . import _indexcp


def decode(plan, cache, layer, q, block_table, seq_lens, workspace, send, recv, out, status=None, group=None):
    """One rank's decode step. plan: an indexcp.DecodePlan (CPU tensors) or indexcp.cuda.DecodePlan
    (CUDA tensors); send: uint8 [exchange_bytes], recv: uint8 [world * exchange_bytes] (caller-owned;
    may be None for the replicated path); out: int32 [num_requests * Q, plan.num_heads, K];
    status: uint32/int32 [1] or None."""
    if plan.exchange_bytes == 0:
        plan.run(cache, layer, q, block_table, seq_lens, workspace, out, None, status)
        return
    world = dist.get_world_size(group)
    if world != plan.world:
        raise _indexcp.InvalidArgumentError(f"group has {world} ranks but the plan was made for world = {plan.world}")
    if dist.get_rank(group) != plan.rank:
        raise _indexcp.InvalidArgumentError(
            f"plan is rank {plan.rank}'s but this process is rank {dist.get_rank(group)} of the group")
    eb = plan.exchange_bytes
    send = send[:eb]
    recv = recv[: world * eb]
    plan.publish(cache, layer, q, block_table, seq_lens, workspace, send)
    dist.all_gather_into_tensor(recv, send, group=group)
    plan.merge(q, block_table, seq_lens, recv, out, status)
