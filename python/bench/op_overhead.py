"""Per-call host overhead of the package's calls and of the torch ops, for one small decode step
(insert one token per request, Q cast, decode plan run): the binding call (nanobind -> C++), the
torch.ops.indexcp op (dispatcher + the op's Python body + the binding), and on CUDA the step
replayed from a CUDA graph. Prints one JSON object (microseconds per call, median of --repeats
runs of --iters calls each): per call "stream" = (the calls back to back, then a synchronize) /
iters, and "host" = the same loop's time before the synchronize / iters, the time the host spends
in the call. bench/cuda/call_overhead.cpp (build/bench/bench_call_overhead) times the matching
C++ calls with the same shapes and method: the package's overhead is the difference.

    python python/bench/op_overhead.py --device cpu
    python python/bench/op_overhead.py --device cuda --out bench/results/python_op_overhead_h200.json
"""

import argparse
import json
import statistics
import time

import torch

import indexcp
import indexcp.ops  # noqa: F401


def timed(fn, iters, repeats, sync):
    fn()
    sync()
    stream, host = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        t1 = time.perf_counter()
        sync()
        t2 = time.perf_counter()
        host.append((t1 - t0) / iters * 1e6)
        stream.append((t2 - t0) / iters * 1e6)
    return {"stream": round(statistics.median(stream), 2), "host": round(statistics.median(host), 2)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--out")
    a = ap.parse_args()
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    be = indexcp.cuda if cuda else indexcp
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    H, Q, P, R = 4, 1, 128, a.requests
    pages_per_req = -(-a.seq_len // P)
    pages = R * pages_per_req
    layout = indexcp.make_page_layout(indexcp.KvDtype.nvfp4, P, 1)
    cache = torch.zeros(indexcp.view_bytes(layout, pages, 1), dtype=torch.uint8, device=dev)
    view = indexcp.make_cache_view(layout, cache, pages, 1)
    handle = indexcp.ops.cache_handle(view)
    if cuda:
        indexcp.cuda.prepare_device()
    rc = indexcp.resolve_config(indexcp.AttentionConfig.from_json('{"indexer_kv_dtype": "nvfp4"}'),
                                indexcp.EngineParams(tp=1, heads=H, query_len=Q))
    lim = indexcp.DecodeLimits(max_requests=R, max_pages=pages_per_req, query_len=Q, heads=H)
    ph = indexcp.ops.decode_plan(rc, 0, lim, device=a.device)
    plan = indexcp.ops.plan(ph)
    keys = torch.randn(R, 128, device=dev)
    slots = (torch.arange(R, device=dev) * pages_per_req * P + a.seq_len - 1).to(torch.int64)
    status = torch.zeros(indexcp.STATUS_BYTES, dtype=torch.uint8, device=dev)
    iws = torch.zeros(max(be.insert_workspace_bytes(R), 16), dtype=torch.uint8, device=dev)
    q32 = torch.randn(R * Q, H, 128, device=dev)
    q8 = torch.zeros(R * Q, H, 128, dtype=torch.uint8, device=dev)
    bt = torch.arange(pages, dtype=torch.int32, device=dev).view(R, pages_per_req)
    seq = torch.full((R,), a.seq_len, dtype=torch.int32, device=dev)
    ws = torch.zeros(max(plan.workspace_bytes, 16), dtype=torch.uint8, device=dev)
    out = torch.zeros(R * Q, plan.num_heads, 16, dtype=torch.int32, device=dev)
    ops = torch.ops.indexcp

    def b_insert():
        be.insert_keys_async(view, 0, keys, slots, status, iws)

    def b_qcast():
        be.quantize_queries_async(q32, q8, status)

    def b_run():
        plan.run(view, 0, q8, bt, seq, ws, out)

    def o_insert():
        ops.insert_keys_(cache, keys, slots, status, iws, handle, 0, 1.0)

    def o_qcast():
        ops.quantize_queries_(q32, q8, status)

    def o_run():
        ops.decode_run_(ph, handle, cache, 0, q8, bt, seq, ws, out, None)

    res = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
           "indexcp": indexcp.__version__, "requests": R, "seq_len": a.seq_len, "heads": H,
           "unit": "microseconds per call (host wall time, median)"}
    for name, fn in [("binding.insert_keys_async", b_insert), ("binding.quantize_queries_async", b_qcast),
                     ("binding.DecodePlan.run", b_run), ("op.insert_keys_", o_insert),
                     ("op.quantize_queries_", o_qcast), ("op.decode_run_", o_run)]:
        res[name] = timed(fn, a.iters, a.repeats, sync)

    def step():
        o_insert()
        o_qcast()
        o_run()

    res["eager step (3 ops)"] = timed(step, a.iters, a.repeats, sync)
    if cuda:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            step()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        res["graph replay of the step (3 ops)"] = timed(g.replay, a.iters, a.repeats, sync)
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        open(a.out, "w").write(text + "\n")


if __name__ == "__main__":
    main()
