"""The package against the numpy implementation of the spec (spec_ref.py): key formats
(formats.md 1-5, checked first against the contract's acceptance vectors), the index-Q cast, and
the bytes an insert writes into a caller-allocated cache (formats.md 6-7), bit for bit."""

import json
import os

import numpy as np
import pytest

import indexcp
import spec_ref as ref

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
VECTORS = os.path.join(REPO, "tests", "data", "vectors", "nvfp4_blocks.json")
DT = {"nvfp4": indexcp.KvDtype.nvfp4, "fp8": indexcp.KvDtype.fp8, "bf16": indexcp.KvDtype.bf16}


def f32_of_bits(s):
    return np.array([int(s, 16)], np.uint32).view(np.float32)


def nasty_keys(rng, n):
    """Random keys with the cases the recipe singles out: zero and -0.0 groups, ties of E2M1 and
    E4M3, tiny groups whose scale rounds to zero, large values near saturation."""
    k = (rng.standard_normal((n, 128)) * rng.choice([1e-3, 0.3, 1.0, 30.0, 400.0], (n, 1))).astype(np.float32)
    k[0, :16] = 0.0
    k[0, 16:32] = -0.0
    k[1, :16] = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2, np.float32)
    k[2, :16] = 1e-6
    k[3, :16] = np.array([464.0, -464.0, 2.0**-10, -(2.0**-10)] * 4, np.float32)
    return k


@pytest.mark.skipif(not os.path.exists(VECTORS), reason="the acceptance vectors are not in this checkout")
def test_reference_matches_the_acceptance_vectors():
    d = json.load(open(VECTORS))
    for v in d["e2m1"]:
        assert int(ref.e2m1_encode(f32_of_bits(v["x_bits"]))[0]) == int(v["code"], 16), v
    for v in d["e4m3"]:
        assert int(ref.e4m3_encode(f32_of_bits(v["x_bits"]))[0]) == int(v["code"], 16), v
    for b in d["nvfp4_blocks"]:
        xb = b["x_bits"]
        xb = json.loads(xb.replace("'", '"')) if isinstance(xb, str) else xb
        x = np.array([int(s, 16) for s in xb], np.uint32).view(np.float32)
        key = np.zeros(128, np.float32)
        key[:16] = x
        S = f32_of_bits(b["S_bits"])[0]
        packed, scales = ref.nvfp4_quantize(key, S)
        assert int(scales[0]) == int(b["scale"], 16), b["name"]
        assert packed[:8].tobytes().hex().upper() == b["packed"].upper(), b["name"]
        # and the package's quantizer stores the same bytes
        got = np.frombuffer(indexcp.quantize_key_bytes(indexcp.KvDtype.nvfp4, key, float(S)), np.uint8)
        assert got[:8].tobytes().hex().upper() == b["packed"].upper(), b["name"]
        assert int(got[64]) == int(b["scale"], 16), b["name"]


@pytest.mark.parametrize("dtype,S", [("nvfp4", 1.0), ("nvfp4", 0.37), ("nvfp4", 8.0), ("fp8", 1.0), ("bf16", 1.0)])
def test_quantize_key_bytes_matches_reference(dtype, S):
    rng = np.random.default_rng(7)
    for key in nasty_keys(rng, 24):
        got = np.frombuffer(indexcp.quantize_key_bytes(DT[dtype], key, S), np.uint8)
        np.testing.assert_array_equal(got, ref.key_row_bytes(dtype, key, S))


@pytest.mark.parametrize("norm", [False, True])
def test_quantize_queries_matches_reference(norm):
    rng = np.random.default_rng(3)
    q = (rng.standard_normal((5, 4, 128)) * 50).astype(np.float32)
    q[0, 0, :4] = [464.0, -464.0, 2.0**-10, 1e9]
    out = np.zeros((5, 4, 128), np.uint8)
    if not norm:
        indexcp.quantize_queries(q, out)
        np.testing.assert_array_equal(out, ref.e4m3_encode(q))
    else:
        # RMSNorm with zero weights: y = x * r, r = 1/sqrt(mean(x^2) + eps); the cast of a normed
        # vector lands in the E4M3 range, and its bytes must differ from the raw cast
        w = np.zeros(128, np.float32)
        indexcp.quantize_queries(q, out, norm_weight=w)
        assert not np.array_equal(out, ref.e4m3_encode(q))
        assert np.all(np.abs(ref.e4m3_value(out)) < 20)


