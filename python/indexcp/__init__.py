"""indexcp: a paged NVFP4/FP8 index cache, the block-sparse-attention indexer and indexer
context parallelism (ICP), for LLM inference engines -- the Python binding of the C++ library.

The names mirror the C++ headers (include/indexcp/*.hpp); each docstring gives the shapes,
dtypes and spec section. The top level is the CPU backend (host memory: numpy arrays, CPU
tensors); :mod:`indexcp.cuda` is the CUDA backend (device memory, a ``stream`` argument) when
the package was built with it. Arrays cross through DLPack without copies; a wrong dtype, shape,
device or layout raises :class:`InvalidArgumentError` naming the argument, before any memory is
touched. See docs/python.md.

Errors: :class:`Error` is the base; kInvalidArgument raises :class:`InvalidArgumentError`
(a ValueError), kUnsupported :class:`UnsupportedError` (a NotImplementedError), kRuntime
:class:`RuntimeError` and kIo :class:`IoError` (both builtins.RuntimeError subclasses).
"""

from . import _indexcp
from ._indexcp import *  # noqa: F401,F403  (the binding's names, as the C++ headers name them)
from ._indexcp import (  # noqa: F401  (named for readers and linters)
    Error,
    InvalidArgumentError,
    IoError,
    RuntimeError,
    UnsupportedError,
    __version__,
    cuda_available,
)

cuda = _indexcp.cuda

# (indexcp.RuntimeError stays an attribute; `from indexcp import *` must not shadow the builtin)
__all__ = [n for n in dir(_indexcp) if not n.startswith("_") and n != "RuntimeError"] + ["__version__"]


def cuda_built() -> bool:
    """True when this build of the package has the CUDA backend (INDEXCP_CUDA at build time)."""
    return bool(_indexcp.CUDA_BACKEND)


if "torch" in __import__("sys").modules:  # torch already imported: register torch.ops.indexcp.*
    try:
        from . import ops  # noqa: F401,E402
    except (ImportError, AttributeError):  # a torch without torch.library.custom_op: no ops, the rest works
        pass
