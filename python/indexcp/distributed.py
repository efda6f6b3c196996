"""The exchange through a ``torch.distributed`` process group.

- :func:`decode`: ICP decode of one rank (the convenience form of the split publish / all-gather /
  merge; plan.hpp DecodePlan, spec/indexer.md 5). The all-gather is
  ``torch.distributed.all_gather_into_tensor`` on ``group`` (NCCL for CUDA tensors, e.g. gloo for
  CPU tensors); every rank of the group calls it with the same shapes. The replicated path
  exchanges nothing and runs the plan's ``run``.
- :class:`TorchCommunicator`: a Communicator (comm.hpp) over a group, for the CPU plans'
  ``run(comm=...)`` and the ops' ``comm_handle``: the exchanges that happen inside a run (the
  sharded prefill paths, which have no split form) go through torch.distributed on CPU tensors.
- :class:`TorchDeviceCommunicator`: the same for the CUDA plans, over a group whose backend takes
  CUDA tensors (NCCL), ordered with the run's stream.
"""

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


class TorchCommunicator(_indexcp.HostCommunicator):
    """A host Communicator (indexcp.HostCommunicator) whose collectives are torch.distributed's on
    ``group`` (None: the default group), for the CPU plans: ``plan.run(..., comm=TorchCommunicator())``
    or ``indexcp.ops.comm_handle(TorchCommunicator())``. rank and world are the group's at
    construction. The library calls ``all_gather`` / ``all_to_all`` from inside the run on the calling
    thread; each wraps the library's buffers as CPU uint8 tensors (no copies, valid only during the
    call) and runs ``dist.all_gather_into_tensor`` / ``dist.all_to_all_single``, synchronously, so the
    group's backend must take CPU tensors (gloo; not NCCL). Every rank must run the same plan calls
    in the same order, as for any collective. The CUDA plans take only device communicators
    (:class:`TorchDeviceCommunicator` over NCCL, indexcp.cuda.DeviceGroup), or the split form
    (publish / all-gather / merge, :func:`decode`)."""

    def __init__(self, group=None):
        _indexcp.HostCommunicator.__init__(self, dist.get_rank(group), dist.get_world_size(group))
        self.group = group

    def all_gather(self, send, recv):
        dist.all_gather_into_tensor(torch.from_numpy(recv), torch.from_numpy(send), group=self.group)

    def all_to_all(self, send, recv):
        dist.all_to_all_single(torch.from_numpy(recv), torch.from_numpy(send), group=self.group)


if hasattr(_indexcp.cuda, "DeviceCommunicator"):

    class TorchDeviceCommunicator(_indexcp.cuda.DeviceCommunicator):
        """A device Communicator (indexcp.cuda.DeviceCommunicator) whose collectives are
        torch.distributed's on ``group`` (None: the default group), whose backend must be NCCL
        (InvalidArgumentError otherwise: a backend that runs CUDA collectives synchronously would
        break the ordering with the run's stream), for the CUDA plans:
        ``plan.run(..., comm=TorchDeviceCommunicator(), stream=...)`` or
        ``indexcp.ops.comm_handle(TorchDeviceCommunicator())`` -- the sharded prefill (gather,
        local_score) and the exchanging decode run of one rank per process. rank and world are the
        group's at construction. The library calls ``all_gather`` / ``all_to_all`` from inside the
        run; each wraps the library's device buffers as uint8 CUDA tensors (``torch.from_dlpack``, no
        copies, valid only during the call) and runs ``dist.all_gather_into_tensor`` /
        ``dist.all_to_all_single`` with the run's stream as the current stream, so that NCCL orders
        the collective with the plan's kernels. Capturing such a run in a CUDA graph needs what NCCL
        capture needs (the communicator created before the capture, ``TORCH_NCCL_BLOCKING_WAIT``
        off, every rank capturing and replaying the same graph); only a one-rank group's all-gather
        is tested captured (docs/python.md). Every rank must run the same plan calls in the same
        order, as for any collective."""

        def __init__(self, group=None):
            backend = str(dist.get_backend(group))
            if "nccl" not in backend:
                raise _indexcp.InvalidArgumentError(
                    f"group: TorchDeviceCommunicator needs a process group with the NCCL backend, got '{backend}' "
                    "(for CPU tensors and gloo use TorchCommunicator)")
            _indexcp.cuda.DeviceCommunicator.__init__(self, dist.get_rank(group), dist.get_world_size(group))
            self.group = group if group is not None else dist.group.WORLD
            self._streams = {}  # (device, cudaStream_t) -> torch stream object

        def _stream(self, stream: int):
            key = (torch.cuda.current_device(), stream)
            s = self._streams.get(key)
            if s is None:
                if len(self._streams) >= 64:  # an engine that makes streams per step
                    self._streams.clear()
                s = torch.cuda.ExternalStream(stream) if stream else torch.cuda.default_stream()
                self._streams[key] = s
            return torch.cuda.stream(s)

        def all_gather(self, send, recv, stream):
            with self._stream(stream):
                dist.all_gather_into_tensor(torch.from_dlpack(recv), torch.from_dlpack(send), group=self.group)

        def all_to_all(self, send, recv, stream):
            with self._stream(stream):
                dist.all_to_all_single(torch.from_dlpack(recv), torch.from_dlpack(send), group=self.group)
