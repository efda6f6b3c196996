"""PyTorch custom ops over the package (``torch.ops.indexcp.*``), registered when this module is
imported (``import indexcp.ops``; ``import indexcp`` imports it by itself when torch is already
imported). Each op is an out-variant: it writes caller-owned tensors declared in ``mutates_args``
and returns nothing, so torch.compile functionalizes it and (on the GPU) a CUDA graph captures it;
the fake implementations do nothing (outputs keep their metadata). CPU tensors run the CPU
backend, CUDA tensors the CUDA backend on the current torch stream.

A cache view or a plan is not a tensor, so the ops take them by handle: :func:`cache_handle`
records a view's geometry (layout, pages, layers, rank, layer stride; the view itself is rebuilt
over the cache tensor at each call, checked as make_cache_view checks it), :func:`decode_plan`
makes a DecodePlan of the tensors' backend and returns its handle. Handles are plain ints, so they
are constants to torch.compile and to a captured graph.

Ops (docstrings of the functions they call give the shapes, dtypes and spec sections):

- ``insert_keys_(cache, keys, slot_mapping, status, workspace, handle, layer, encode_scale,
  norm_weight=None, eps=1e-6, rope=False, rope_theta=5e6, positions=None, rope_cos_sin=None)``:
  insert_keys_async with its pre-processing (RMSNorm, RoPE; spec/indexer.md 6); mutates cache,
  status.
- ``quantize_queries_(q, out, status, norm_weight=None, eps=1e-6, rope=False, rope_theta=5e6,
  positions=None, rope_cos_sin=None)``: quantize_queries_async with the same pre-processing;
  mutates out, status.
- ``decode_run_(plan, handle, cache, layer, q, block_table, seq_lens, workspace, out, status,
  comm=0)``: DecodePlan.run (replicated path, or an exchanging plan with a communicator handle
  ``comm`` from :func:`comm_handle`); mutates workspace, out, status.
- ``prefill_run_(plan, handle, cache, layer, q, block_table, seq_lens, query_start, rows,
  max_rows_per_request, gather_units, workspace, out, status, comm=0)``: PrefillPlan.run
  (:func:`prefill_plan`; the extents as ints); the gather / local_score paths exchange inside the
  run through the communicator of handle ``comm`` (:func:`comm_handle`; every rank calls the op
  on its own thread); mutates workspace, out, status.
- ``decode_publish_(plan, handle, cache, layer, q, block_table, seq_lens, workspace, send)`` and
  ``decode_merge_(plan, q, block_table, seq_lens, recv, out, status)``: the split ICP exchange
  (the engine all-gathers ``send`` into ``recv`` with its own communicator in between).
"""

import itertools
import threading
from typing import Optional

import torch

from . import _indexcp

_LIB = "indexcp"
# Handles: ints, so that torch.compile and graph capture see constants. View handles are even,
# plan handles odd, so that swapping the two arguments of an op is an error, not another plan.
_lock = threading.Lock()
_views = {}  # even handle -> (layout, num_pages, num_layers, rank, layer_stride)
_plans = {}  # odd handle -> DecodePlan / PrefillPlan (CPU or CUDA)
_comms = {}  # negative handle -> Communicator (InProcessGroup's) / cuda.DeviceComm; 0 means none
_next = itertools.count(1)


def _new_handle(table: dict, value, odd: bool) -> int:
    with _lock:
        while True:
            h = next(_next)
            if (h % 2 == 1) == odd and h not in table:
                table[h] = value
                return h


def cache_handle(view) -> int:
    """A handle for the geometry of a cache view built with make_cache_view over one tensor (a
    per-layer view, make_cache_view_layers, is refused: an op takes one cache tensor)."""
    if isinstance(view.array, (list, tuple)):
        raise _indexcp.InvalidArgumentError(
            "view: a per-layer view (make_cache_view_layers) cannot be used by the torch ops, which take one "
            "cache tensor; build the view with make_cache_view")
    return _new_handle(_views, (view.layout, view.num_pages, view.num_layers, view.rank, view.layer_stride),
                       odd=False)


def decode_plan(config, rank: int, limits, device="cpu") -> int:
    """A DecodePlan of the backend of `device` ("cpu" or a CUDA device); returns its handle.
    ``plan(handle)`` gives the plan (workspace_bytes, num_heads, exchange_bytes); ``release(handle)``
    frees it."""
    cuda = torch.device(device).type == "cuda"
    return _new_handle(_plans, (_indexcp.cuda.DecodePlan if cuda else _indexcp.DecodePlan)(config, rank, limits),
                       odd=True)


