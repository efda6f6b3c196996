"""PyTorch on the CPU: tensors cross without copies (the cache is a torch uint8 tensor the caller
allocated), bf16 keys, refusals by name, and the torch.ops.indexcp.* custom ops eager vs
torch.compile(fullgraph=True), bit for bit. Marker `torch`: skipped without PyTorch."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import indexcp  # noqa: E402
import indexcp.ops  # noqa: E402,F401
import spec_ref as ref  # noqa: E402
from rank_threads import run_rank_threads  # noqa: E402

pytestmark = pytest.mark.torch


def tensor_cache(dtype=indexcp.KvDtype.nvfp4, P=128, W=1, pages=6, layers=2, rank=0):
    layout = indexcp.make_page_layout(dtype, P, W)
    t = torch.zeros(indexcp.view_bytes(layout, pages, layers), dtype=torch.uint8)
    return t, indexcp.make_cache_view(layout, t, pages, layers, rank)


def test_insert_into_a_torch_tensor_is_zero_copy_and_exact():
    t, view = tensor_cache()
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(50, 128, generator=g)
    slots = torch.randperm(6 * 128, generator=g)[:50].to(torch.int64)
    indexcp.insert_keys(view, 1, keys, slots)
    expect = np.zeros(t.numel(), np.uint8)
    for i in range(50):
        ref.write_row(expect, "nvfp4", 128, 1, 9216, 6 * 9216, 1, int(slots[i]),
                      ref.key_row_bytes("nvfp4", keys[i].numpy()), 0)
    np.testing.assert_array_equal(t.numpy(), expect)  # the tensor itself holds the bytes


def test_bf16_keys_equal_their_bit_patterns():
    a, va = tensor_cache(indexcp.KvDtype.fp8)
    b, vb = tensor_cache(indexcp.KvDtype.fp8)
    keys = torch.randn(20, 128).to(torch.bfloat16)
    slots = torch.arange(20, dtype=torch.int64)
    indexcp.insert_keys(va, 0, keys, slots)
    indexcp.insert_keys(vb, 0, keys.view(torch.int16).numpy().view(np.uint16), slots.numpy())
    assert torch.equal(a, b) and a.any()


def test_torch_refusals_by_name():
    t, view = tensor_cache()
    before = t.clone()
    slots = torch.arange(4, dtype=torch.int64)
    for name, keys, s in [
        ("keys", torch.randn(128, 4).t(), slots),  # a transposed view: not contiguous
        ("keys", torch.randn(4, 128, dtype=torch.float16), slots),
        ("slot_mapping", torch.randn(4, 128), slots.to(torch.int32)),
        ("slot_mapping", torch.randn(4, 128), torch.arange(8, dtype=torch.int64)[::2]),
    ]:
        with pytest.raises(indexcp.InvalidArgumentError, match=name):
            indexcp.insert_keys(view, 0, keys, s)
    assert torch.equal(t, before)
    with pytest.raises(indexcp.InvalidArgumentError, match="cache"):
        indexcp.make_cache_view(view.layout, torch.zeros(100, dtype=torch.uint8), 6, 2)


def make_step(H=4, Q=2, K=8, pages=6, requests=2):
    t, view = tensor_cache(pages=pages)
    handle = indexcp.ops.cache_handle(view)
    rc = indexcp.resolve_config(indexcp.AttentionConfig.from_json('{"indexer_kv_dtype": "nvfp4"}'),
                                indexcp.EngineParams(tp=1, heads=H, query_len=Q))
    lim = indexcp.DecodeLimits(max_requests=requests, max_pages=3, query_len=Q, heads=H,
                               sel=indexcp.SelectionParams(topk=K))
    plan = indexcp.ops.decode_plan(rc, 0, lim)
    return t, view, handle, plan, indexcp.ops.plan(plan)


def step(t, handle, plan, keys, slots, q32, bt, sl, ws, out, st_k, st_q, q8):
    torch.ops.indexcp.insert_keys_(t, keys, slots, st_k, None, handle, 1, 1.0)
    torch.ops.indexcp.quantize_queries_(q32, q8, st_q)
    torch.ops.indexcp.decode_run_(plan, handle, t, 1, q8, bt, sl, ws, out, None)


def test_ops_eager_equals_compiled_and_the_sync_select():
    H, Q, K = 4, 2, 8
    t, view, handle, plan, p = make_step(H, Q, K)
    g = torch.Generator().manual_seed(3)
    n = 3 * 128 * 2
    keys = torch.randn(n, 128, generator=g)
    bt = torch.tensor([[0, 2, 4], [1, 3, 5]], dtype=torch.int32)
    seq = torch.tensor([300, 384], dtype=torch.int32)
    slots = torch.cat([bt[0].repeat_interleave(128) * 128 + torch.arange(384) % 128,
                       bt[1].repeat_interleave(128) * 128 + torch.arange(384) % 128]).to(torch.int64)
    q32 = torch.randn(2 * Q, H, 128, generator=g)
    ws = torch.zeros(max(p.workspace_bytes, 16), dtype=torch.uint8)
    results = []
    for fn in (step, torch.compile(step, fullgraph=True)):
        t.zero_()
        out = torch.full((2 * Q, p.num_heads, K), -7, dtype=torch.int32)
        st_k = torch.zeros(indexcp.STATUS_BYTES, dtype=torch.uint8)
        st_q = torch.zeros(indexcp.STATUS_BYTES, dtype=torch.uint8)
        q8 = torch.zeros(2 * Q, H, 128, dtype=torch.uint8)
        fn(t, handle, plan, keys, slots, q32, bt, seq, ws, out, st_k, st_q, q8)
        assert indexcp.read_status(st_k.numpy()).reason == 0
        results.append((t.clone(), out.clone(), q8.clone()))
    (c0, o0, q0), (c1, o1, q1) = results
    assert torch.equal(c0, c1) and torch.equal(q0, q1) and torch.equal(o0, o1)
    # and the same as the synchronous selection over the same bytes
    sync = np.zeros((2 * Q, H, K), np.int32)
    indexcp.decode_select(view, 1, q0.numpy(), bt.numpy(), seq.numpy(), Q, 0, H, indexcp.SelectionParams(topk=K),
                          indexcp.KRounding.e4m3, sync)
    np.testing.assert_array_equal(o0.numpy(), sync)
    assert (o0 >= 0).sum() > 0


def test_ops_icp_split_exchange_compiled_equals_replicated():
    W, H, Q, K = 2, 4, 1, 4
    g = torch.Generator().manual_seed(5)
    keys = torch.randn(6 * 128, 128, generator=g)
    slots = torch.arange(6 * 128, dtype=torch.int64)
    bt = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    seq = torch.tensor([384, 200], dtype=torch.int32)
    q8 = torch.zeros(2 * Q, H, 128, dtype=torch.uint8)
    indexcp.quantize_queries(torch.randn(2 * Q, H, 128, generator=g), q8)
    rep = np.zeros((2 * Q, H, K), np.int32)
    rt, rv = tensor_cache()
    indexcp.insert_keys(rv, 0, keys, slots)
    indexcp.decode_select(rv, 0, q8, bt, seq, Q, 0, H, indexcp.SelectionParams(topk=K), indexcp.KRounding.e4m3, rep)
    rc = indexcp.resolve_config(indexcp.AttentionConfig.from_json('{"indexer_cache_sharding": "on", '
                                                                  '"indexer_kv_dtype": "nvfp4"}'),
                                indexcp.EngineParams(tp=W, heads=H, query_len=Q))
    lim = indexcp.DecodeLimits(max_requests=2, max_pages=3, query_len=Q, heads=H, sel=indexcp.SelectionParams(topk=K))
    ranks = []
    for r in range(W):
        t, v = tensor_cache(W=W, rank=r)
        indexcp.insert_keys(v, 0, keys, slots)
        plan = indexcp.ops.decode_plan(rc, r, lim)
        ranks.append((t, indexcp.ops.cache_handle(v), plan, indexcp.ops.plan(plan)))
    eb = ranks[0][3].exchange_bytes

    def two_ranks(q8, bt, seq, recv, outs, wss):
        for r, (t, h, plan, _) in enumerate(ranks):
            torch.ops.indexcp.decode_publish_(plan, h, t, 0, q8, bt, seq, wss[r], recv[r * eb:(r + 1) * eb])
        for r, (_, _, plan, _) in enumerate(ranks):
            torch.ops.indexcp.decode_merge_(plan, q8, bt, seq, recv, outs[r], None)

    for fn in (two_ranks, torch.compile(two_ranks, fullgraph=True)):
        recv = torch.zeros(W * eb, dtype=torch.uint8)
        outs = [torch.full((2 * Q, p.num_heads, K), -7, dtype=torch.int32) for (_, _, _, p) in ranks]
        wss = [torch.zeros(max(p.workspace_bytes, 16), dtype=torch.uint8) for (_, _, _, p) in ranks]
        fn(q8, bt, seq, recv, outs, wss)
        got = torch.cat(outs, dim=1).numpy()
        np.testing.assert_array_equal(got, rep)


def test_distributed_decode_with_a_one_rank_group(tmp_path):
    """The torch.distributed convenience form on a one-rank gloo group: W = 1 with decode CP off is
    the replicated path; a one-rank group with a W = 1 decode-CP config is refused by the policy
    (decode CP needs W > 1), so the exchanging path is checked with the split form above."""
    import torch.distributed as dist

    import indexcp.distributed

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        t, view, handle, plan_h, p = make_step(H=4, Q=1, K=4)
        indexcp.insert_keys(view, 1, torch.randn(6 * 128, 128), torch.arange(6 * 128, dtype=torch.int64))
        q8 = torch.zeros(2, 4, 128, dtype=torch.uint8)
        indexcp.quantize_queries(torch.randn(2, 4, 128), q8)
        bt = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
        seq = torch.tensor([384, 250], dtype=torch.int32)
        out = torch.zeros(2, 4, 4, dtype=torch.int32)
        ws = torch.zeros(max(p.workspace_bytes, 16), dtype=torch.uint8)
        indexcp.distributed.decode(p, view, 1, q8, bt, seq, ws, None, None, out)
        sync = np.zeros((2, 4, 4), np.int32)
        indexcp.decode_select(view, 1, q8, bt, seq, 1, 0, 4, indexcp.SelectionParams(topk=4), indexcp.KRounding.e4m3,
                              sync)
        np.testing.assert_array_equal(out.numpy(), sync)
    finally:
        dist.destroy_process_group()


def _icp_rank(rank, world, init, out_dir):
    import torch.distributed as dist

    import indexcp.distributed

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        keys, slots, q8, bt, seq = _icp_inputs()
        rc = indexcp.resolve_config(indexcp.AttentionConfig.from_json('{"indexer_cache_sharding": "on", '
                                                                      '"indexer_kv_dtype": "nvfp4"}'),
                                    indexcp.EngineParams(tp=world, heads=4, query_len=1))
        lim = indexcp.DecodeLimits(max_requests=2, max_pages=3, query_len=1, heads=4,
                                   sel=indexcp.SelectionParams(topk=4))
        plan = indexcp.DecodePlan(rc, rank, lim)
        t, view = tensor_cache(W=world, rank=rank)
        indexcp.insert_keys(view, 0, keys, slots)
        ws = torch.zeros(max(plan.workspace_bytes, 16), dtype=torch.uint8)
        send = torch.zeros(plan.exchange_bytes, dtype=torch.uint8)
        recv = torch.zeros(world * plan.exchange_bytes, dtype=torch.uint8)
        out = torch.zeros(2, plan.num_heads, 4, dtype=torch.int32)
        status = torch.zeros(1, dtype=torch.int32)
        indexcp.distributed.decode(plan, view, 0, q8, bt, seq, ws, send, recv, out, status)
        assert int(status[0]) == 0
        np.save(f"{out_dir}/rank{rank}.npy", out.numpy())
    finally:
        dist.destroy_process_group()


def _icp_inputs():
    g = torch.Generator().manual_seed(8)
    keys = torch.randn(6 * 128, 128, generator=g)
    slots = torch.arange(6 * 128, dtype=torch.int64)
    q8 = torch.zeros(2, 4, 128, dtype=torch.uint8)
    indexcp.quantize_queries(torch.randn(2, 4, 128, generator=g), q8)
    return keys, slots, q8, torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32), torch.tensor([384, 300],
                                                                                                  dtype=torch.int32)


def test_distributed_icp_decode_two_processes_equals_replicated(tmp_path):
    """Two processes, a gloo group, sharded caches: indexcp.distributed.decode (publish,
    all_gather_into_tensor, merge) gives the replicated selection bit for bit."""
    import torch.multiprocessing as mp

    mp.spawn(_icp_rank, args=(2, f"file://{tmp_path}/rendezvous", str(tmp_path)), nprocs=2, join=True)
    got = np.concatenate([np.load(tmp_path / f"rank{r}.npy") for r in range(2)], axis=1)
    keys, slots, q8, bt, seq = _icp_inputs()
    t, view = tensor_cache()
    indexcp.insert_keys(view, 0, keys, slots)
    rep = np.zeros((2, 4, 4), np.int32)
    indexcp.decode_select(view, 0, q8, bt, seq, 1, 0, 4, indexcp.SelectionParams(topk=4), indexcp.KRounding.e4m3, rep)
    np.testing.assert_array_equal(got, rep)
    assert (rep >= 0).sum() > 8


def test_prefill_op_eager_equals_compiled_and_prefill_select():
    H, K = 4, 8
    t, view = tensor_cache(pages=6)
    handle = indexcp.ops.cache_handle(view)
    g = torch.Generator().manual_seed(12)
    indexcp.insert_keys(view, 0, torch.randn(6 * 128, 128, generator=g), torch.arange(6 * 128, dtype=torch.int64))
    rc = indexcp.resolve_config(indexcp.AttentionConfig.from_json('{"indexer_kv_dtype": "nvfp4"}'),
                                indexcp.EngineParams(tp=1, heads=H, query_len=1))
    bt = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    seq = torch.tensor([384, 300], dtype=torch.int32)
    query_start = torch.tensor([0, 100, 140], dtype=torch.int32)
    rows = 140
    q8 = torch.zeros(rows, H, 128, dtype=torch.uint8)
    indexcp.quantize_queries(torch.randn(rows, H, 128, generator=g), q8)
    lim = indexcp.PrefillLimits(max_requests=2, max_pages=3, max_rows=rows, heads=H, sel=indexcp.SelectionParams(topk=K))
    ph = indexcp.ops.prefill_plan(rc, 0, lim)
    p = indexcp.ops.plan(ph)
    ext = indexcp.prefill_extents(bt, seq, query_start, 128)
    ws = torch.zeros(max(p.workspace_bytes, 16), dtype=torch.uint8)
    # plain ints: Dynamo does not trace into the binding's objects, so read them outside
    e_rows, e_max, e_units = ext.rows, ext.max_rows_per_request, ext.gather_units

    def fn(q8, bt, seq, query_start, out):
        torch.ops.indexcp.prefill_run_(ph, handle, t, 0, q8, bt, seq, query_start, e_rows, e_max, e_units, ws, out,
                                       None)

    outs = []
    for f in (fn, torch.compile(fn, fullgraph=True)):
        out = torch.full((rows, H, K), -7, dtype=torch.int32)
        f(q8, bt, seq, query_start, out)
        outs.append(out)
    sync = np.zeros((rows, H, K), np.int32)
    indexcp.prefill_select(view, 0, q8, bt, seq, query_start, 0, H, indexcp.SelectionParams(topk=K), sync)
    assert torch.equal(outs[0], outs[1])
    np.testing.assert_array_equal(outs[0].numpy(), sync)


def test_op_handles_are_checked_and_released():
    layout = indexcp.make_page_layout(indexcp.KvDtype.nvfp4, 128, 1)
    t = torch.zeros(indexcp.view_bytes(layout, 4), dtype=torch.uint8)
    view = indexcp.make_cache_view(layout, t, 4)
    handle = indexcp.ops.cache_handle(view)
    rc = indexcp.resolve_config(indexcp.AttentionConfig.from_json('{"indexer_kv_dtype": "nvfp4"}'),
                                indexcp.EngineParams(tp=1, heads=4, query_len=1))
    plan = indexcp.ops.decode_plan(rc, 0, indexcp.DecodeLimits(max_requests=1, max_pages=4, query_len=1, heads=4))
    assert handle % 2 == 0 and plan % 2 == 1  # view and plan handles never coincide
    q = torch.zeros(1, 4, 128, dtype=torch.uint8)
    bt = torch.zeros(1, 4, dtype=torch.int32)
    seq = torch.ones(1, dtype=torch.int32)
    ws = torch.zeros(16, dtype=torch.uint8)
    out = torch.zeros(1, 4, 16, dtype=torch.int32)
    with pytest.raises(indexcp.InvalidArgumentError, match="plan"):  # the two handles swapped
        torch.ops.indexcp.decode_run_(handle, plan, t, 0, q, bt, seq, ws, out, None)
    torch.ops.indexcp.decode_run_(plan, handle, t, 0, q, bt, seq, ws, out, None)
    assert out[0, 0, 0].item() == 0 and out[0, 0, 1].item() == -1  # one visible block: itself
    indexcp.ops.release(plan)
    with pytest.raises(indexcp.InvalidArgumentError, match="plan"):
        indexcp.ops.plan(plan)
    with pytest.raises(indexcp.InvalidArgumentError, match="handle"):
        indexcp.ops.release(plan)
    per_layer = indexcp.make_cache_view_layers(layout, [torch.zeros(indexcp.view_bytes(layout, 4), dtype=torch.uint8)], 4)
    with pytest.raises(indexcp.InvalidArgumentError, match="per-layer"):
        indexcp.ops.cache_handle(per_layer)


def _sharded_prefill_config(prefill_cp, W, H, K, rows):
    """The resolved config (NVFP4, sharding on, prefill_cp at TP W) and the limits of
    _prefill_case's two requests of up to 3 pages."""
    rc = indexcp.resolve_config(
        indexcp.AttentionConfig.from_json('{"indexer_cache_sharding": "on", "indexer_kv_dtype": "nvfp4", '
                                          '"indexer_prefill_cp": "%s"}' % prefill_cp),
        indexcp.EngineParams(tp=W, heads=H, query_len=1))
    lim = indexcp.PrefillLimits(max_requests=2, max_pages=3, max_rows=rows, heads=H, sel=indexcp.SelectionParams(topk=K))
    return rc, lim