def make_cache(dtype, P, W, num_pages, num_layers, rank, page_stride=0, layer_stride=0):
    layout = indexcp.make_page_layout(DT[dtype], P, W, page_stride)
    nbytes = indexcp.view_bytes(layout, num_pages, num_layers, layer_stride)
    buf = np.zeros(nbytes, np.uint8)
    view = indexcp.make_cache_view(layout, buf, num_pages, num_layers, rank, layer_stride)
    return layout, buf, view


CASES = [
    ("nvfp4", 128, 1, 0, 0),
    ("nvfp4", 128, 2, 0, 0),
    ("nvfp4", 256, 4, 4608 + 16, 0),
    ("fp8", 128, 1, 0, 0),
    ("fp8", 256, 2, 0, 5 * 16384 + 32),
    ("bf16", 128, 1, 0, 0),
]


@pytest.mark.parametrize("dtype,P,W,page_stride,layer_stride", CASES)
@pytest.mark.parametrize("bf16_keys", [False, True])
def test_insert_writes_the_spec_bytes(dtype, P, W, page_stride, layer_stride, bf16_keys):
    rng = np.random.default_rng(11)
    num_pages, num_layers, n = 5, 3, 200
    keys = nasty_keys(rng, n)
    slots = rng.choice(num_pages * P, n, replace=False).astype(np.int64)
    slots[::17] = -1
    if bf16_keys:
        kin = ref.bf16_bits(keys)  # bf16 bit patterns as uint16
        kq = (kin.astype(np.uint32) << 16).view(np.float32)
    else:
        kin, kq = keys, keys
    for rank in range(W):
        layout, buf, view = make_cache(dtype, P, W, num_pages, num_layers, rank, page_stride, layer_stride)
        indexcp.insert_keys(view, 1, kin, slots)
        expect = np.zeros_like(buf)
        ps = layout.page_stride
        ls = view.layer_stride
        assert ps == (page_stride or ref.page_bytes(dtype, P, W))
        assert ls == (layer_stride or num_pages * ps)
        for i in range(n):
            if slots[i] >= 0:
                ref.write_row(expect, dtype, P, W, ps, ls, 1, slots[i], ref.key_row_bytes(dtype, kq[i]), rank)
        np.testing.assert_array_equal(buf, expect)


def test_async_insert_status_and_refusal():
    layout, buf, view = make_cache("nvfp4", 128, 1, 2, 1, 0)
    status = np.zeros(indexcp.STATUS_BYTES, np.uint8)
    keys = np.ones((3, 128), np.float32)
    indexcp.insert_keys_async(view, 0, keys, np.array([0, 1, 2], np.int64), status)
    assert indexcp.read_status(status).reason == 0
    before = buf.copy()
    bad = keys.copy()
    bad[1, 5] = np.nan
    indexcp.insert_keys_async(view, 0, bad * 2, np.array([3, 4, 5], np.int64), status)
    st = indexcp.read_status(status)
    assert st.reason == int(indexcp.InsertRefusal.non_finite_key) and st.token == 1 and st.dim == 5
    assert st.refused_calls == 1
    np.testing.assert_array_equal(buf, before)  # a refused batch writes nothing
    with pytest.raises(indexcp.InvalidArgumentError) as sync:
        indexcp.insert_keys(view, 0, bad * 2, np.array([3, 4, 5], np.int64))
    with pytest.raises(indexcp.InvalidArgumentError) as from_status:
        indexcp.throw_if_refused(status)
    assert str(sync.value) == str(from_status.value)
    indexcp.reset_status(status)
    assert indexcp.read_status(status).reason == 0


