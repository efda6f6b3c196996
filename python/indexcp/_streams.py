"""The default stream of the CUDA calls (indexcp.cuda): when a call's ``stream`` is None, the
extension asks :func:`current_stream` here. It is the current PyTorch CUDA stream of the current
device when torch is already imported and CUDA is initialised, else 0 (the legacy default stream).
Importing indexcp never imports torch."""

import sys


def current_stream() -> int:
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                return int(torch.cuda.current_stream().cuda_stream)
        except Exception:  # torch without CUDA, or a half-imported torch
            pass
    return 0