def prefill_plan(config, rank: int, limits, device="cpu") -> int:
    """A PrefillPlan of the backend of `device`; returns its handle (``plan(handle)`` gives it)."""
    cuda = torch.device(device).type == "cuda"
    return _new_handle(_plans, (_indexcp.cuda.PrefillPlan if cuda else _indexcp.PrefillPlan)(config, rank, limits),
                       odd=True)


def comm_handle(comm) -> int:
    """A handle (a negative int; 0 stands for no communicator) for the ``comm`` argument of
    ``decode_run_`` / ``prefill_run_``: ``indexcp.InProcessGroup(world).comm(rank)`` or an
    ``indexcp.HostCommunicator`` (``indexcp.distributed.TorchCommunicator``) for CPU tensors,
    ``indexcp.cuda.DeviceGroup(world).comm(rank)`` or an ``indexcp.cuda.DeviceCommunicator``
    (``indexcp.distributed.TorchDeviceCommunicator``) for CUDA tensors (the plan's run refuses the
    other kind, naming comm). The handle keeps the communicator (and so its group) alive until
    ``release(handle)``. InvalidArgumentError names comm when it is not a communicator."""
    kinds = (_indexcp.Communicator,) + tuple(getattr(_indexcp.cuda, k) for k in ("DeviceComm", "DeviceCommunicator")
                                             if hasattr(_indexcp.cuda, k))
    if not isinstance(comm, kinds):
        raise _indexcp.InvalidArgumentError(
            f"comm must be a communicator (InProcessGroup(world).comm(rank), a HostCommunicator, "
            f"cuda.DeviceGroup(world).comm(rank) or a cuda.DeviceCommunicator), "
            f"got {type(comm).__name__}")
    with _lock:
        h = -1
        while h in _comms:
            h -= 1
        _comms[h] = comm
        return h


def _comm(handle: int):
    if handle == 0:
        return None
    if handle > 0:
        raise _indexcp.InvalidArgumentError(f"comm = {handle} is not a communicator handle (comm_handle gives "
                                            "negative ints; 0 for none)")
    return _lookup(_comms, handle, "comm")


def _lookup(table: dict, handle: int, what: str):
    try:
        return table[handle]
    except KeyError:
        raise _indexcp.InvalidArgumentError(f"{what} = {handle} is not a live {what} handle") from None


def plan(handle: int):
    return _lookup(_plans, handle, "plan")


def release(handle: int) -> None:
    """Forgets a view, plan or communicator handle (the object is freed once nothing else holds it)."""
    with _lock:
        if (_views.pop(handle, None) is None and _plans.pop(handle, None) is None
                and _comms.pop(handle, None) is None):
            raise _indexcp.InvalidArgumentError(f"handle = {handle} is not a live handle")


def _view(handle: int, cache: torch.Tensor):
    layout, num_pages, num_layers, rank, layer_stride = _lookup(_views, handle, "handle")
    return _indexcp.make_cache_view(layout, cache, num_pages, num_layers, rank, layer_stride)


def _backend(t: torch.Tensor):
    return _indexcp.cuda if t.is_cuda else _indexcp


def _stream(t: torch.Tensor) -> dict:
    return {"stream": torch.cuda.current_stream(t.device).cuda_stream} if t.is_cuda else {}


@torch.library.custom_op(f"{_LIB}::insert_keys_", mutates_args=("cache", "status", "workspace"))
def insert_keys_(cache: torch.Tensor, keys: torch.Tensor, slot_mapping: torch.Tensor, status: torch.Tensor,
                 workspace: Optional[torch.Tensor], handle: int, layer: int, encode_scale: float = 1.0,
                 norm_weight: Optional[torch.Tensor] = None, eps: float = 1e-6, rope: bool = False,
                 rope_theta: float = 5e6, positions: Optional[torch.Tensor] = None,
                 rope_cos_sin: Optional[torch.Tensor] = None) -> None:
    """insert_keys_async into the cache tensor of `handle`'s geometry (keys fp32 or bf16
    [num_tokens, 128], slot_mapping int64 [num_tokens], status uint8 [STATUS_BYTES]).
    Pre-processing before the quantization (spec/indexer.md 6): norm_weight fp32 [128] applies
    Gemma-style RMSNorm with eps; rope=True applies partial NeoX RoPE (first 64 dims) at positions
    int64 [num_tokens] with rope_theta (CPU), or from the table rope_cos_sin fp32 [positions, 64]
    (fill_rope_table; required on CUDA tensors). Bad arguments raise InvalidArgumentError naming
    them; a bad token is recorded in status and nothing of the batch is written."""
    _backend(cache).insert_keys_async(_view(handle, cache), layer, keys, slot_mapping, status, workspace,
                                      encode_scale=encode_scale, norm_weight=norm_weight, eps=eps, rope=rope,
                                      rope_theta=rope_theta, positions=positions, rope_cos_sin=rope_cos_sin,
                                      **_stream(cache))


