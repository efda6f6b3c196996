"""A MiniMax-M3-style sparse attention layer in PyTorch over indexcp (issue 24, part 4; a first,
CPU-sized form): seeded random projections give the index K / index Q and the attention Q, K, V
from hidden states; the index keys go into an indexcp cache held as torch uint8 tensors (one
replicated cache, or W rank shards); the indexer runs through torch.ops.indexcp (decode_run_ for
the replicated cache, decode_publish_ / all-gather / decode_merge_ for the shards, W ranks
simulated in one process); block-sparse attention over the K selected 128-token blocks of each
index head runs in plain PyTorch over a paged bf16 KV cache that shares the block table.

The decode step is also written without host synchronization (attend_dense: the selected blocks
gathered from the paged cache with tensor indexing, masked softmax), so that one whole step
(insert, Q cast, indexer ops, attention) is captured with torch.cuda.graph and replayed with each
step's hidden states, slots, block table and seq_lens copied into the captured input tensors
(decode_loop(..., graph=True), CUDA only; compared with the eager step: the selections bit for
bit, the outputs to fp32 rounding). And
real_data_recall() feeds the embedded real data's index keys and queries (data/minilm_stdlib)
through the layer's indexer path (insert_keys_, quantize_queries_, the decode ops over W = 2
shards or the replicated cache, Q = 8) and reports the recall against fp32 keys.

    python examples/python/sparse_layer.py            # sharding off vs on: identical selections and outputs
    python examples/python/sparse_layer.py --device cuda --graph   # also graph replay == eager
    python examples/python/sparse_layer.py --real-data              # recall of the layer's indexer
"""

import argparse
import os

import torch

import indexcp
import indexcp.ops  # noqa: F401


