"""The example sparse attention layer (examples/python/sparse_layer.py) on the CPU: a decode loop
with Q = 8 speculative queries gives identical selections and attention outputs with the index
cache sharded over two simulated ranks and replicated (the ops themselves are checked against the
numpy spec implementation in test_torch.py / test_select.py)."""

import os
import sys

import pytest

torch = pytest.importorskip("torch")

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "python")
pytestmark = pytest.mark.torch


@pytest.mark.skipif(not os.path.isdir(EXAMPLES), reason="examples/python is not in this checkout")
def test_sharding_on_equals_off():
    sys.path.insert(0, EXAMPLES)
    import sparse_layer

    off = sparse_layer.decode_loop(False, steps=2)
    on = sparse_layer.decode_loop(True, steps=2)
    for (s0, o0), (s1, o1) in zip(off, on):
        assert torch.equal(s0, s1) and torch.equal(o0, o1)
        assert (s0 >= 0).all()  # more than K visible blocks: every slot holds a block
        assert not (s0[:, :, :15] == torch.arange(15, dtype=torch.int32)).all()  # a real top-k choice
        assert torch.isfinite(o0).all()


@pytest.mark.gpu
@pytest.mark.skipif(not os.path.isdir(EXAMPLES), reason="examples/python is not in this checkout")
def test_sharding_on_equals_off_on_the_gpu():
    sys.path.insert(0, EXAMPLES)
    import sparse_layer

    off = sparse_layer.decode_loop(False, steps=2, device="cuda")
    on = sparse_layer.decode_loop(True, steps=2, device="cuda")
    for (s0, o0), (s1, o1) in zip(off, on):
        assert torch.equal(s0, s1) and torch.equal(o0, o1)
        assert (s0 >= 0).all() and torch.isfinite(o0).all()
