"""A MiniMax-M3-style sparse attention layer in PyTorch over indexcp (issue 24, part 4; a first,
CPU-sized form): seeded random projections give the index K / index Q and the attention Q, K, V
from hidden states; the index keys go into an indexcp cache held as torch uint8 tensors (one
replicated cache, or W rank shards); the indexer runs through torch.ops.indexcp (decode_run_ for
the replicated cache, decode_publish_ / all-gather / decode_merge_ for the shards, W ranks
simulated in one process); block-sparse attention over the K selected 128-token blocks of each
index head runs in plain PyTorch over a paged bf16 KV cache that shares the block table.

    python examples/python/sparse_layer.py            # sharding off vs on: identical selections and outputs
"""

import argparse

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

    def write(self, hidden, slots):
        """Index keys into the index cache(s), K and V into the paged bf16 KV cache."""
        ik = (hidden @ self.w_ik).contiguous()
        for t, h, *_ in {id(r[0]): r for r in self.ranks}.values():
            torch.ops.indexcp.insert_keys_(t, ik, slots, self.status, self.iws, h, 0, 1.0)
        page, off = slots // self.P, slots % self.P
        self.k_cache[page, off] = (hidden @ self.w_k).view(-1, self.KVh, self.D).to(torch.bfloat16)
        self.v_cache[page, off] = (hidden @ self.w_v).view(-1, self.KVh, self.D).to(torch.bfloat16)

    def select(self, hidden, block_table, seq_lens):
        """The selected blocks of every row and index head: int32 [rows, H, K]."""
        rows = hidden.shape[0]
        q8 = torch.zeros(rows, self.H, 128, dtype=torch.uint8, device=self.device)
        torch.ops.indexcp.quantize_queries_((hidden @ self.w_iq).view(rows, self.H, 128).contiguous(), q8,
                                            self.status)
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

    def step(self, hidden, slots, block_table, seq_lens):
        self.write(hidden, slots)
        sel = self.select(hidden, block_table, seq_lens)
        (indexcp.cuda if self.device.type == "cuda" else indexcp).throw_if_refused(self.status)
        return sel, self.attend(hidden, sel, block_table, seq_lens)


def decode_loop(sharding, steps=3, prefix=(2500, 3100), seed=0, hidden=256, device="cpu", **kw):
    """A prefix written at once, then `steps` decode steps of Q = 8 speculative tokens per request."""
    kw.setdefault("max_tokens", max(sum(prefix), 4096))  # the prefix is one insert
    layer = SparseLayer(hidden=hidden, sharding=sharding, seed=seed, device=device, **kw)
    d = torch.device(device)
    g = torch.Generator().manual_seed(seed + 1)
    R, Q, P = layer.R, layer.Q, layer.P
    block_table = torch.arange(R * layer.max_pages, dtype=torch.int32).view(R, layer.max_pages)
    lens = list(prefix)
    pre = torch.cat([block_table[b, torch.arange(n) // P].long() * P + torch.arange(n) % P
                     for b, n in enumerate(lens)])
    layer.write(torch.randn(pre.numel(), hidden, generator=g).to(d), pre.to(d))
    block_table = block_table.to(d)
    results = []
    for _ in range(steps):
        new = [torch.arange(n, n + Q) for n in lens]
        slots = torch.cat([block_table[b, p.to(d) // P].long() * P + p.to(d) % P for b, p in enumerate(new)])
        lens = [n + Q for n in lens]
        seq = torch.tensor(lens, dtype=torch.int32, device=d)
        results.append(layer.step(torch.randn(R * Q, hidden, generator=g).to(d), slots, block_table, seq))
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    off, on = decode_loop(False, a.steps, device=a.device), decode_loop(True, a.steps, device=a.device)
    for i, ((s0, o0), (s1, o1)) in enumerate(zip(off, on)):
        same = torch.equal(s0, s1) and torch.equal(o0, o1)
        print(f"step {i}: selections {tuple(s0.shape)}, outputs {tuple(o0.shape)}, sharding on == off: {same}")
        assert same


if __name__ == "__main__":
    main()