class SparseLayer:
    def __init__(self, hidden=256, q_heads=8, kv_heads=2, head_dim=64, index_heads=4, topk=16, page_size=128,
                 num_pages=64, max_requests=2, query_len=8, tp=2, sharding=True, seed=0, device="cpu",
                 max_tokens=4096):
        g = torch.Generator().manual_seed(seed)
        d = torch.device(device)
        self.H, self.Qh, self.KVh, self.D, self.K, self.P = index_heads, q_heads, kv_heads, head_dim, topk, page_size
        self.Q, self.R, self.W, self.device = query_len, max_requests, tp, d

        def proj(n):
            return (torch.randn(hidden, n, generator=g) / hidden ** 0.5).to(d)

        self.w_ik, self.w_iq = proj(128), proj(index_heads * 128)
        self.w_q, self.w_k, self.w_v = proj(q_heads * head_dim), proj(kv_heads * head_dim), proj(kv_heads * head_dim)
        self.w_o = (torch.randn(q_heads * head_dim, hidden, generator=g) / (q_heads * head_dim) ** 0.5).to(d)
        text = '{"indexer_kv_dtype": "nvfp4", "indexer_cache_sharding": "%s"}' % ("on" if sharding else "off")
        self.config = indexcp.resolve_config(indexcp.AttentionConfig.from_json(text),
                                             indexcp.EngineParams(tp=tp, page_size=page_size, heads=index_heads,
                                                                  query_len=query_len))
        self.max_pages = num_pages // max_requests
        lim = indexcp.DecodeLimits(max_requests=max_requests, max_pages=self.max_pages, query_len=query_len,
                                   heads=index_heads, sel=indexcp.SelectionParams(topk=topk))
        # the index cache: W shards (sharding) or one replicated cache that every rank reads
        layout = indexcp.make_page_layout(indexcp.KvDtype.nvfp4, page_size, self.config.shards)
        self.ranks = []
        for r in range(tp):
            owner = r if self.config.sharding else 0
            if len(self.ranks) <= owner:
                t = torch.zeros(indexcp.view_bytes(layout, num_pages), dtype=torch.uint8, device=d)
                view = indexcp.make_cache_view(layout, t, num_pages, 1, owner)
                shard = (t, indexcp.ops.cache_handle(view))
            else:
                shard = self.ranks[owner][:2]
            ph = indexcp.ops.decode_plan(self.config, r, lim, device=device)
            p = indexcp.ops.plan(ph)
            ws = torch.zeros(max(p.workspace_bytes, 16), dtype=torch.uint8, device=d)
            self.ranks.append((shard[0], shard[1], ph, p, ws))
        self.eb = self.ranks[0][3].exchange_bytes
        self.recv = torch.zeros(max(tp * self.eb, 16), dtype=torch.uint8, device=d)
        self.status = torch.zeros(indexcp.STATUS_BYTES, dtype=torch.uint8, device=d)
        backend = indexcp.cuda if d.type == "cuda" else indexcp
        self.iws = torch.zeros(max(backend.insert_workspace_bytes(max_tokens), 16), dtype=torch.uint8, device=d)
        self.k_cache = torch.zeros(num_pages, page_size, kv_heads, head_dim, dtype=torch.bfloat16, device=d)
        self.v_cache = torch.zeros_like(self.k_cache)

    def write_index_keys(self, ik, slots):
        """Index keys fp32 [n, 128] at slots int64 [n] into the index cache(s)."""
        for t, h, *_ in {id(r[0]): r for r in self.ranks}.values():
            torch.ops.indexcp.insert_keys_(t, ik, slots, self.status, self.iws, h, 0, 1.0)

    def write(self, hidden, slots):
        """Index keys into the index cache(s), K and V into the paged bf16 KV cache."""
        self.write_index_keys((hidden @ self.w_ik).contiguous(), slots)
        page, off = slots // self.P, slots % self.P
        self.k_cache[page, off] = (hidden @ self.w_k).view(-1, self.KVh, self.D).to(torch.bfloat16)
        self.v_cache[page, off] = (hidden @ self.w_v).view(-1, self.KVh, self.D).to(torch.bfloat16)

    def select(self, hidden, block_table, seq_lens):
        """The selected blocks of every row and index head: int32 [rows, H, K]."""
        rows = hidden.shape[0]
        return self.select_q((hidden @ self.w_iq).view(rows, self.H, 128).contiguous(), block_table, seq_lens)

    def select_q(self, iq, block_table, seq_lens):
        """The indexer on index queries fp32 [rows, H, 128]: int32 [rows, H, K]."""
        rows = iq.shape[0]
        q8 = torch.zeros(rows, self.H, 128, dtype=torch.uint8, device=self.device)
        torch.ops.indexcp.quantize_queries_(iq, q8, self.status)
        outs = []
        if self.eb == 0:  # replicated: every rank selects its owned heads
            for t, h, ph, p, ws in self.ranks:
                o = torch.zeros(rows, p.num_heads, self.K, dtype=torch.int32, device=self.device)
                torch.ops.indexcp.decode_run_(ph, h, t, 0, q8, block_table, seq_lens, ws, o, None)
                outs.append(o)
        else:  # ICP: publish, the all-gather (here a copy into each rank's slot), merge
            for r, (t, h, ph, p, ws) in enumerate(self.ranks):
                torch.ops.indexcp.decode_publish_(ph, h, t, 0, q8, block_table, seq_lens, ws,
                                                  self.recv[r * self.eb:(r + 1) * self.eb])
            for t, h, ph, p, ws in self.ranks:
                o = torch.zeros(rows, p.num_heads, self.K, dtype=torch.int32, device=self.device)
                torch.ops.indexcp.decode_merge_(ph, q8, block_table, seq_lens, self.recv, o, None)
                outs.append(o)
        heads = {}
        for (_, _, _, p, _), o in zip(self.ranks, outs):
            for j in range(p.num_heads):
                heads.setdefault(p.head_begin + j, o[:, j])
        return torch.stack([heads[h] for h in range(self.H)], dim=1)

    def attend(self, hidden, sel, block_table, seq_lens):
        """Block-sparse attention: q head a reads the blocks of index head a * H / q_heads, causal."""
        rows = hidden.shape[0]
        q = (hidden @ self.w_q).view(rows, self.Qh, self.D)
        out = torch.zeros(rows, self.Qh, self.D, device=self.device)
        for row in range(rows):
            b = row // self.Q
            pos = int(seq_lens[b]) - self.Q + row % self.Q
            if int(seq_lens[b]) == 0:
                continue
            for a in range(self.Qh):
                blocks = sel[row, a * self.H // self.Qh]
                blocks = blocks[blocks >= 0].tolist()
                p = torch.cat([torch.arange(x * 128, min(x * 128 + 128, pos + 1)) for x in blocks]).to(self.device)
                page = block_table[b, p // self.P].long()
                kv = a * self.KVh // self.Qh
                k = self.k_cache[page, p % self.P, kv].float()
                v = self.v_cache[page, p % self.P, kv].float()
                w = torch.softmax(k @ q[row, a] / self.D ** 0.5, dim=0)
                out[row, a] = w @ v
        return out.view(rows, -1) @ self.w_o

    def attend_dense(self, hidden, sel, block_table, seq_lens):
        """attend() without host synchronization (capturable): every selected block's 128 tokens
        gathered from the paged cache, tokens after the row's position and -1 slots masked, softmax
        over the rest; a padding row (seq_len 0) gives zeros. Equal to attend() up to the order of
        the sums (not bit for bit)."""
        rows, dev = hidden.shape[0], self.device
        q = (hidden @ self.w_q).view(rows, self.Qh, self.D)
        r = torch.arange(rows, device=dev)
        b = r // self.Q
        pos = seq_lens.long()[b] - self.Q + r % self.Q  # [rows]
        blocks = sel[:, torch.arange(self.Qh, device=dev) * self.H // self.Qh].long()  # [rows, Qh, K]
        tok = blocks[..., None] * 128 + torch.arange(128, device=dev)  # [rows, Qh, K, 128]
        valid = (blocks[..., None] >= 0) & (tok <= pos[:, None, None, None])
        tok = tok.clamp(0, block_table.shape[1] * self.P - 1)
        page = block_table.long()[b[:, None, None, None], tok // self.P]
        kvh = (torch.arange(self.Qh, device=dev) * self.KVh // self.Qh)[None, :, None, None]
        k = self.k_cache[page, tok % self.P, kvh].float()  # [rows, Qh, K, 128, D]
        v = self.v_cache[page, tok % self.P, kvh].float()
        logits = torch.einsum("rakpd,rad->rakp", k, q) / self.D ** 0.5
        logits = logits.masked_fill(~valid, float("-inf")).reshape(rows, self.Qh, -1)
        w = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # all masked (padding): zeros
        out = torch.einsum("rat,ratd->rad", w, v.reshape(rows, self.Qh, -1, self.D))
        return out.reshape(rows, -1) @ self.w_o

    def step(self, hidden, slots, block_table, seq_lens, dense=False):
        self.write(hidden, slots)
        sel = self.select(hidden, block_table, seq_lens)
        (indexcp.cuda if self.device.type == "cuda" else indexcp).throw_if_refused(self.status)
        return sel, (self.attend_dense if dense else self.attend)(hidden, sel, block_table, seq_lens)

    def graph_step(self, hidden, slots, block_table, seq_lens):
        """One decode step captured as a CUDA graph over the given (static) input tensors; returns
        (graph, sel, out): copy a new step's inputs into the same tensors, replay, read sel / out.
        CUDA only (indexcp.InvalidArgumentError otherwise)."""
        if self.device.type != "cuda" or not torch.cuda.is_available():
            raise indexcp.InvalidArgumentError("graph: CUDA graphs need the layer on a CUDA device (device='cuda')")
        indexcp.cuda.prepare_device()

        def body():
            self.write(hidden, slots)
            sel = self.select(hidden, block_table, seq_lens)
            return sel, self.attend_dense(hidden, sel, block_table, seq_lens)

        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm-up (writes this step's keys, as the replay will again)
            body()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            sel, out = body()
        return g, sel, out


def decode_loop(sharding, steps=3, prefix=(2500, 3100), seed=0, hidden=256, device="cpu", dense=False, graph=False,
                **kw):
    """A prefix written at once, then `steps` decode steps of Q = 8 speculative tokens per request;
    returns [(sel, out)] per step. dense: attend_dense instead of attend. graph (CUDA only): every
    step replays one captured graph of the whole step with its inputs copied into the captured
    tensors (attend_dense), and is checked against the eager step of a second layer made with the
    same seed: selections bit for bit, outputs to rtol 1e-5 (AssertionError otherwise)."""
    if graph and (torch.device(device).type != "cuda" or not torch.cuda.is_available()):
        raise indexcp.InvalidArgumentError("graph: CUDA graphs need device='cuda' and a GPU")
    kw.setdefault("max_tokens", max(sum(prefix), 4096))  # the prefix is one insert
    layer = SparseLayer(hidden=hidden, sharding=sharding, seed=seed, device=device, **kw)
    eager = SparseLayer(hidden=hidden, sharding=sharding, seed=seed, device=device, **kw) if graph else None
    d = torch.device(device)
    g = torch.Generator().manual_seed(seed + 1)
    R, Q, P = layer.R, layer.Q, layer.P
    block_table = torch.arange(R * layer.max_pages, dtype=torch.int32).view(R, layer.max_pages)
    lens = list(prefix)
    pre = torch.cat([block_table[b, torch.arange(n) // P].long() * P + torch.arange(n) % P
                     for b, n in enumerate(lens)])
    h0 = torch.randn(pre.numel(), hidden, generator=g).to(d)
    layer.write(h0, pre.to(d))
    if eager is not None:
        eager.write(h0, pre.to(d))
    block_table = block_table.to(d)
    results, captured = [], None
    for _ in range(steps):
        new = [torch.arange(n, n + Q) for n in lens]
        slots = torch.cat([block_table[b, p.to(d) // P].long() * P + p.to(d) % P for b, p in enumerate(new)])
        lens = [n + Q for n in lens]
        seq = torch.tensor(lens, dtype=torch.int32, device=d)
        hidden_t = torch.randn(R * Q, hidden, generator=g).to(d)
        if not graph:
            results.append(layer.step(hidden_t, slots, block_table, seq, dense=dense))
            continue
        if captured is None:  # the static inputs, then the capture (over this step's inputs)
            static = [hidden_t.clone(), slots.clone(), block_table.clone(), seq.clone()]
            captured = layer.graph_step(*static)
        for dst, src in zip(static, (hidden_t, slots, block_table, seq)):
            dst.copy_(src)
        g_, sel_g, out_g = captured
        g_.replay()
        torch.cuda.synchronize()
        indexcp.cuda.throw_if_refused(layer.status)
        sel_e, out_e = eager.step(hidden_t, slots, block_table, seq, dense=True)
        # the selections bit for bit; the attention outputs to fp32 rounding (cuBLAS may pick other
        # kernels inside a capture than eagerly)
        assert torch.equal(sel_g, sel_e), "graph replay selections != eager"
        assert torch.allclose(out_g, out_e, rtol=1e-5, atol=1e-6), "graph replay outputs != eager"
        results.append((sel_g.clone(), out_g.clone()))
    return results


DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "data", "minilm_stdlib")


def real_data_recall(sharding=True, data=DATA, steps=(33000, 33008, 33016, 33024), device="cpu", tp=2):
    """The embedded real data (4 requests x 33,024 tokens of index keys, queries at positions
    32768..33023; examples/python/real_data_recall.py) through the layer's indexer path: every key
    inserted with insert_keys_ into the layer's NVFP4 index cache(s) (W = tp shards, or replicated),
    then one decode step of Q = 8 queries per request ending at each seq_len of `steps`
    (quantize_queries_, decode_run_ or decode_publish_ / all-gather / decode_merge_). Returns
    (recall against float64 scores of the unquantized keys, as real_data_recall.py computes it,
    the selections int32 [len(steps) * 4 * 8, 4, 16])."""
    import sys

    import numpy as np
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import real_data_recall as rdr

    keys = np.load(os.path.join(data, "keys.npy"))  # float16 [R, T, 128]
    queries = np.load(os.path.join(data, "queries.npy"))  # float16 [R, 256, H, 128] at positions 32768..
    R, T, H = keys.shape[0], keys.shape[1], queries.shape[2]
    P, Q, K, first = 128, 8, rdr.K, 32768
    pages = -(-T // P)
    d = torch.device(device)
    layer = SparseLayer(index_heads=H, topk=K, page_size=P, num_pages=R * pages, max_requests=R, query_len=Q, tp=tp,
                        sharding=sharding, device=device, max_tokens=T)
    block_table = torch.arange(R * pages, dtype=torch.int32).view(R, pages)
    for r in range(R):
        slots = block_table[r, torch.arange(T) // P].long() * P + torch.arange(T) % P
        layer.write_index_keys(torch.from_numpy(keys[r].astype(np.float32)).to(d), slots.to(d))
    block_table = block_table.to(d)
    sels, refs = [], []
    for s in steps:
        iq = torch.from_numpy(queries[:, s - Q - first:s - first].astype(np.float32)).reshape(R * Q, H, 128)
        seq = torch.full((R,), s, dtype=torch.int32, device=d)
        sel = layer.select_q(iq.contiguous().to(d), block_table, seq)
        (indexcp.cuda if d.type == "cuda" else indexcp).throw_if_refused(layer.status)
        sels.append(sel.cpu().numpy())
        refs.append(np.concatenate([rdr.reference_select(keys[r], queries[r, s - Q - first:s - first], s - Q, K)
                                    for r in range(R)]))
    sel, ref = np.concatenate(sels), np.concatenate(refs)
    return rdr.recall(ref, sel), sel


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--graph", action="store_true", help="also replay the step as a CUDA graph (CUDA only)")
    ap.add_argument("--real-data", action="store_true", help="the recall of the layer's indexer on data/minilm_stdlib")
    a = ap.parse_args()
    if a.graph and (torch.device(a.device).type != "cuda" or not torch.cuda.is_available()):
        ap.error("--graph: CUDA graphs need --device cuda and a GPU")
    if a.real_data:
        for sharding in (False, True):
            rec, _ = real_data_recall(sharding, device=a.device)
            print(f"real data through the layer's indexer (sharding {'on' if sharding else 'off'}): recall vs fp32 "
                  f"keys {rec:.4f}")
    if a.graph:
        for sharding in (False, True):
            decode_loop(sharding, a.steps, device=a.device, graph=True)
            print(f"sharding {'on' if sharding else 'off'}: graph replay == eager in {a.steps} steps")
    off, on = decode_loop(False, a.steps, device=a.device), decode_loop(True, a.steps, device=a.device)
    for i, ((s0, o0), (s1, o1)) in enumerate(zip(off, on)):
        same = torch.equal(s0, s1) and torch.equal(o0, o1)
        print(f"step {i}: selections {tuple(s0.shape)}, outputs {tuple(o0.shape)}, sharding on == off: {same}")
        assert same


if __name__ == "__main__":
    main()
