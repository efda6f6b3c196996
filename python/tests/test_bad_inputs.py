"""Every bad input raises the right class (InvalidArgumentError is a ValueError, UnsupportedError
a NotImplementedError, both indexcp.Error) with a message naming the argument, and leaves the
cache's bytes unchanged."""

import os
import re

import numpy as np
import pytest

import indexcp
from dlpack_fake import on_device

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
P, PAGES, LAYERS = 128, 4, 2


@pytest.fixture
def cache():
    """A filled NVFP4 cache (so that any stray write would show) and a valid batch."""
    layout = indexcp.make_page_layout(indexcp.KvDtype.nvfp4, P, 1)
    buf = np.zeros(indexcp.view_bytes(layout, PAGES, LAYERS), np.uint8)
    view = indexcp.make_cache_view(layout, buf, PAGES, LAYERS)
    rng = np.random.default_rng(1)
    n = PAGES * P
    indexcp.insert_keys(view, 0, rng.standard_normal((n, 128)).astype(np.float32), np.arange(n, dtype=np.int64))
    return layout, buf, view


def keys(n=3):
    return np.random.default_rng(2).standard_normal((n, 128)).astype(np.float32)


def nan_at(k, token, dim, value=np.nan):
    k[token, dim] = value
    return k


def slots(*s):
    return np.array(s, np.int64)


def bad(cls, name, fn, buf=None):
    before = None if buf is None else buf.copy()
    with pytest.raises(cls) as e:
        fn()
    assert isinstance(e.value, indexcp.Error)
    assert name in str(e.value), str(e.value)
    if buf is not None:
        np.testing.assert_array_equal(buf, before)
    return str(e.value)


IA = indexcp.InvalidArgumentError

INSERT_CASES = {
    "keys float64": (IA, "keys", lambda v: indexcp.insert_keys(v, 0, keys().astype(np.float64), slots(0, 1, 2))),
    "keys int32": (IA, "keys", lambda v: indexcp.insert_keys(v, 0, keys().astype(np.int32), slots(0, 1, 2))),
    "keys shape": (IA, "keys", lambda v: indexcp.insert_keys(v, 0, keys()[:, :64], slots(0, 1, 2))),
    "keys 1-D": (IA, "keys", lambda v: indexcp.insert_keys(v, 0, keys(1)[0], slots(0))),
    "keys strided": (IA, "keys", lambda v: indexcp.insert_keys(
        v, 0, np.repeat(keys(), 2, axis=1)[:, ::2], slots(0, 1, 2))),
    "keys column-major": (IA, "keys", lambda v: indexcp.insert_keys(
        v, 0, np.asfortranarray(keys()), slots(0, 1, 2))),
    "keys on cuda": (IA, "keys", lambda v: indexcp.insert_keys(v, 0, on_device(keys()), slots(0, 1, 2))),
    "slot_mapping int32": (IA, "slot_mapping", lambda v: indexcp.insert_keys(
        v, 0, keys(), np.array([0, 1, 2], np.int32))),
    "slot_mapping length": (IA, "slot_mapping", lambda v: indexcp.insert_keys(v, 0, keys(), slots(0, 1))),
    "slot_mapping on cuda": (IA, "slot_mapping", lambda v: indexcp.insert_keys(
        v, 0, keys(), on_device(slots(0, 1, 2)))),
    "slot out of range": (IA, "slot_mapping[1]", lambda v: indexcp.insert_keys(v, 0, keys(), slots(0, PAGES * P, 2))),
    "slot duplicated": (IA, "slot_mapping", lambda v: indexcp.insert_keys(v, 0, keys(), slots(0, 5, 5))),
    "NaN key": (IA, "token 1", lambda v: indexcp.insert_keys(v, 0, nan_at(keys(), 1, 3), slots(0, 1, 2))),
    "Inf key": (IA, "token 2", lambda v: indexcp.insert_keys(v, 0, nan_at(keys(), 2, 9, np.inf), slots(0, 1, 2))),
    "layer": (IA, "layer", lambda v: indexcp.insert_keys(v, LAYERS, keys(), slots(0, 1, 2))),
    "encode_scale": (IA, "encode_scale", lambda v: indexcp.insert_keys(v, 0, keys(), slots(0, 1, 2), encode_scale=0.0)),
    "rope without positions": (IA, "positions", lambda v: indexcp.insert_keys(v, 0, keys(), slots(0, 1, 2), rope=True)),
    "positions length": (IA, "positions", lambda v: indexcp.insert_keys(
        v, 0, keys(), slots(0, 1, 2), rope=True, positions=np.arange(2, dtype=np.int64))),
    "norm_weight shape": (IA, "norm_weight", lambda v: indexcp.insert_keys(
        v, 0, keys(), slots(0, 1, 2), norm_weight=np.zeros(64, np.float32))),
    "status size": (IA, "status", lambda v: indexcp.insert_keys_async(
        v, 0, keys(), slots(0, 1, 2), np.zeros(64, np.uint8))),
    "status dtype": (IA, "status", lambda v: indexcp.insert_keys_async(
        v, 0, keys(), slots(0, 1, 2), np.zeros(18, np.float32))),
    "status misaligned": (IA, "status", lambda v: indexcp.insert_keys_async(
        v, 0, keys(), slots(0, 1, 2), np.zeros(80, np.uint8)[1:73])),
    "async rope without table": (IA, "rope", lambda v: indexcp.insert_keys_async(
        v, 0, keys(), slots(0, 1, 2), np.zeros(indexcp.STATUS_BYTES, np.uint8), rope=True,
        positions=np.arange(3, dtype=np.int64))),
}


