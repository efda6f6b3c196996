"""The example sparse attention layer (examples/python/sparse_layer.py) on the CPU: a decode loop
with Q = 8 speculative queries gives identical selections and attention outputs with the index
cache sharded over two simulated ranks and replicated (the ops themselves are checked against the
numpy spec implementation in test_torch.py / test_select.py); the capturable attention equals the
loop; the CUDA-graph option refuses without CUDA and, on the GPU, replays equal the eager steps; the
embedded real data through the layer's indexer gives decode_select's selections."""

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


def _layer():
    sys.path.insert(0, EXAMPLES)
    import sparse_layer
    return sparse_layer


@pytest.mark.skipif(not os.path.isdir(EXAMPLES), reason="examples/python is not in this checkout")
def test_dense_attention_equals_the_loop():
    """attend_dense (the capturable attention) gives the loop's selections and outputs up to the
    order of the sums."""
    sl = _layer()
    loop = sl.decode_loop(True, steps=2)
    dense = sl.decode_loop(True, steps=2, dense=True)
    for (s0, o0), (s1, o1) in zip(loop, dense):
        assert torch.equal(s0, s1)
        torch.testing.assert_close(o1, o0, rtol=1e-5, atol=1e-6)
        assert o0.abs().max() > 0.01  # outputs, not zeros


@pytest.mark.skipif(not os.path.isdir(EXAMPLES), reason="examples/python is not in this checkout")
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_graph_option_refuses_without_cuda():
    import indexcp
    sl = _layer()
    with pytest.raises(indexcp.InvalidArgumentError, match="graph"):
        sl.decode_loop(True, steps=1, graph=True)
    layer = sl.SparseLayer()
    with pytest.raises(indexcp.InvalidArgumentError, match="graph"):
        layer.graph_step(None, None, None, None)


@pytest.mark.gpu
@pytest.mark.skipif(not os.path.isdir(EXAMPLES), reason="examples/python is not in this checkout")
def test_graph_replay_equals_eager_on_the_gpu():
    """One captured graph of the whole decode step replayed for 3 steps with new inputs: decode_loop
    asserts replay == eager (selections bit for bit, outputs to rtol 1e-5) each step; sharding on and
    off give the same selections."""
    sl = _layer()
    on = sl.decode_loop(True, steps=3, device="cuda", graph=True)
    off = sl.decode_loop(False, steps=3, device="cuda", graph=True)
    for (s0, o0), (s1, o1) in zip(off, on):
        assert torch.equal(s0, s1) and (s0 >= 0).all()
        torch.testing.assert_close(o1, o0, rtol=1e-5, atol=1e-6)
    assert not torch.equal(on[0][1], on[1][1])  # the replays saw new inputs


DATA = os.path.join(EXAMPLES, "..", "..", "data", "minilm_stdlib")


@pytest.mark.skipif(not os.path.exists(os.path.join(DATA, "keys.npy")), reason="the real data is not in this checkout")
def test_real_data_through_the_layers_indexer():
    """The embedded real data through the layer's indexer (insert_keys_, quantize_queries_, decode
    ops; W = 2 shards and replicated): the same selections both ways, equal to decode_select over a
    plain cache of the same keys, and their recall against fp32 keys."""
    import numpy as np

    import indexcp
    sl = _layer()
    steps = (33000, 33024)
    rec_on, sel_on = sl.real_data_recall(True, steps=steps)
    rec_off, sel_off = sl.real_data_recall(False, steps=steps)
    np.testing.assert_array_equal(sel_on, sel_off)
    assert rec_on == rec_off and 0.7 < rec_on < 1.0
    keys = np.load(os.path.join(DATA, "keys.npy"))
    queries = np.load(os.path.join(DATA, "queries.npy"))
    R, T, H = keys.shape[0], keys.shape[1], queries.shape[2]
    P, Q, K = 128, 8, 16
    pages = -(-T // P)
    layout = indexcp.make_page_layout(indexcp.KvDtype.nvfp4, P, 1)
    cache = np.zeros(indexcp.view_bytes(layout, R * pages), np.uint8)
    view = indexcp.make_cache_view(layout, cache, R * pages)
    bt = np.arange(R * pages, dtype=np.int32).reshape(R, pages)
    for r in range(R):
        indexcp.insert_keys(view, 0, keys[r].astype(np.float32), bt[r, np.arange(T) // P].astype(np.int64) * P +
                            np.arange(T) % P)
    for i, s in enumerate(steps):
        q8 = np.zeros((R * Q, H, 128), np.uint8)
        indexcp.quantize_queries(queries[:, s - Q - 32768:s - 32768].astype(np.float32).reshape(R * Q, H, 128), q8)
        out = np.zeros((R * Q, H, K), np.int32)
        indexcp.decode_select(view, 0, q8, bt, np.full(R, s, np.int32), Q, 0, H, indexcp.SelectionParams(topk=K),
                              indexcp.KRounding.e4m3, out)
        np.testing.assert_array_equal(sel_on[i * R * Q:(i + 1) * R * Q], out, err_msg=f"seq_len {s}")