@torch.library.custom_op(f"{_LIB}::quantize_queries_", mutates_args=("out", "status"))
def quantize_queries_(q: torch.Tensor, out: torch.Tensor, status: torch.Tensor,
                      norm_weight: Optional[torch.Tensor] = None, eps: float = 1e-6, rope: bool = False,
                      rope_theta: float = 5e6, positions: Optional[torch.Tensor] = None,
                      rope_cos_sin: Optional[torch.Tensor] = None) -> None:
    """quantize_queries_async: q fp32 [num_tokens, heads, 128] -> out uint8 E4M3 [num_tokens, heads,
    128] (formats.md 5), NaN (before or after the pre-processing) recorded in status. The
    pre-processing arguments are insert_keys_'s, applied to every head of a token."""
    _backend(q).quantize_queries_async(q, out, status, norm_weight=norm_weight, eps=eps, rope=rope,
                                       rope_theta=rope_theta, positions=positions, rope_cos_sin=rope_cos_sin,
                                       **_stream(q))


@torch.library.custom_op(f"{_LIB}::decode_run_", mutates_args=("workspace", "out", "status"))
def decode_run_(plan: int, handle: int, cache: torch.Tensor, layer: int, q: torch.Tensor, block_table: torch.Tensor,
                seq_lens: torch.Tensor, workspace: torch.Tensor, out: torch.Tensor,
                status: Optional[torch.Tensor], comm: int = 0) -> None:
    """DecodePlan.run of plan `plan` over the cache tensor of geometry `handle`; comm: 0, or a
    :func:`comm_handle` for an exchanging plan run on one thread per rank."""
    _lookup(_plans, plan, "plan").run(_view(handle, cache), layer, q, block_table, seq_lens, workspace, out,
                                      _comm(comm), status, **_stream(cache))


@torch.library.custom_op(f"{_LIB}::prefill_run_", mutates_args=("workspace", "out", "status"))
def prefill_run_(plan: int, handle: int, cache: torch.Tensor, layer: int, q: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, query_start: torch.Tensor, rows: int, max_rows_per_request: int,
                 gather_units: int, workspace: torch.Tensor, out: torch.Tensor,
                 status: Optional[torch.Tensor], comm: int = 0) -> None:
    """PrefillPlan.run of plan `plan` with PrefillExtents(rows, max_rows_per_request, gather_units)
    (spec/indexer.md 5). The gather and local_score plans exchange inside the run through the
    communicator of handle `comm` (:func:`comm_handle`; required for them, 0 for the replicated
    path): every rank calls the op at the same point on its own thread, and with the same extents
    (the gather moves gather_chunks(extents) all-gathers). No split form: the library's prefill
    exchange is not exposed between its steps."""
    ext = _indexcp.PrefillExtents(rows, max_rows_per_request, gather_units)
    _lookup(_plans, plan, "plan").run(_view(handle, cache), layer, q, block_table, seq_lens, query_start, ext,
                                      workspace, out, _comm(comm), status, **_stream(cache))


@torch.library.custom_op(f"{_LIB}::decode_publish_", mutates_args=("workspace", "send"))
def decode_publish_(plan: int, handle: int, cache: torch.Tensor, layer: int, q: torch.Tensor,
                    block_table: torch.Tensor, seq_lens: torch.Tensor, workspace: torch.Tensor,
                    send: torch.Tensor) -> None:
    """DecodePlan.publish: this rank's exchange record into send (uint8 [exchange_bytes])."""
    _lookup(_plans, plan, "plan").publish(_view(handle, cache), layer, q, block_table, seq_lens, workspace, send, **_stream(cache))


@torch.library.custom_op(f"{_LIB}::decode_merge_", mutates_args=("out", "status"))
def decode_merge_(plan: int, q: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                  recv: torch.Tensor, out: torch.Tensor, status: Optional[torch.Tensor]) -> None:
    """DecodePlan.merge: every rank's record (recv uint8 [world * exchange_bytes]) -> out, status."""
    _lookup(_plans, plan, "plan").merge(q, block_table, seq_lens, recv, out, status, **_stream(q))


# The fake implementations: the ops only write their declared outputs in place.
for _op in (insert_keys_, quantize_queries_, decode_run_, prefill_run_, decode_publish_, decode_merge_):
    _op.register_fake(lambda *args, **kwargs: None)
