"""The CUDA backend through the package (marker `gpu`: skipped without the CUDA backend or a GPU;
with PyTorch for the device tensors). Device results equal the CPU backend's: insert bytes and the
Q cast bit for bit, selections of the CUDA plan equal the CPU plan's, the ICP split exchange and the
run through Python device communicators equal the replicated CUDA plan bit for bit, a CUDA graph of insert + Q cast + decode replays with new
inputs, and the torch ops run eagerly, compiled and graph-replayed with the same bits."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import indexcp  # noqa: E402
import indexcp.ops  # noqa: E402,F401
from rank_threads import run_rank_threads  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.torch]

H, Q, K, P = 4, 2, 16, 128


def caches(W=1, rank=0, pages=40, layers=2, device="cuda"):
    layout = indexcp.make_page_layout(indexcp.KvDtype.nvfp4, P, W)
    t = torch.zeros(indexcp.view_bytes(layout, pages, layers), dtype=torch.uint8, device=device)
    return t, indexcp.make_cache_view(layout, t, pages, layers, rank)


def batch(seed=0, pages=40, requests=4):
    g = torch.Generator().manual_seed(seed)
    seq = torch.tensor([2000, 1500, 0, 700][:requests], dtype=torch.int32)
    max_pages = 16
    # every request reads the same 16 physical pages, each in its own order
    pages16 = torch.randperm(pages, generator=g)[:max_pages].to(torch.int32)
    bt = torch.stack([torch.roll(pages16, r) for r in range(requests)])
    keys = exact_keys(pages * P, g)
    slots = torch.arange(pages * P, dtype=torch.int64)
    # integer queries (exact in E4M3): with exact keys every dot product is exact in fp32 on both
    # backends, so the GPU's scores equal the CPU's and the selections must be equal, ties included
    q32 = torch.randint(-8, 9, (requests * Q, H, 128), generator=g).to(torch.float32)
    return keys, slots, q32, bt, seq


def exact_keys(n, g):
    """Keys whose NVFP4 form is exact: each 16-element group holds values of the E2M1 grid with
    one element of magnitude 6 (so the scale is 1.0)."""
    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    k = grid[torch.randint(0, 8, (n, 8, 16), generator=g)]
    k[torch.arange(n)[:, None], torch.arange(8)[None, :], torch.randint(0, 16, (n, 8), generator=g)] = 6.0
    sign = torch.where(torch.rand(n, 8, 16, generator=g) < 0.5, -1.0, 1.0)
    return (k * sign).reshape(n, 128).contiguous()


def test_device_insert_and_q_cast_equal_the_cpu():
    keys, slots, q32, _, _ = batch()
    ct, cv = caches(device="cpu")
    indexcp.insert_keys(cv, 1, keys, slots)
    gt, gv = caches()
    status = torch.zeros(indexcp.STATUS_BYTES, dtype=torch.uint8, device="cuda")
    ws = torch.zeros(indexcp.cuda.insert_workspace_bytes(keys.shape[0]), dtype=torch.uint8, device="cuda")
    indexcp.cuda.insert_keys_async(gv, 1, keys.cuda(), slots.cuda(), status, ws)
    indexcp.cuda.throw_if_refused(status)
    assert torch.equal(gt.cpu(), ct)
    q8c = torch.zeros(q32.shape, dtype=torch.uint8)
    indexcp.quantize_queries(q32, q8c)
    q8g = torch.zeros(q32.shape, dtype=torch.uint8, device="cuda")
    indexcp.cuda.quantize_queries_async(q32.cuda(), q8g, status)
    indexcp.cuda.throw_if_refused(status)
    assert torch.equal(q8g.cpu(), q8c)


def test_device_refusals_by_name():
    gt, gv = caches()
    status = torch.zeros(indexcp.STATUS_BYTES, dtype=torch.uint8, device="cuda")
    before = gt.clone()
    with pytest.raises(indexcp.InvalidArgumentError, match="keys"):
        indexcp.cuda.insert_keys_async(gv, 0, torch.randn(3, 128), torch.arange(3).cuda(), status)
    with pytest.raises(indexcp.InvalidArgumentError, match="cache"):
        ct, cv = caches(device="cpu")
        indexcp.cuda.insert_keys_async(cv, 0, torch.randn(3, 128).cuda(), torch.arange(3).cuda(), status)
    assert torch.equal(gt, before)


def resolved(W, sharding):
    cfg = '{"indexer_kv_dtype": "nvfp4", "indexer_cache_sharding": "%s"}' % ("on" if sharding else "off")
    return indexcp.resolve_config(indexcp.AttentionConfig.from_json(cfg),
                                  indexcp.EngineParams(tp=W, heads=H, query_len=Q))


def limits(bt):
    return indexcp.DecodeLimits(max_requests=bt.shape[0], max_pages=bt.shape[1], query_len=Q, heads=H,
                                sel=indexcp.SelectionParams(topk=K))


def run_cpu_icp_plan(comm):
    """Rank 1's CPU ICP decode plan run with `comm` (the CPU plans take host communicators only)."""
    rc = indexcp.resolve_config(
        indexcp.AttentionConfig.from_json('{"indexer_kv_dtype": "nvfp4", "indexer_cache_sharding": "on"}'),
        indexcp.EngineParams(tp=2, heads=H, query_len=Q))
    _, _, _, bt, seq = batch()
    p = indexcp.DecodePlan(rc, 1, limits(bt))
    t, v = caches(W=2, rank=1, device="cpu")
    q8 = torch.zeros(bt.shape[0] * Q, H, 128, dtype=torch.uint8)
    out = torch.zeros(bt.shape[0] * Q, p.num_heads, K, dtype=torch.int32)
    ws = torch.zeros(max(p.workspace_bytes, 16), dtype=torch.uint8)
    p.run(v, 1, q8, bt, seq, ws, out, comm)