@pytest.mark.parametrize("case", sorted(INSERT_CASES))
def test_bad_insert_is_refused_by_name_and_writes_nothing(cache, case):
    cls, name, call = INSERT_CASES[case]
    _, buf, view = cache
    bad(cls, name, lambda: call(view), buf)


def test_async_insert_bad_token_is_recorded_not_raised(cache):
    _, buf, view = cache
    status = np.zeros(indexcp.STATUS_BYTES, np.uint8)
    before = buf.copy()
    indexcp.insert_keys_async(view, 1, keys(), slots(0, PAGES * P + 7, 2), status)
    np.testing.assert_array_equal(buf, before)
    st = indexcp.read_status(status)
    assert st.reason == indexcp.InsertRefusal.slot_out_of_range and st.value == PAGES * P + 7 and st.layer == 1
    bad(IA, "slot_mapping[1]", lambda: indexcp.throw_if_refused(status))


VIEW_CASES = {
    "too small": (IA, "cache", lambda L: indexcp.make_cache_view(
        L, np.zeros(indexcp.view_bytes(L, PAGES, LAYERS) - 1, np.uint8), PAGES, LAYERS)),
    "float32 bytes": (IA, "cache", lambda L: indexcp.make_cache_view(
        L, np.zeros(indexcp.view_bytes(L, PAGES, LAYERS) // 4, np.float32), PAGES, LAYERS)),
    "strided": (IA, "cache", lambda L: indexcp.make_cache_view(
        L, np.zeros(2 * indexcp.view_bytes(L, PAGES, LAYERS), np.uint8)[::2], PAGES, LAYERS)),
    "misaligned": (IA, "base", lambda L: indexcp.make_cache_view(
        L, np.zeros(indexcp.view_bytes(L, PAGES, LAYERS) + 16, np.uint8)[1:], PAGES, LAYERS)),
    "num_pages": (IA, "num_pages", lambda L: indexcp.make_cache_view(L, np.zeros(16, np.uint8), 0, 1)),
    "rank": (IA, "rank", lambda L: indexcp.make_cache_view(
        L, np.zeros(indexcp.view_bytes(L, PAGES, 1), np.uint8), PAGES, 1, 1)),
    "layer_stride": (IA, "layer_stride", lambda L: indexcp.make_cache_view(
        L, np.zeros(10 * indexcp.view_bytes(L, PAGES, LAYERS), np.uint8), PAGES, LAYERS, 0, 16)),
    "layer too small": (IA, "layers[1]", lambda L: indexcp.make_cache_view_layers(
        L, [np.zeros(indexcp.cache_layer_bytes(L, PAGES), np.uint8), np.zeros(100, np.uint8)], PAGES)),
    "page_size": (indexcp.UnsupportedError, "page_size", lambda L: indexcp.make_page_layout(indexcp.KvDtype.nvfp4, 64, 1)),
    "shards": (indexcp.UnsupportedError, "shards", lambda L: indexcp.make_page_layout(indexcp.KvDtype.nvfp4, 128, 16)),
    "page_stride": (IA, "page_stride", lambda L: indexcp.make_page_layout(indexcp.KvDtype.nvfp4, 128, 1, 9216 + 8)),
}


@pytest.mark.parametrize("case", sorted(VIEW_CASES))
def test_bad_cache_view_is_refused_by_name(case):
    cls, name, call = VIEW_CASES[case]
    layout = indexcp.make_page_layout(indexcp.KvDtype.nvfp4, P, 1)
    bad(cls, name, lambda: call(layout))


def test_device_cache_without_the_cuda_backend_or_to_the_cpu_backend(cache):
    layout, _, _ = cache
    dev = on_device(np.zeros(indexcp.view_bytes(layout, PAGES, 1), np.uint8))
    if not indexcp.cuda_built():
        bad(indexcp.UnsupportedError, "cache", lambda: indexcp.make_cache_view(layout, dev, PAGES, 1))
    else:
        view = indexcp.make_cache_view(layout, dev, PAGES, 1)
        assert view.location == indexcp.MemoryLocation.device
        bad(IA, "cache", lambda: indexcp.insert_keys(view, 0, keys(), slots(0, 1, 2)))


def decode_setup(view):
    rc = indexcp.resolve_config(indexcp.AttentionConfig.from_json('{"indexer_kv_dtype": "nvfp4"}'),
                                indexcp.EngineParams(tp=1, heads=4, query_len=2))
    sel = indexcp.SelectionParams(topk=4)
    plan = indexcp.DecodePlan(rc, 0, indexcp.DecodeLimits(max_requests=2, max_pages=PAGES, query_len=2, heads=4, sel=sel))
    q = np.zeros((4, 4, 128), np.uint8)
    q[..., 0] = 0x38
    bt = np.arange(2 * PAGES, dtype=np.int32).reshape(2, PAGES) % PAGES
    sl = np.array([500, 129], np.int32)
    ws = np.zeros(max(plan.workspace_bytes, 16), np.uint8)
    out = np.zeros((4, 4, 4), np.int32)
    return plan, q, bt, sl, ws, out, sel


def test_plan_run_good_then_every_bad_argument_by_name(cache):
    _, buf, view = cache
    plan, q, bt, sl, ws, out, sel = decode_setup(view)
    plan.run(view, 0, q, bt, sl, ws, out)  # the valid call works
    assert (out[0, 0] >= 0).all()
    cases = [
        ("q", lambda: plan.run(view, 0, q.astype(np.int8), bt, sl, ws, out)),
        ("q", lambda: plan.run(view, 0, q[:, :2].copy(), bt, sl, ws, out)),
        ("q", lambda: plan.run(view, 0, on_device(q), bt, sl, ws, out)),
        ("block_table", lambda: plan.run(view, 0, q, bt[:, :2].copy(), sl, ws, out)),
        ("block_table", lambda: plan.run(view, 0, q, bt.astype(np.int64), sl, ws, out)),
        ("block_table", lambda: plan.run(view, 0, q, np.ascontiguousarray(bt.T).T, sl, ws, out)),
        ("seq_lens", lambda: plan.run(view, 0, q, bt, sl.astype(np.int64), ws, out)),
        ("out", lambda: plan.run(view, 0, q, bt, sl, ws, out.astype(np.int64))),
        ("out", lambda: plan.run(view, 0, q, bt, sl, ws, out[:, :2].copy())),
        ("workspace", lambda: plan.run(view, 0, q, bt, sl, ws[:0], out) if plan.workspace_bytes else
         plan.run(view, 0, q, bt, sl, ws.astype(np.float32), out)),
        ("status", lambda: plan.run(view, 0, q, bt, sl, ws, out, status=np.zeros(2, np.uint32))),
        ("layer", lambda: plan.run(view, LAYERS, q, bt, sl, ws, out)),
        ("num_requests", lambda: plan.run(view, 0, np.zeros((6, 4, 128), np.uint8), np.zeros((3, PAGES), np.int32),
                                          np.zeros(3, np.int32), ws, np.zeros((6, 4, 4), np.int32))),
    ]
    for name, call in cases:
        bad(IA, name, call, buf)


def test_sync_select_bad_batch_by_name(cache):
    _, buf, view = cache
    _, q, bt, sl, _, out, sel = decode_setup(view)
    run = indexcp.decode_select
    e4 = indexcp.KRounding.e4m3
    bad(IA, "block_table", lambda: run(view, 0, q, bt + PAGES, sl, 2, 0, 4, sel, e4, out), buf)
    bad(IA, "seq_lens", lambda: run(view, 0, q, bt, np.array([1, 129], np.int32), 2, 0, 4, sel, e4, out), buf)
    q_nan = q.copy()
    q_nan[1, 2, 3] = 0x7F
    bad(IA, "q", lambda: run(view, 0, q_nan, bt, sl, 2, 0, 4, sel, e4, out), buf)
    bad(IA, "topk", lambda: run(view, 0, q, bt, sl, 2, 0, 4, indexcp.SelectionParams(topk=1),
                                e4, np.zeros((4, 4, 1), np.int32)), buf)
    bad(IA, "query_len", lambda: run(view, 0, q, bt, sl, 17, 0, 4, sel, e4, out), buf)


def test_quantize_queries_refusals():
    q = np.ones((2, 4, 128), np.float32)
    out = np.full((2, 4, 128), 0xAB, np.uint8)
    q[1, 2, 7] = np.nan
    msg = bad(IA, "q", lambda: indexcp.quantize_queries(q, out))
    assert "token 1" in msg and "head 2" in msg and "dim 7" in msg, msg
    assert (out == 0xAB).all()
    bad(IA, "out", lambda: indexcp.quantize_queries(np.ones((2, 4, 128), np.float32), np.zeros((2, 4, 128), np.int8)))
    bad(IA, "q", lambda: indexcp.quantize_queries(np.ones((2, 4, 64), np.float32), out))


CONFIG_CASES = [
    (IA, "indexer_kv_dtype", '{"indexer_kv_dtype": "fp4"}', {}),
    (IA, "unknown key", '{"indexer_sharding": "on"}', {}),
    (IA, "JSON object", "[1]", {}),
    (IA, "indexer_prefill_gather_budget_mib", '{"indexer_prefill_gather_budget_mib": 0}', {}),
    (indexcp.UnsupportedError, "kv_connector" if False else "connector", '{"indexer_cache_sharding": "on"}',
     {"tp": 2, "kv_connector": True}),
    (indexcp.UnsupportedError, "indexer_kv_dtype", '{"indexer_kv_dtype": "bf16", "indexer_cache_sharding": "on"}',
     {"tp": 2}),
    (indexcp.UnsupportedError, "tp = 3", '{"indexer_cache_sharding": "on"}', {"tp": 3}),
    (IA, "indexer_score_precision", '{"indexer_score_precision": "fp16"}', {}),
    (indexcp.UnsupportedError, "indexer_kv_dtype = \"bf16\"",
     '{"indexer_kv_dtype": "bf16", "indexer_score_precision": "fp8_mma"}', {}),
    (indexcp.UnsupportedError, "indexer_k_rounding = \"exact\"",
     '{"indexer_kv_dtype": "nvfp4", "indexer_k_rounding": "exact", "indexer_score_precision": "fp8_mma"}', {}),
]


def test_score_precision_round_trips():
    c = indexcp.AttentionConfig.from_json('{"indexer_kv_dtype": "nvfp4", "indexer_score_precision": "fp8_mma"}')
    assert c.score_precision == indexcp.ScorePrecision.fp8_mma
    rc = indexcp.resolve_config(c, indexcp.EngineParams(tp=2))
    assert rc.score_precision == indexcp.ScorePrecision.fp8_mma
    assert '"indexer_score_precision": "fp8_mma"' in rc.to_json()
    assert indexcp.AttentionConfig().score_precision == indexcp.ScorePrecision.fp32
    assert indexcp.parse_score_precision("fp32") == indexcp.ScorePrecision.fp32
    bad(IA, "indexer_score_precision", lambda: indexcp.parse_score_precision("tf32"))


@pytest.mark.parametrize("cls,name,text,engine", CONFIG_CASES)
def test_bad_config(cls, name, text, engine):
    def call():
        indexcp.resolve_config(indexcp.AttentionConfig.from_json(text), indexcp.EngineParams(**engine))

    msg = bad(cls, name, call)
    assert "\n" not in msg
    if cls is indexcp.UnsupportedError:
        assert isinstance(cls("x"), NotImplementedError)


BAD_INPUTS_DOC = os.path.join(REPO, "docs", "bad-inputs.md")


@pytest.mark.skipif(not os.path.exists(BAD_INPUTS_DOC), reason="docs/bad-inputs.md is not in this checkout")
def test_config_messages_equal_the_commands():
    """The messages are the C++ library's: the same text `indexcp config` prints for the same
    JSON (the recorded runs of docs/bad-inputs.md)."""
    rows = re.findall(r"\| config \| `config --tp (\d+) --page-size (\d+) --attention-config '([^']*)'`[^|]*\| "
                      r"`exit 2: indexcp: error: (?:--attention-config: )?([^`]*)` \|", open(BAD_INPUTS_DOC).read())
    assert len(rows) >= 3
    for tp, page, text, message in rows:
        with pytest.raises(indexcp.Error) as e:
            indexcp.resolve_config(indexcp.AttentionConfig.from_json(text),
                                   indexcp.EngineParams(tp=int(tp), page_size=int(page)))
        assert str(e.value) == message


def test_capacity_refusals_and_result():
    m = indexcp.ModelDesc.builtin("minimax-m3")
    r = indexcp.plan_capacity(m, 80 << 30, indexcp.KvDtype.fp8, indexcp.KvDtype.nvfp4, 2, 128)
    assert r.on.tokens > r.off.tokens > 0 and r.ratio > 1
    assert r.on.index_bytes_per_token == m.sparse_layers * indexcp.index_bytes_per_token(indexcp.KvDtype.nvfp4, 2)
    bad(indexcp.UnsupportedError, "tp", lambda: indexcp.plan_capacity(m, 1 << 30, indexcp.KvDtype.fp8, indexcp.KvDtype.nvfp4, 3, 128))
    bad(IA, "budget", lambda: indexcp.plan_capacity(m, 0, indexcp.KvDtype.fp8, indexcp.KvDtype.nvfp4, 2, 128))
    bad(IA, "--model", lambda: indexcp.ModelDesc.builtin("gpt-2"))


def test_error_classes():
    assert issubclass(indexcp.InvalidArgumentError, ValueError)
    assert issubclass(indexcp.UnsupportedError, NotImplementedError)
    assert issubclass(indexcp.RuntimeError, RuntimeError) and issubclass(indexcp.IoError, RuntimeError)
    for c in (indexcp.InvalidArgumentError, indexcp.UnsupportedError, indexcp.RuntimeError, indexcp.IoError):
        assert issubclass(c, indexcp.Error)
    assert indexcp.InvalidArgumentError.code == "kInvalidArgument"


def test_plan_limits_and_config_fields_are_copies():
    """Changing what a property returns must not change the plan (its buffers are sized once)."""
    rc = indexcp.resolve_config(indexcp.AttentionConfig.from_json('{"indexer_cache_sharding": "on"}'),
                                indexcp.EngineParams(tp=2, heads=4, query_len=1))
    plan = indexcp.DecodePlan(rc, 0, indexcp.DecodeLimits(max_requests=2, max_pages=4, query_len=1, heads=4))
    lim = plan.limits
    lim.max_requests = 64
    lim.sel.topk = 32
    assert plan.limits.max_requests == 2 and plan.limits.sel.topk == 16
    eng = rc.engine
    eng.tp = 8
    assert rc.engine.tp == 2


def test_a_view_over_a_raw_dlpack_capsule_keeps_its_memory(cache):
    layout, _, _ = cache
    arr = np.zeros(indexcp.view_bytes(layout, PAGES), np.uint8)
    view = indexcp.make_cache_view(layout, arr.__dlpack__(), PAGES)
    base = arr.__array_interface__["data"][0]
    del arr  # only the view holds the memory now
    import gc
    gc.collect()
    filler = [np.full(indexcp.view_bytes(layout, PAGES), 0x5A, np.uint8) for _ in range(4)]  # reuse freed memory
    indexcp.insert_keys(view, 0, keys(1), slots(3))
    want = indexcp.quantize_key_bytes(indexcp.KvDtype.nvfp4, keys(1)[0])
    got = indexcp.read_row_bytes(view, 0, 0, 3)
    assert bytes(got) == bytes(want)
    assert all(f[0] == 0x5A for f in filler) and base != 0