def _prefill_case(seed=21, H=4, K=8):
    """Two requests over 3 pages each (the second chunk ends mid-page), and their replicated
    prefill selection on the CPU (prefill_select, checked against spec_ref in test_select.py)."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(6 * 128, 128, generator=g)
    slots = torch.arange(6 * 128, dtype=torch.int64)
    bt = torch.tensor([[0, 1, 2], [5, 3, 4]], dtype=torch.int32)
    seq = torch.tensor([384, 300], dtype=torch.int32)
    query_start = torch.tensor([0, 100, 140], dtype=torch.int32)
    rows = 140
    q8 = torch.zeros(rows, H, 128, dtype=torch.uint8)
    indexcp.quantize_queries(torch.randn(rows, H, 128, generator=g) * 3, q8)
    _, rv = tensor_cache(pages=6)
    indexcp.insert_keys(rv, 0, keys, slots)
    rep = np.zeros((rows, H, K), np.int32)
    indexcp.prefill_select(rv, 0, q8, bt, seq, query_start, 0, H, indexcp.SelectionParams(topk=K), rep)
    return keys, slots, bt, seq, query_start, q8, rep


@pytest.mark.parametrize("prefill_cp", ["gather", "local_score"])
def test_sharded_prefill_op_on_two_threads_equals_replicated(prefill_cp):
    """Item 1 of issue 24: the gather and local_score prefill paths as torch ops. Two ranks on two
    threads, each with its cache shard and an InProcessGroup communicator handle, run prefill_run_
    eagerly and compiled (fullgraph); the union of their owned heads equals the replicated prefill
    bit for bit."""
    W, H, K = 2, 4, 8
    keys, slots, bt, seq, query_start, q8, rep = _prefill_case(H=H, K=K)
    assert (rep >= 0).sum() > rep.shape[0] * rep.shape[1]  # more than the local block: a real selection
    rows = q8.shape[0]
    rc, lim = _sharded_prefill_config(prefill_cp, W, H, K, rows)
    ext = indexcp.prefill_extents(bt, seq, query_start, 128)
    e_rows, e_max, e_units = ext.rows, ext.max_rows_per_request, ext.gather_units
    group = indexcp.InProcessGroup(W)
    ranks = []
    for r in range(W):
        t, v = tensor_cache(W=W, rank=r, pages=6)
        indexcp.insert_keys(v, 0, keys, slots)
        ph = indexcp.ops.prefill_plan(rc, r, lim)
        p = indexcp.ops.plan(ph)
        assert p.path == getattr(indexcp.PrefillPath, prefill_cp)
        ranks.append((t, indexcp.ops.cache_handle(v), ph, p, indexcp.ops.comm_handle(group.comm(r))))

    def rank_fn(r):
        t, h, ph, _, ch = ranks[r]

        def fn(q8, bt, seq, query_start, ws, out, status):
            torch.ops.indexcp.prefill_run_(ph, h, t, 0, q8, bt, seq, query_start, e_rows, e_max, e_units, ws, out,
                                           status, ch)
        return fn

    fns = [rank_fn(r) for r in range(W)]
    for compiled in (False, True):
        got = torch.full((rows, H, K), -7, dtype=torch.int32)

        def body(r):
            _, _, _, p, _ = ranks[r]
            ws = torch.zeros(max(p.workspace_bytes, 16), dtype=torch.uint8)
            out = torch.full((rows, p.num_heads, K), -7, dtype=torch.int32)
            status = torch.full((1,), 5, dtype=torch.int32)
            f = torch.compile(fns[r], fullgraph=True) if compiled else fns[r]
            f(q8, bt, seq, query_start, ws, out, status)
            assert status.item() == 0
            got[:, p.head_begin:p.head_begin + p.num_heads] = out

        run_rank_threads(W, body, group, timeout=300)
        np.testing.assert_array_equal(got.numpy(), rep, err_msg=f"compiled={compiled}")
    for t, h, ph, _, ch in ranks:
        indexcp.ops.release(ch)
        indexcp.ops.release(ph)
        indexcp.ops.release(h)


def test_sharded_prefill_needs_a_communicator_of_host_memory():
    W, H, K = 2, 4, 8
    _, _, bt, seq, query_start, q8, _ = _prefill_case(H=H, K=K)
    rows = q8.shape[0]
    rc, lim = _sharded_prefill_config("gather", W, H, K, rows)
    ext = indexcp.prefill_extents(bt, seq, query_start, 128)
    t, v = tensor_cache(W=W, rank=0, pages=6)
    h = indexcp.ops.cache_handle(v)
    ph = indexcp.ops.prefill_plan(rc, 0, lim)
    p = indexcp.ops.plan(ph)
    ws = torch.zeros(max(p.workspace_bytes, 16), dtype=torch.uint8)
    out = torch.full((rows, p.num_heads, K), -7, dtype=torch.int32)
    args = (ph, h, t, 0, q8, bt, seq, query_start, ext.rows, ext.max_rows_per_request, ext.gather_units, ws, out, None)
    with pytest.raises(indexcp.InvalidArgumentError, match="comm"):  # the gather path exchanges: comm is required
        torch.ops.indexcp.prefill_run_(*args)
    with pytest.raises(indexcp.InvalidArgumentError, match="comm"):  # a plan handle is not a comm handle
        torch.ops.indexcp.prefill_run_(*args, ph)
    with pytest.raises(indexcp.InvalidArgumentError, match="comm"):  # not live
        torch.ops.indexcp.prefill_run_(*args, -12345)
    with pytest.raises(indexcp.InvalidArgumentError, match="comm"):
        indexcp.ops.comm_handle(7)
    with pytest.raises(indexcp.InvalidArgumentError, match="comm"):  # the binding: not a communicator
        p.run(v, 0, q8, bt, seq, query_start, ext, ws, out, 3)
    group = indexcp.InProcessGroup(W)
    ch = indexcp.ops.comm_handle(group.comm(1))
    assert ch < 0
    with pytest.raises(indexcp.InvalidArgumentError, match="comm"):  # rank 1's comm for the rank-0 plan
        torch.ops.indexcp.prefill_run_(*args, ch)
    assert (out == -7).all()
    indexcp.ops.release(ch)
    with pytest.raises(indexcp.InvalidArgumentError, match="comm"):
        torch.ops.indexcp.prefill_run_(*args, ch)
    indexcp.ops.release(ph)
    indexcp.ops.release(h)


@pytest.mark.parametrize("norm,rope", [(True, False), (False, True), (True, True)])
def test_insert_and_qcast_ops_with_rmsnorm_and_rope_match_the_reference(norm, rope):
    """Item 2 of issue 24: insert_keys_ / quantize_queries_ with RMSNorm and RoPE write the bytes
    of spec_ref.preprocess (indexer.md 6) quantized by the reference, eager and compiled."""
    rng = np.random.default_rng(17)
    n, H, theta, eps = 24, 4, 1e4, 1e-5
    keys = torch.from_numpy((rng.standard_normal((n, 128)) * 3).astype(np.float32))
    q = torch.from_numpy((rng.standard_normal((n, H, 128)) * 3).astype(np.float32))
    w = torch.from_numpy((rng.standard_normal(128) * 0.2).astype(np.float32)) if norm else None
    pos = torch.from_numpy(rng.integers(0, 300, n).astype(np.int64)) if rope else None
    table = None
    if rope:
        table = torch.zeros(300, 64)
        indexcp.fill_rope_table(table, theta)
    wn = None if w is None else w.numpy()
    pn = None if pos is None else pos.numpy()
    want_k = ref.preprocess(keys.numpy(), wn, eps, pn, theta)
    want_q = ref.preprocess(q.numpy().reshape(n * H, 128), wn, eps, None if pn is None else np.repeat(pn, H),
                            theta).reshape(n, H, 128)
    slots = torch.arange(n, dtype=torch.int64)
    for dtype in ("fp8", "nvfp4"):
        t, view = tensor_cache(getattr(indexcp.KvDtype, dtype), pages=1, layers=1)
        handle = indexcp.ops.cache_handle(view)

        def fn(cache, keys, slots, st_k, q, q8, st_q, w, pos, table):
            torch.ops.indexcp.insert_keys_(cache, keys, slots, st_k, None, handle, 0, 1.0, w, eps, rope, theta, pos,
                                           table)
            torch.ops.indexcp.quantize_queries_(q, q8, st_q, w, eps, rope, theta, pos, table)

        for f in (fn, torch.compile(fn, fullgraph=True)):
            t.zero_()
            st_k = torch.zeros(indexcp.STATUS_BYTES, dtype=torch.uint8)
            st_q = torch.zeros(indexcp.STATUS_BYTES, dtype=torch.uint8)
            q8 = torch.zeros(n, H, 128, dtype=torch.uint8)
            f(t, keys, slots, st_k, q, q8, st_q, w, pos, table)
            indexcp.throw_if_refused(st_k.numpy())
            indexcp.throw_if_refused(st_q.numpy())
            for i in range(n):
                got = np.frombuffer(indexcp.read_row_bytes(view, 0, 0, i), np.uint8)
                np.testing.assert_array_equal(got, ref.key_row_bytes(dtype, want_k[i]), err_msg=f"{dtype} token {i}")
            np.testing.assert_array_equal(q8.numpy(), ref.e4m3_encode(want_q))
        indexcp.ops.release(handle)


def test_insert_op_preprocess_refusals_by_name():
    t, view = tensor_cache(pages=1, layers=1)
    handle = indexcp.ops.cache_handle(view)
    keys = torch.randn(4, 128)
    slots = torch.arange(4, dtype=torch.int64)
    st = torch.zeros(indexcp.STATUS_BYTES, dtype=torch.uint8)
    before = t.clone()
    table = torch.zeros(8, 64)
    indexcp.fill_rope_table(table, 5e6)
    with pytest.raises(indexcp.InvalidArgumentError, match="norm_weight"):
        torch.ops.indexcp.insert_keys_(t, keys, slots, st, None, handle, 0, 1.0, torch.zeros(64))
    with pytest.raises(indexcp.InvalidArgumentError, match="positions"):
        torch.ops.indexcp.insert_keys_(t, keys, slots, st, None, handle, 0, 1.0, None, 1e-6, True, 5e6,
                                       torch.arange(3, dtype=torch.int64), table)
    with pytest.raises(indexcp.InvalidArgumentError, match="rope_cos_sin"):
        torch.ops.indexcp.insert_keys_(t, keys, slots, st, None, handle, 0, 1.0, None, 1e-6, True, 5e6,
                                       torch.arange(4, dtype=torch.int64), torch.zeros(8, 32))
    q8 = torch.zeros(4, 2, 128, dtype=torch.uint8)
    with pytest.raises(indexcp.InvalidArgumentError, match="positions"):
        torch.ops.indexcp.quantize_queries_(torch.randn(4, 2, 128), q8, st, None, 1e-6, True, 5e6,
                                            torch.arange(8, dtype=torch.int64), table)
    assert torch.equal(t, before) and not q8.any()
    indexcp.ops.release(handle)


class _ThreadComm(indexcp.HostCommunicator):
    """A HostCommunicator written in Python over threads of one process (a barrier and a shared
    list): the library calls its all_gather from inside run with the GIL released, on each rank's
    thread."""

    def __init__(self, rank, world, shared):
        indexcp.HostCommunicator.__init__(self, rank, world)
        self.shared = shared  # (threading.Barrier, list of world buffers)
        self.calls = 0

    def all_gather(self, send, recv):
        barrier, bufs = self.shared
        bufs[self.rank] = send.copy()
        barrier.wait(timeout=60)
        n = send.shape[0]
        for p in range(self.world):
            recv[p * n:(p + 1) * n] = bufs[p]
        barrier.wait(timeout=60)
        self.calls += 1

    def all_to_all(self, send, recv):
        raise NotImplementedError("not used by these tests")


class _Boom(indexcp.HostCommunicator):
    def all_gather(self, send, recv):
        raise ValueError("boom from all_gather")

    def all_to_all(self, send, recv):
        raise ValueError("boom from all_to_all")


def test_host_communicator_subclass_calls_and_errors():
    """Item 3 of issue 24: a Python subclass of HostCommunicator is called by the library (here
    through call_all_gather, as a plan calls it) with the library's buffers; its exception comes
    back as itself; rank / world are checked."""
    import threading
    c = _ThreadComm(0, 1, (threading.Barrier(1), [None]))
    send = np.arange(10, dtype=np.uint8)
    recv = np.zeros(10, np.uint8)
    c.call_all_gather(send, recv)
    np.testing.assert_array_equal(recv, send)
    assert c.calls == 1 and c.bytes_sent == 10 and (c.rank, c.world) == (0, 1)
    with pytest.raises(ValueError, match="boom from all_gather"):
        _Boom(0, 1).call_all_gather(send, recv)
    with pytest.raises(indexcp.InvalidArgumentError, match="rank"):
        _Boom(2, 2)
    with pytest.raises(indexcp.InvalidArgumentError, match="world"):
        _Boom(0, 0)


@pytest.mark.parametrize("prefill_cp", ["gather", "local_score"])
def test_sharded_prefill_through_a_python_communicator_equals_replicated(prefill_cp):
    """The CPU PrefillPlan exchanging through a Python HostCommunicator on two threads (binding and
    op): the union of the owned heads equals the replicated prefill bit for bit."""
    import threading
    W, H, K = 2, 4, 8
    keys, slots, bt, seq, query_start, q8, rep = _prefill_case(seed=23, H=H, K=K)
    rows = q8.shape[0]
    rc, lim = _sharded_prefill_config(prefill_cp, W, H, K, rows)
    ext = indexcp.prefill_extents(bt, seq, query_start, 128)
    shared = (threading.Barrier(W), [None] * W)
    comms = [_ThreadComm(r, W, shared) for r in range(W)]
    for use_op in (False, True):
        got = torch.full((rows, H, K), -7, dtype=torch.int32)

        def body(r):
            t, v = tensor_cache(W=W, rank=r, pages=6)
            indexcp.insert_keys(v, 0, keys, slots)
            p = indexcp.PrefillPlan(rc, r, lim)
            ws = torch.zeros(max(p.workspace_bytes, 16), dtype=torch.uint8)
            out = torch.full((rows, p.num_heads, K), -7, dtype=torch.int32)
            status = torch.full((1,), 5, dtype=torch.int32)
            if use_op:
                h, ph, ch = indexcp.ops.cache_handle(v), indexcp.ops.prefill_plan(rc, r, lim), \
                    indexcp.ops.comm_handle(comms[r])
                torch.ops.indexcp.prefill_run_(ph, h, t, 0, q8, bt, seq, query_start, ext.rows,
                                               ext.max_rows_per_request, ext.gather_units, ws, out, status, ch)
                for x in (h, ph, ch):
                    indexcp.ops.release(x)
            else:
                p.run(v, 0, q8, bt, seq, query_start, ext, ws, out, comms[r], status)
            assert status.item() == 0
            got[:, p.head_begin:p.head_begin + p.num_heads] = out

        class _Abort:
            def abort(self):
                shared[0].abort()

        run_rank_threads(W, body, _Abort(), timeout=300)
        np.testing.assert_array_equal(got.numpy(), rep, err_msg=f"use_op={use_op}")
    assert all(c.calls >= 2 for c in comms) and comms[0].bytes_sent > 0


def _prefill_rank(rank, world, init, out_dir):
    import torch.distributed as dist

    import indexcp.distributed

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        H, K = 4, 8
        keys, slots, bt, seq, query_start, q8, _ = _prefill_case(seed=31, H=H, K=K)
        rows = q8.shape[0]
        ext = indexcp.prefill_extents(bt, seq, query_start, 128)
        comm = indexcp.distributed.TorchCommunicator()
        assert (comm.rank, comm.world) == (rank, world)
        for prefill_cp in ("gather", "local_score"):
            rc, lim = _sharded_prefill_config(prefill_cp, world, H, K, rows)
            t, v = tensor_cache(W=world, rank=rank, pages=6)
            indexcp.insert_keys(v, 0, keys, slots)
            ph = indexcp.ops.prefill_plan(rc, rank, lim)
            p = indexcp.ops.plan(ph)
            h, ch = indexcp.ops.cache_handle(v), indexcp.ops.comm_handle(comm)
            ws = torch.zeros(max(p.workspace_bytes, 16), dtype=torch.uint8)
            for use_op in (False, True):
                out = torch.full((rows, p.num_heads, K), -7, dtype=torch.int32)
                status = torch.full((1,), 5, dtype=torch.int32)
                if use_op:
                    torch.ops.indexcp.prefill_run_(ph, h, t, 0, q8, bt, seq, query_start, ext.rows,
                                                   ext.max_rows_per_request, ext.gather_units, ws, out, status, ch)
                else:
                    p.run(v, 0, q8, bt, seq, query_start, ext, ws, out, comm, status)
                assert int(status[0]) == 0
                np.save(f"{out_dir}/{prefill_cp}_{int(use_op)}_rank{rank}.npy", out.numpy())
            for x in (ph, h, ch):
                indexcp.ops.release(x)
        assert comm.bytes_sent > 0
        # both ranks are past their last collective before either tears the group down. One CI
        # run saw a rank abort at the end ("terminate called without an active exception",
        # docs/testing.md); one rank destroying its gloo group while the other is still in the
        # last all_to_all is the suspected cause, not established.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_sharded_prefill_two_gloo_processes_through_torch_communicator(tmp_path):
    """Item 3 of issue 24: two processes, a gloo group, sharded caches: the CPU PrefillPlan's gather
    and local_score paths exchanging through indexcp.distributed.TorchCommunicator (binding and
    op) give the replicated prefill bit for bit."""
    import torch.multiprocessing as mp

    mp.spawn(_prefill_rank, args=(2, f"file://{tmp_path}/rendezvous", str(tmp_path)), nprocs=2, join=True)
    *_, rep = _prefill_case(seed=31)
    for prefill_cp in ("gather", "local_score"):
        for use_op in (0, 1):
            got = np.concatenate([np.load(tmp_path / f"{prefill_cp}_{use_op}_rank{r}.npy") for r in range(2)], axis=1)
            np.testing.assert_array_equal(got, rep, err_msg=f"{prefill_cp} use_op={use_op}")


def test_torch_communicator_on_a_one_rank_group(tmp_path):
    import torch.distributed as dist

    import indexcp.distributed

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        comm = indexcp.distributed.TorchCommunicator()
        assert (comm.rank, comm.world) == (0, 1)
        send = np.arange(1, 33, dtype=np.uint8)
        recv = np.zeros(32, np.uint8)
        comm.call_all_gather(send, recv)
        np.testing.assert_array_equal(recv, send)
        assert comm.bytes_sent == 32
    finally:
        dist.destroy_process_group()


def test_icp_decode_op_with_comm_handles_on_two_threads_equals_replicated():
    """decode_run_ of an exchanging (ICP) plan with InProcessGroup comm handles, one thread per rank:
    the union of the owned heads equals the replicated selection."""
    W, H, Q, K = 2, 4, 1, 4
    keys, slots, q8, bt, seq = _icp_inputs()
    rt, rv = tensor_cache()
    indexcp.insert_keys(rv, 0, keys, slots)
    rep = np.zeros((2 * Q, H, K), np.int32)
    indexcp.decode_select(rv, 0, q8, bt, seq, Q, 0, H, indexcp.SelectionParams(topk=K), indexcp.KRounding.e4m3, rep)
    rc = indexcp.resolve_config(indexcp.AttentionConfig.from_json('{"indexer_cache_sharding": "on", '
                                                                  '"indexer_kv_dtype": "nvfp4"}'),
                                indexcp.EngineParams(tp=W, heads=H, query_len=Q))
    lim = indexcp.DecodeLimits(max_requests=2, max_pages=3, query_len=Q, heads=H, sel=indexcp.SelectionParams(topk=K))
    group = indexcp.InProcessGroup(W)
    got = torch.full((2 * Q, H, K), -7, dtype=torch.int32)

    def body(r):
        t, v = tensor_cache(W=W, rank=r)
        indexcp.insert_keys(v, 0, keys, slots)
        ph, h, ch = indexcp.ops.decode_plan(rc, r, lim), indexcp.ops.cache_handle(v), indexcp.ops.comm_handle(group.comm(r))
        p = indexcp.ops.plan(ph)
        assert p.path == indexcp.DecodePath.icp
        ws = torch.zeros(max(p.workspace_bytes, 16), dtype=torch.uint8)
        out = torch.full((2 * Q, p.num_heads, K), -7, dtype=torch.int32)
        status = torch.full((1,), 5, dtype=torch.int32)
        torch.ops.indexcp.decode_run_(ph, h, t, 0, q8, bt, seq, ws, out, status, ch)
        assert status.item() == 0
        got[:, p.head_begin:p.head_begin + p.num_heads] = out
        for x in (ph, h, ch):
            indexcp.ops.release(x)

    run_rank_threads(W, body, group, timeout=300)
    np.testing.assert_array_equal(got.numpy(), rep)