def test_cuda_plan_equals_the_cpu_plan_and_icp_equals_replicated():
    keys, slots, q32, bt, seq = batch()
    q8 = torch.zeros(q32.shape, dtype=torch.uint8)
    indexcp.quantize_queries(q32, q8)
    rows = bt.shape[0] * Q
    # CPU replicated
    ct, cv = caches(device="cpu")
    indexcp.insert_keys(cv, 1, keys, slots)
    cplan = indexcp.DecodePlan(resolved(1, False), 0, limits(bt))
    cout = torch.zeros(rows, H, K, dtype=torch.int32)
    cplan.run(cv, 1, q8, bt, seq, torch.zeros(max(cplan.workspace_bytes, 16), dtype=torch.uint8), cout)
    # CUDA replicated
    gt, gv = caches()
    gt.copy_(ct)
    gplan = indexcp.cuda.DecodePlan(resolved(1, False), 0, limits(bt))
    gout = torch.zeros(rows, H, K, dtype=torch.int32, device="cuda")
    gws = torch.zeros(gplan.workspace_bytes, dtype=torch.uint8, device="cuda")
    gplan.run(gv, 1, q8.cuda(), bt.cuda(), seq.cuda(), gws, gout)
    torch.cuda.synchronize()
    assert torch.equal(gout.cpu(), cout)
    # CUDA ICP over two shards, split exchange
    W = 2
    plans, views, tensors = [], [], []
    for r in range(W):
        t, v = caches(W=W, rank=r)
        indexcp.cuda.insert_keys(v, 1, keys.cuda(), slots.cuda())
        plans.append(indexcp.cuda.DecodePlan(resolved(W, True), r, limits(bt)))
        views.append(v)
        tensors.append(t)
    eb = plans[0].exchange_bytes
    recv = torch.zeros(W * eb, dtype=torch.uint8, device="cuda")
    outs = []
    for r, p in enumerate(plans):
        ws = torch.zeros(p.workspace_bytes, dtype=torch.uint8, device="cuda")
        p.publish(views[r], 1, q8.cuda(), bt.cuda(), seq.cuda(), ws, recv[r * eb:(r + 1) * eb])
    for p in plans:
        o = torch.zeros(rows, p.num_heads, K, dtype=torch.int32, device="cuda")
        st = torch.zeros(1, dtype=torch.int32, device="cuda")
        p.merge(q8.cuda(), bt.cuda(), seq.cuda(), recv, o, st)
        outs.append(o)
        torch.cuda.synchronize()
        assert int(st.item()) == 0
    assert torch.equal(torch.cat(outs, dim=1), gout)
    # the same plans' run with the built-in exchange through Python DeviceCommunicators, one thread
    # and one stream per rank
    ex = ThreadExchange(W)
    runs = [None] * W

    def rank(r):
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            p = plans[r]
            ws = torch.zeros(p.workspace_bytes, dtype=torch.uint8, device="cuda")
            o = torch.full((rows, p.num_heads, K), -7, dtype=torch.int32, device="cuda")
            st = torch.full((1,), 5, dtype=torch.int32, device="cuda")
            p.run(views[r], 1, q8.cuda(), bt.cuda(), seq.cuda(), ws, o, ex.comms[r], st, stream=s.cuda_stream)
        s.synchronize()
        assert int(st.item()) == 0
        runs[r] = o

    run_rank_threads(W, rank, ex, timeout=300)
    assert torch.equal(torch.cat(runs, dim=1), gout)
    assert ex.comms[0].calls and ex.comms[0].bytes_sent == sum(n for _, n in ex.comms[0].calls)
    assert [n for _, n in ex.comms[0].calls] == [n for _, n in ex.comms[1].calls]


