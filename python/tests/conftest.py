"""pytest setup of the package's tests: the `torch` marker skips without PyTorch, the `gpu`
marker without the CUDA backend or a GPU (pyproject.toml declares both markers)."""

import importlib.util
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # spec_ref, dlpack_fake

import indexcp  # noqa: E402


def pytest_collection_modifyitems(config, items):
    have_torch = importlib.util.find_spec("torch") is not None
    have_gpu = indexcp.cuda_built() and indexcp.cuda_available()
    skip_torch = pytest.mark.skip(reason="PyTorch is not installed")
    skip_gpu = pytest.mark.skip(reason="no CUDA backend in this build or no GPU visible")
    for item in items:
        if "torch" in item.keywords and not have_torch:
            item.add_marker(skip_torch)
        if "gpu" in item.keywords and not have_gpu:
            item.add_marker(skip_gpu)