def test_rope_table_and_async_rope_equal_sync():
    theta = 1e4
    table = np.zeros((300, 64), np.float32)
    indexcp.fill_rope_table(table, theta)
    i = np.arange(32)
    inv = theta ** (-2.0 * i / 64)
    np.testing.assert_array_equal(table[7, :32], np.cos(7 * inv).astype(np.float32))
    rng = np.random.default_rng(5)
    keys = rng.standard_normal((10, 128)).astype(np.float32)
    pos = rng.integers(0, 300, 10).astype(np.int64)
    slots = np.arange(10, dtype=np.int64)
    w = rng.standard_normal(128).astype(np.float32) * 0.1
    _, a, va = make_cache("fp8", 128, 1, 1, 1, 0)
    _, b, vb = make_cache("fp8", 128, 1, 1, 1, 0)
    indexcp.insert_keys(va, 0, keys, slots, norm_weight=w, rope=True, rope_theta=theta, positions=pos)
    status = np.zeros(indexcp.STATUS_BYTES, np.uint8)
    indexcp.insert_keys_async(vb, 0, keys, slots, status, norm_weight=w, rope=True, rope_theta=theta,
                              positions=pos, rope_cos_sin=table)
    indexcp.throw_if_refused(status)
    np.testing.assert_array_equal(a, b)
    assert a.any()


def test_view_is_zero_copy_and_per_layer_views():
    layout = indexcp.make_page_layout(indexcp.KvDtype.fp8, 128, 1)
    layers = [np.zeros(indexcp.cache_layer_bytes(layout, 3), np.uint8) for _ in range(2)]
    view = indexcp.make_cache_view_layers(layout, layers, 3)
    key = np.full((1, 128), 2.0, np.float32)
    indexcp.insert_keys(view, 1, key, np.array([129], np.int64))
    assert not layers[0].any()
    np.testing.assert_array_equal(layers[1][128 * 128 + 128: 128 * 128 + 256], ref.e4m3_encode(key[0]))
    assert view.array is not None and view.num_layers == 2


@pytest.mark.parametrize("norm,rope", [(True, False), (False, True), (True, True)])
def test_rmsnorm_and_rope_match_the_reference(norm, rope):
    """Insert and Q cast with RMSNorm and / or RoPE write the bytes of spec_ref.preprocess (an
    independent numpy formulation of indexer.md section 6) quantized by the reference."""
    rng = np.random.default_rng(11)
    n, theta = 40, 1e4
    keys = (rng.standard_normal((n, 128)) * 3).astype(np.float32)
    w = (rng.standard_normal(128) * 0.2).astype(np.float32) if norm else None
    pos = rng.integers(0, 100000, n).astype(np.int64) if rope else None
    extra = {}
    if norm:
        extra["norm_weight"] = w
    if rope:
        extra.update(rope=True, rope_theta=theta, positions=pos)
    want = ref.preprocess(keys, w, 1e-6, pos, theta)
    for dtype in ("fp8", "nvfp4"):
        _, buf, view = make_cache(dtype, 128, 1, 1, 1, 0)
        indexcp.insert_keys(view, 0, keys, np.arange(n, dtype=np.int64), **extra)
        for t in range(n):
            got = np.frombuffer(indexcp.read_row_bytes(view, 0, 0, t), np.uint8)
            np.testing.assert_array_equal(got, ref.key_row_bytes(dtype, want[t]), err_msg=f"{dtype} token {t}")
    # the Q cast: every head of a token takes the token's position
    H = 4
    q = (rng.standard_normal((n, H, 128)) * 3).astype(np.float32)
    out = np.zeros((n, H, 128), np.uint8)
    indexcp.quantize_queries(q, out, **extra)
    qpos = None if pos is None else np.repeat(pos, H)
    want_q = ref.preprocess(q.reshape(n * H, 128), w, 1e-6, qpos, theta).reshape(n, H, 128)
    np.testing.assert_array_equal(out, ref.e4m3_encode(want_q))