def test_torch_device_communicator_on_a_one_rank_nccl_group(tmp_path):
    """TorchDeviceCommunicator over a one-rank NCCL group: the all-gather lands in recv, ordered
    with the given stream, eagerly and captured in a CUDA graph replayed with new contents. Two
    ranks across processes need two GPUs and are not tested here (nor is a captured plan run
    through NCCL)."""
    import torch.distributed as dist

    import indexcp.distributed

    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1,
                            device_id=torch.device("cuda", torch.cuda.current_device()))
    try:
        comm = indexcp.distributed.TorchDeviceCommunicator()
        assert (comm.rank, comm.world) == (0, 1)
        s = torch.cuda.Stream()
        send = torch.arange(1, 65, dtype=torch.uint8, device="cuda")
        recv = torch.zeros(64, dtype=torch.uint8, device="cuda")
        s.wait_stream(torch.cuda.current_stream())  # send / recv were written on the current stream
        comm.call_all_gather(send, recv, stream=s.cuda_stream)
        s.synchronize()
        assert torch.equal(recv, send) and comm.bytes_sent == 64
        g = torch.cuda.CUDAGraph()
        recv.zero_()
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            comm.call_all_gather(send, recv, stream=torch.cuda.current_stream().cuda_stream)
        send.copy_(torch.arange(101, 165, dtype=torch.uint8, device="cuda"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(recv, send)
    finally:
        dist.destroy_process_group()


def test_cuda_graph_of_insert_qcast_decode_replays_with_new_inputs():
    keys, slots, q32, bt, seq = batch(1)
    gt, gv = caches()
    indexcp.cuda.prepare_device()
    plan = indexcp.cuda.DecodePlan(resolved(1, False), 0, limits(bt))
    n = 256
    s_keys = torch.zeros(n, 128, device="cuda")
    s_slots = torch.full((n,), -1, dtype=torch.int64, device="cuda")
    s_q32 = torch.zeros(q32.shape, device="cuda")
    s_q8 = torch.zeros(q32.shape, dtype=torch.uint8, device="cuda")
    s_bt, s_seq = bt.cuda(), seq.cuda()
    out = torch.zeros(bt.shape[0] * Q, H, K, dtype=torch.int32, device="cuda")
    ws = torch.zeros(plan.workspace_bytes, dtype=torch.uint8, device="cuda")
    iws = torch.zeros(indexcp.cuda.insert_workspace_bytes(n), dtype=torch.uint8, device="cuda")
    status = torch.zeros(indexcp.STATUS_BYTES, dtype=torch.uint8, device="cuda")
    # fill the cache eagerly with everything but the last n tokens
    indexcp.cuda.insert_keys(gv, 1, keys[:-n].cuda(), slots[:-n].cuda())

    def body():
        indexcp.cuda.insert_keys_async(gv, 1, s_keys, s_slots, status, iws)
        indexcp.cuda.quantize_queries_async(s_q32, s_q8, status)
        plan.run(gv, 1, s_q8, s_bt, s_seq, ws, out)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        body()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    s_keys.copy_(keys[-n:])
    s_slots.copy_(slots[-n:])
    s_q32.copy_(q32)
    graph.replay()
    torch.cuda.synchronize()
    indexcp.cuda.throw_if_refused(status)
    # the same step eagerly on the CPU backend
    ct, cv = caches(device="cpu")
    indexcp.insert_keys(cv, 1, keys, slots)
    assert torch.equal(gt.cpu(), ct)
    q8 = torch.zeros(q32.shape, dtype=torch.uint8)
    indexcp.quantize_queries(q32, q8)
    assert torch.equal(s_q8.cpu(), q8)
    cplan = indexcp.DecodePlan(resolved(1, False), 0, limits(bt))
    cout = torch.zeros(out.shape, dtype=torch.int32)
    cplan.run(cv, 1, q8, bt, seq, torch.zeros(max(cplan.workspace_bytes, 16), dtype=torch.uint8), cout)
    assert torch.equal(out.cpu(), cout)


def test_torch_ops_on_cuda_eager_compiled_and_graph():
    keys, slots, q32, bt, seq = batch(2)
    gt, gv = caches()
    handle = indexcp.ops.cache_handle(gv)
    plan_h = indexcp.ops.decode_plan(resolved(1, False), 0, limits(bt), device="cuda")
    plan = indexcp.ops.plan(plan_h)
    d = dict(device="cuda")
    keys, slots, q32, bt, seq = keys.cuda(), slots.cuda(), q32.cuda(), bt.cuda(), seq.cuda()
    ws = torch.zeros(plan.workspace_bytes, dtype=torch.uint8, **d)
    iws = torch.zeros(indexcp.cuda.insert_workspace_bytes(keys.shape[0]), dtype=torch.uint8, **d)

    def step(cache, keys, slots, q32, bt, seq, q8, out, st):
        torch.ops.indexcp.insert_keys_(cache, keys, slots, st, iws, handle, 1, 1.0)
        torch.ops.indexcp.quantize_queries_(q32, q8, st)
        torch.ops.indexcp.decode_run_(plan_h, handle, cache, 1, q8, bt, seq, ws, out, None)

    results = []
    for mode in ("eager", "compiled", "graph"):
        gt.zero_()
        q8 = torch.zeros(q32.shape, dtype=torch.uint8, **d)
        out = torch.zeros(bt.shape[0] * Q, H, K, dtype=torch.int32, **d)
        st = torch.zeros(indexcp.STATUS_BYTES, dtype=torch.uint8, **d)
        args = (gt, keys, slots, q32, bt, seq, q8, out, st)
        if mode == "eager":
            step(*args)
        elif mode == "compiled":
            torch.compile(step, fullgraph=True)(*args)
        else:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                step(*args)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                step(*args)
            # what the warm-up and the capture wrote is cleared: only the replay can fill them
            gt.zero_()
            q8.fill_(0x55)
            out.fill_(-9)
            g.replay()
        torch.cuda.synchronize()
        indexcp.cuda.throw_if_refused(st)
        results.append((gt.clone(), out.clone(), q8.clone()))
    for r in results[1:]:
        for a, b in zip(results[0], r):
            assert torch.equal(a, b)


def test_cuda_plans_refuse_a_host_communicator():
    """InProcessGroup's all_gather is a host memcpy: a CUDA plan must not hand it device pointers."""
    keys, slots, q32, bt, seq = batch()
    q8 = torch.zeros(q32.shape, dtype=torch.uint8)
    indexcp.quantize_queries(q32, q8)
    t, v = caches(W=2, rank=0)
    p = indexcp.cuda.DecodePlan(resolved(2, True), 0, limits(bt))
    ws = torch.zeros(p.workspace_bytes, dtype=torch.uint8, device="cuda")
    out = torch.zeros(bt.shape[0] * Q, p.num_heads, K, dtype=torch.int32, device="cuda")
    group = indexcp.InProcessGroup(2)
    with pytest.raises(indexcp.InvalidArgumentError, match="comm"):
        p.run(v, 1, q8.cuda(), bt.cuda(), seq.cuda(), ws, out, group.comm(0))


class ThreadExchange:
    """W ranks on threads of one process and one GPU, each on its own stream, exchanging through
    Python DeviceCommunicator subclasses (what TorchDeviceCommunicator does through NCCL, here with
    torch copies): every rank's send is read after the event its stream recorded, and a rank's
    stream waits until every rank's copies of its send are done before it goes on. Each call records
    the stream it was given and the bytes, for the test's checks."""

    def __init__(self, W):
        import threading

        self.W, self.barrier = W, threading.Barrier(W)
        self.sends, self.done = [None] * W, [None] * W
        self.comms = [self._comm(r) for r in range(W)]

    def abort(self):
        self.barrier.abort()

    def _comm(self, r):
        ex = self

        class Comm(indexcp.cuda.DeviceCommunicator):
            def __init__(self):
                indexcp.cuda.DeviceCommunicator.__init__(self, r, ex.W)
                self.calls = []

            def all_gather(self, send, recv, stream):
                s = torch.cuda.ExternalStream(stream)
                send_t, recv_t = torch.from_dlpack(send), torch.from_dlpack(recv)
                assert send_t.is_cuda and recv_t.numel() == ex.W * send_t.numel()
                self.calls.append((stream, send_t.numel()))
                ready = torch.cuda.Event()
                ready.record(s)
                ex.sends[r] = (send_t, ready)
                ex.barrier.wait()
                n = send_t.numel()
                with torch.cuda.stream(s):
                    for p, (src, ev) in enumerate(ex.sends):
                        s.wait_event(ev)
                        recv_t[p * n:(p + 1) * n].copy_(src)
                done = torch.cuda.Event()
                done.record(s)
                ex.done[r] = done
                ex.barrier.wait()
                for ev in ex.done:
                    s.wait_event(ev)
                ex.barrier.wait()

            def all_to_all(self, send, recv, stream):
                raise NotImplementedError("not used by these plans")

        return Comm()


def test_device_communicator_is_checked_and_refused_by_the_cpu_plans():
    with pytest.raises(indexcp.InvalidArgumentError, match="rank"):
        indexcp.cuda.DeviceCommunicator(2, 2)
    with pytest.raises(indexcp.InvalidArgumentError, match="world"):
        indexcp.cuda.DeviceCommunicator(0, 0)
    ex = ThreadExchange(1)
    c = ex.comms[0]
    assert (c.rank, c.world, c.bytes_sent) == (0, 1, 0)
    send = torch.arange(1, 41, dtype=torch.uint8, device="cuda")
    recv = torch.zeros(40, dtype=torch.uint8, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())  # send / recv were written on the current stream
    c.call_all_gather(send, recv, stream=s.cuda_stream)
    s.synchronize()
    assert torch.equal(recv, send) and c.bytes_sent == 40 and c.calls == [(s.cuda_stream, 40)]
    with pytest.raises(indexcp.InvalidArgumentError, match="recv"):
        c.call_all_gather(send, recv[:10])
    with pytest.raises(indexcp.InvalidArgumentError, match="comm: a device communicator"):
        run_cpu_icp_plan(ThreadExchange(2).comms[1])


def test_torch_device_communicator_refuses_a_gloo_group(tmp_path):
    import torch.distributed as dist

    import indexcp.distributed

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        with pytest.raises(indexcp.InvalidArgumentError, match="NCCL"):
            indexcp.distributed.TorchDeviceCommunicator()
    finally:
        dist.destroy_process_group()


def test_device_communicator_exception_ends_the_run():
    """A Python exception in the collective ends the CUDA plan's run with that exception."""

    class Broken(indexcp.cuda.DeviceCommunicator):
        def all_gather(self, send, recv, stream):
            raise RuntimeError("exchange broke")

        def all_to_all(self, send, recv, stream):
            raise RuntimeError("exchange broke")

    keys, slots, q32, bt, seq = batch()
    q8 = torch.zeros(q32.shape, dtype=torch.uint8)
    indexcp.quantize_queries(q32, q8)
    t, v = caches(W=2, rank=0)
    p = indexcp.cuda.DecodePlan(resolved(2, True), 0, limits(bt))
    ws = torch.zeros(p.workspace_bytes, dtype=torch.uint8, device="cuda")
    out = torch.zeros(bt.shape[0] * Q, p.num_heads, K, dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match="exchange broke"):
        p.run(v, 1, q8.cuda(), bt.cuda(), seq.cuda(), ws, out, Broken(0, 2))
    torch.cuda.synchronize()


@pytest.mark.parametrize("prefill_cp", ["gather", "local_score"])
def test_cuda_sharded_prefill_through_a_device_group_equals_the_cpu_replicated(prefill_cp):
    """Item 1 of issue 24 on the GPU: two ranks on two threads, each with its own stream, its cache
    shard and a DeviceGroup communicator, run the CUDA PrefillPlan (the binding, then the torch
    op with a comm handle); the union of their owned heads equals the CPU replicated prefill bit for
    bit (exact keys and integer queries: every score is exact on both backends)."""
    W = 2
    keys, slots, _, bt, seq = batch(seed=4, requests=2)
    query_start = torch.tensor([0, 100, 137], dtype=torch.int32)
    rows = 137
    g = torch.Generator().manual_seed(8)
    q32 = torch.randint(-8, 9, (rows, H, 128), generator=g).to(torch.float32)
    q8 = torch.zeros(rows, H, 128, dtype=torch.uint8)
    indexcp.quantize_queries(q32, q8)
    sel = indexcp.SelectionParams(topk=K)
    _, cv = caches(device="cpu")
    indexcp.insert_keys(cv, 1, keys, slots)
    rep = np.zeros((rows, H, K), np.int32)
    indexcp.prefill_select(cv, 1, q8, bt, seq, query_start, 0, H, sel, rep)
    assert (rep >= 0).sum() > rows * H
    rc = indexcp.resolve_config(
        indexcp.AttentionConfig.from_json('{"indexer_kv_dtype": "nvfp4", "indexer_cache_sharding": "on", '
                                          '"indexer_prefill_cp": "%s"}' % prefill_cp),
        indexcp.EngineParams(tp=W, heads=H, query_len=1))
    lim = indexcp.PrefillLimits(max_requests=2, max_pages=bt.shape[1], max_rows=rows, heads=H, sel=sel)
    ext = indexcp.prefill_extents(bt, seq, query_start, P)
    dq8, dbt, dseq, dqs = q8.cuda(), bt.cuda(), seq.cuda(), query_start.cuda()
    shards = []
    for r in range(W):
        t, v = caches(W=W, rank=r)
        indexcp.cuda.insert_keys(v, 1, keys.cuda(), slots.cuda())
        ph = indexcp.ops.prefill_plan(rc, r, lim, device="cuda")
        plan = indexcp.ops.plan(ph)
        assert isinstance(plan, indexcp.cuda.PrefillPlan) and plan.path == getattr(indexcp.PrefillPath, prefill_cp)
        shards.append((t, v, plan, indexcp.ops.cache_handle(v), ph))
    torch.cuda.synchronize()
    # the communicators: a DeviceGroup's, and Python DeviceCommunicators (ThreadExchange)
    for kind, use_op in (("group", False), ("group", True), ("python", False), ("python", True)):
        group = indexcp.cuda.DeviceGroup(W) if kind == "group" else ThreadExchange(W)
        got = torch.full((rows, H, K), -7, dtype=torch.int32)
        streams = [torch.cuda.Stream() for _ in range(W)]

        def rank(r):
            t, v, plan, h, ph = shards[r]
            s = streams[r]
            comm = group.comm(r) if kind == "group" else group.comms[r]
            with torch.cuda.stream(s):
                ws = torch.zeros(plan.workspace_bytes, dtype=torch.uint8, device="cuda")
                out = torch.full((rows, plan.num_heads, K), -7, dtype=torch.int32, device="cuda")
                st = torch.full((1,), 5, dtype=torch.int32, device="cuda")
                if use_op:
                    ch = indexcp.ops.comm_handle(comm)
                    torch.ops.indexcp.prefill_run_(ph, h, t, 1, dq8, dbt, dseq, dqs, ext.rows,
                                                   ext.max_rows_per_request, ext.gather_units, ws, out, st, ch)
                else:
                    plan.run(v, 1, dq8, dbt, dseq, dqs, ext, ws, out, comm, st, stream=s.cuda_stream)
            s.synchronize()
            assert int(st.item()) == 0
            got[:, plan.head_begin:plan.head_begin + plan.num_heads] = out.cpu()
            if use_op:
                indexcp.ops.release(ch)

        run_rank_threads(W, rank, group, timeout=300)
        np.testing.assert_array_equal(got.numpy(), rep, err_msg=f"{kind} use_op={use_op}")
        if kind == "python":  # every collective ran on the rank's own stream, with equal sizes
            calls = [c.calls for c in group.comms]
            assert calls[0] and all(len(c) == len(calls[0]) for c in calls)
            for r in range(W):
                assert {st for st, _ in calls[r]} == {streams[r].cuda_stream}
                assert [n for _, n in calls[r]] == [n for _, n in calls[0]]
            assert group.comms[0].bytes_sent == sum(n for _, n in calls[0])
    for _, _, _, h, ph in shards:
        indexcp.ops.release(h)
        indexcp.ops.release(ph)


def test_device_group_comms_are_refused_by_the_cpu_plans_and_checked():
    with pytest.raises(indexcp.InvalidArgumentError, match="world"):
        indexcp.cuda.DeviceGroup(0)
    group = indexcp.cuda.DeviceGroup(2)
    with pytest.raises(indexcp.InvalidArgumentError, match="rank"):
        group.comm(2)
    c = group.comm(1)
    assert (c.rank, c.world) == (1, 2)
    with pytest.raises(indexcp.InvalidArgumentError, match="comm"):
        run_cpu_icp_plan(c)


@pytest.mark.parametrize("norm,rope", [(True, False), (True, True)])
def test_preprocess_ops_on_cuda_equal_the_cpu_ops(norm, rope):
    """Item 2 on the GPU: insert_keys_ / quantize_queries_ with RMSNorm / RoPE on CUDA tensors
    (eager and compiled) write the bytes the CPU ops write (the CPU ops equal spec_ref, test_torch)."""
    g = torch.Generator().manual_seed(6)
    n, theta, eps = 64, 1e4, 1e-6
    keys = torch.randn(n, 128, generator=g) * 3
    q = torch.randn(n, H, 128, generator=g) * 3
    w = torch.randn(128, generator=g) * 0.2 if norm else None
    pos = torch.randint(0, 500, (n,), generator=g, dtype=torch.int64) if rope else None
    ctab = gtab = None
    if rope:
        ctab = torch.zeros(500, 64)
        indexcp.fill_rope_table(ctab, theta)
        gtab = torch.zeros(500, 64, device="cuda")
        indexcp.cuda.fill_rope_table(gtab, theta)
        assert torch.equal(gtab.cpu(), ctab)
    slots = torch.randperm(40 * P, generator=g)[:n].to(torch.int64)

    def fn(handle):
        def step(cache, keys, slots, st_k, ws, q, q8, st_q, w, pos, table):
            torch.ops.indexcp.insert_keys_(cache, keys, slots, st_k, ws, handle, 1, 1.0, w, eps, rope, theta, pos,
                                           table)
            torch.ops.indexcp.quantize_queries_(q, q8, st_q, w, eps, rope, theta, pos, table)
        return step

    ct, cv = caches(device="cpu")
    ch = indexcp.ops.cache_handle(cv)
    cst_k = torch.zeros(indexcp.STATUS_BYTES, dtype=torch.uint8)
    cst_q = torch.zeros(indexcp.STATUS_BYTES, dtype=torch.uint8)
    cq8 = torch.zeros(n, H, 128, dtype=torch.uint8)
    fn(ch)(ct, keys, slots, cst_k, None, q, cq8, cst_q, w, pos, ctab)
    indexcp.throw_if_refused(cst_k.numpy())
    assert ct.any() and cq8.any()
    gt, gv = caches()
    gh = indexcp.ops.cache_handle(gv)
    d = dict(device="cuda")
    cu = (lambda x: None if x is None else x.cuda())
    for f in (fn(gh), torch.compile(fn(gh), fullgraph=True)):
        gt.zero_()
        st_k = torch.zeros(indexcp.STATUS_BYTES, dtype=torch.uint8, **d)
        st_q = torch.zeros(indexcp.STATUS_BYTES, dtype=torch.uint8, **d)
        ws = torch.zeros(max(indexcp.cuda.insert_workspace_bytes(n), 16), dtype=torch.uint8, **d)
        q8 = torch.zeros(n, H, 128, dtype=torch.uint8, **d)
        f(gt, keys.cuda(), slots.cuda(), st_k, ws, q.cuda(), q8, st_q, cu(w), cu(pos), gtab)
        torch.cuda.synchronize()
        indexcp.cuda.throw_if_refused(st_k)
        indexcp.cuda.throw_if_refused(st_q)
        assert torch.equal(gt.cpu(), ct)
        assert torch.equal(q8.cpu(), cq8)
    indexcp.ops.release(ch)
    indexcp.ops.release(gh)
