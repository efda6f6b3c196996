"""Scores and selections of the package (CPU backend) against the numpy implementation of the
spec (spec_ref.py, indexer.md 3-5), and the plan / run and ICP forms against the synchronous
selection: replicated, sharded over simulated ranks through the split publish / all-gather /
merge, and through an InProcessGroup with one Python thread per rank."""


import numpy as np
import pytest

import indexcp
import spec_ref as ref
from rank_threads import run_rank_threads

DT = {"nvfp4": indexcp.KvDtype.nvfp4, "fp8": indexcp.KvDtype.fp8}
MODE = {"e4m3": indexcp.KRounding.e4m3, "exact": indexcp.KRounding.exact}


class Case:
    """A decode batch over a paged cache: random keys at random physical pages, tie-making
    duplicated keys, Q query rows per request, a padded request."""

    def __init__(self, dtype="nvfp4", P=128, W=1, H=4, Q=2, seq_lens=(2000, 900, 0, 131), K=8, seed=0):
        rng = np.random.default_rng(seed)
        self.dtype, self.P, self.W, self.H, self.Q, self.K = dtype, P, W, H, Q, K
        self.seq_lens = np.array(seq_lens, np.int32)
        R = len(seq_lens)
        self.max_pages = max(1, max(-(-s // P) for s in seq_lens))
        self.num_pages = R * self.max_pages + 3
        perm = rng.permutation(self.num_pages).astype(np.int32)
        self.block_table = perm[: R * self.max_pages].reshape(R, self.max_pages).copy()
        self.keys = {}  # (request, position) -> fp32 key
        slots, keys = [], []
        for b, s in enumerate(seq_lens):
            base = rng.standard_normal(128).astype(np.float32)
            for p in range(s):
                k = rng.standard_normal(128).astype(np.float32)
                if p % 128 == 5 and p >= 128:
                    k = base  # the same key in many blocks: equal block scores, ties to the lower id
                self.keys[(b, p)] = k
                slots.append(int(self.block_table[b, p // P]) * P + p % P)
                keys.append(k)
        self.slots = np.array(slots, np.int64)
        self.key_array = np.array(keys, np.float32).reshape(-1, 128)
        qf = (rng.standard_normal((R * Q, H, 128)) * 3).astype(np.float32)
        self.q = np.zeros(qf.shape, np.uint8)
        indexcp.quantize_queries(qf, self.q)
        self.sel = indexcp.SelectionParams(topk=K)

    def caches(self, W=None):
        """One cache per rank (W shards, or one replicated cache)."""
        W = self.W if W is None else W
        layout = indexcp.make_page_layout(DT[self.dtype], self.P, W)
        out = []
        for r in range(W):
            buf = np.zeros(indexcp.view_bytes(layout, self.num_pages, 2), np.uint8)
            v = indexcp.make_cache_view(layout, buf, self.num_pages, 2, r)
            indexcp.insert_keys(v, 1, self.key_array, self.slots)
            out.append((buf, v))
        return out

    def khat_by_request(self, mode):
        kh = {}
        for (b, p), k in self.keys.items():
            kh.setdefault(b, {})[p] = ref.khat(self.dtype, ref.key_row_bytes(self.dtype, k), mode)
        return kh

    def positions(self):
        for b, s in enumerate(self.seq_lens):
            for i in range(self.Q):
                yield b, b * self.Q + i, (int(s) - self.Q + i) if s > 0 else -1

    def expected(self, mode="e4m3", owner=None):
        kh = self.khat_by_request(mode)
        out = np.full((len(self.seq_lens) * self.Q, self.H, self.K), -1, np.int32)
        scores = {}
        for b, row, pos in self.positions():
            if pos < 0:
                continue
            s = ref.block_scores(self.q[row], kh.get(b, {}), pos, owner)
            scores[row] = s
            for h in range(self.H):
                out[row, h] = ref.select(s[h], pos, self.K)
        return out, scores


@pytest.mark.parametrize("dtype,mode", [("nvfp4", "e4m3"), ("nvfp4", "exact"), ("fp8", "e4m3")])
def test_scores_match_reference(dtype, mode):
    c = Case(dtype=dtype, seq_lens=(700, 300), Q=2)
    (_, v), = c.caches()
    score, valid = indexcp.score_blocks(v, 1, c.q, c.block_table, c.seq_lens, c.Q, 0, c.H, MODE[mode])
    _, exp = c.expected(mode)
    for row, s in exp.items():
        nb = s.shape[1]
        np.testing.assert_array_equal(score[row, :, :nb], s)  # exact: the same fp32 bits
        assert valid[row, :, :nb].all() and not valid[row, :, nb:].any()


@pytest.mark.parametrize("dtype,P,mode", [("nvfp4", 128, "e4m3"), ("nvfp4", 256, "exact"), ("fp8", 128, "e4m3")])
def test_decode_select_matches_reference(dtype, P, mode):
    c = Case(dtype=dtype, P=P)
    (_, v), = c.caches()
    out = np.zeros((len(c.seq_lens) * c.Q, c.H, c.K), np.int32)
    indexcp.decode_select(v, 1, c.q, c.block_table, c.seq_lens, c.Q, 0, c.H, c.sel, MODE[mode], out)
    exp, _ = c.expected(mode)
    np.testing.assert_array_equal(out, exp)
    # the tie rule is exercised: some block scores are equal and the selection had to choose
    assert (out[0] >= 0).sum() == c.H * c.K


def resolved(dtype, tp, sharding, P=128, H=4, Q=2, decode_cp=False, prefill_cp="gather"):
    cfg = indexcp.AttentionConfig.from_json(
        '{"indexer_kv_dtype": "%s", "indexer_cache_sharding": "%s", "indexer_decode_cp": %s, '
        '"indexer_prefill_cp": "%s"}' % (dtype, "on" if sharding else "off", "true" if decode_cp else "false", prefill_cp))
    return indexcp.resolve_config(cfg, indexcp.EngineParams(tp=tp, page_size=P, heads=H, query_len=Q))


def test_decode_plan_replicated_equals_reference():
    c = Case()
    (_, v), = c.caches()
    rc = resolved("nvfp4", 1, False)
    plan = indexcp.DecodePlan(rc, 0, indexcp.DecodeLimits(max_requests=4, max_pages=c.max_pages, query_len=c.Q,
                                                          heads=c.H, sel=c.sel))
    assert plan.path == indexcp.DecodePath.replicated
    ws = np.zeros(max(plan.workspace_bytes, 16), np.uint8)
    out = np.zeros((len(c.seq_lens) * c.Q, plan.num_heads, c.K), np.int32)
    status = np.zeros(1, np.uint32)
    plan.run(v, 1, c.q, c.block_table, c.seq_lens, ws, out, status=status)
    np.testing.assert_array_equal(out, c.expected()[0])
    assert status[0] == 0


@pytest.mark.parametrize("W,P,decode_cp", [(2, 128, False), (4, 256, False), (2, 128, True)])
def test_icp_split_exchange_equals_replicated(W, P, decode_cp):
    """Simulated ranks in one process: each publishes its record, the records are concatenated
    (the engine's all-gather), each merges; the union of the owned heads equals the replicated
    selection bit for bit (and the numpy reference)."""
    c = Case(P=P, W=W)
    rc = resolved("nvfp4", W, not decode_cp, P=P, decode_cp=decode_cp)
    caches = c.caches(1 if decode_cp else W)
    lim = indexcp.DecodeLimits(max_requests=4, max_pages=c.max_pages, query_len=c.Q, heads=c.H, sel=c.sel)
    plans = [indexcp.DecodePlan(rc, r, lim) for r in range(W)]
    assert plans[0].path == (indexcp.DecodePath.decode_cp if decode_cp else indexcp.DecodePath.icp)
    eb = plans[0].exchange_bytes
    recv = np.zeros(W * eb, np.uint8)
    for r, p in enumerate(plans):
        ws = np.zeros(max(p.workspace_bytes, 16), np.uint8)
        _, v = caches[0 if decode_cp else r]
        p.publish(v, 1, c.q, c.block_table, c.seq_lens, ws, recv[r * eb:(r + 1) * eb])
    got = np.full((len(c.seq_lens) * c.Q, c.H, c.K), -7, np.int32)
    for p in plans:
        out = np.zeros((len(c.seq_lens) * c.Q, p.num_heads, c.K), np.int32)
        status = np.zeros(1, np.uint32)
        p.merge(c.q, c.block_table, c.seq_lens, recv, out, status)
        assert status[0] == indexcp.StepStatus.ok
        got[:, p.head_begin:p.head_begin + p.num_heads] = out
    np.testing.assert_array_equal(got, c.expected()[0])


def test_icp_run_through_in_process_group():
    W = 2
    c = Case(W=W)
    rc = resolved("nvfp4", W, True)
    caches = c.caches()
    lim = indexcp.DecodeLimits(max_requests=4, max_pages=c.max_pages, query_len=c.Q, heads=c.H, sel=c.sel)
    group = indexcp.InProcessGroup(W)
    got = np.full((len(c.seq_lens) * c.Q, c.H, c.K), -7, np.int32)
    sync = np.full_like(got, -7)

    def rank(r):
        p = indexcp.DecodePlan(rc, r, lim)
        ws = np.zeros(p.workspace_bytes, np.uint8)
        out = np.zeros((len(c.seq_lens) * c.Q, p.num_heads, c.K), np.int32)
        p.run(caches[r][1], 1, c.q, c.block_table, c.seq_lens, ws, out, group.comm(r))
        got[:, p.head_begin:p.head_begin + p.num_heads] = out
        out2 = np.zeros_like(out)
        indexcp.icp_decode(group.comm(r), caches[r][1], 1, c.q, c.block_table, c.seq_lens, c.Q, c.sel,
                           indexcp.KRounding.e4m3, out2)
        sync[:, p.head_begin:p.head_begin + p.num_heads] = out2

    run_rank_threads(W, rank)
    exp = c.expected()[0]
    np.testing.assert_array_equal(got, exp)
    np.testing.assert_array_equal(sync, exp)


@pytest.mark.parametrize("prefill_cp", ["gather", "local_score"])
def test_prefill_plans_equal_replicated_prefill(prefill_cp):
    c = Case(seq_lens=(1000, 400), Q=1)
    R = len(c.seq_lens)
    T = np.array([37, 128], np.int32)  # the chunk's new tokens per request
    query_start = np.concatenate([[0], np.cumsum(T)]).astype(np.int32)
    rows = int(query_start[-1])
    rng = np.random.default_rng(9)
    qf = rng.standard_normal((rows, c.H, 128)).astype(np.float32)
    q = np.zeros((rows, c.H, 128), np.uint8)
    indexcp.quantize_queries(qf, q)
    (_, rv), = c.caches(1)
    exp = np.zeros((rows, c.H, c.K), np.int32)
    indexcp.prefill_select(rv, 1, q, c.block_table, c.seq_lens, query_start, 0, c.H, c.sel, exp)
    # the numpy reference of the replicated prefill: NVFP4 keys always E4M3-rounded
    kh = c.khat_by_request("e4m3")
    for b in range(R):
        for i in range(T[b]):
            row, pos = query_start[b] + i, int(c.seq_lens[b]) - int(T[b]) + i
            s = ref.block_scores(q[row], kh[b], pos)
            for h in range(c.H):
                np.testing.assert_array_equal(exp[row, h], ref.select(s[h], pos, c.K))
    ext = indexcp.prefill_extents(c.block_table, c.seq_lens, query_start, c.P)
    assert ext.rows == rows and ext.max_rows_per_request == 128
    W = 2
    rc = resolved("nvfp4", W, True, Q=1, prefill_cp=prefill_cp)
    caches = c.caches(W)
    lim = indexcp.PrefillLimits(max_requests=R, max_pages=c.max_pages, max_rows=rows, heads=c.H, sel=c.sel)
    group = indexcp.InProcessGroup(W)
    got = np.full((rows, c.H, c.K), -7, np.int32)

    def rank(r):
        p = indexcp.PrefillPlan(rc, r, lim)
        assert p.path == getattr(indexcp.PrefillPath, prefill_cp)
        ws = np.zeros(max(p.workspace_bytes, 16), np.uint8)
        out = np.zeros((rows, p.num_heads, c.K), np.int32)
        status = np.zeros(1, np.uint32)
        p.run(caches[r][1], 1, q, c.block_table, c.seq_lens, query_start, ext, ws, out, group.comm(r), status)
        assert status[0] == 0
        got[:, p.head_begin:p.head_begin + p.num_heads] = out

    run_rank_threads(W, rank)
    np.testing.assert_array_equal(got, exp)


def test_stage_fp8_matches_reference():
    c = Case(seq_lens=(300,), W=2)
    caches = c.caches()
    pages = c.block_table[0, :3].copy()
    for r, (_, v) in enumerate(caches):
        out = np.zeros((3, 64, 128), np.uint8)
        indexcp.stage_fp8(v, 1, pages, out)
        for i in range(3):
            for j in range(64):
                p = i * 128 + r * 64 + j
                if (0, p) in c.keys:
                    k = ref.khat("nvfp4", ref.key_row_bytes("nvfp4", c.keys[(0, p)]), "e4m3")
                    np.testing.assert_array_equal(out[i, j], ref.e4m3_encode(k))


def test_ties_go_to_the_lower_block_id():
    """Every key equal: every block scores the same, so the K - 1 ranked slots go to blocks
    0 .. K-2 (ties to the lower id) and the local block is forced."""
    c = Case(seq_lens=(128 * 20 + 3,), Q=1, K=6)
    for key in c.keys:
        c.keys[key] = c.key_array[0]
    c.key_array[:] = c.key_array[0]
    (_, v), = c.caches()
    out = np.zeros((1, c.H, c.K), np.int32)
    indexcp.decode_select(v, 1, c.q, c.block_table, c.seq_lens, 1, 0, c.H, c.sel, indexcp.KRounding.e4m3, out)
    for h in range(c.H):
        np.testing.assert_array_equal(out[0, h], [0, 1, 2, 3, 4, 20])
    np.testing.assert_array_equal(out, c.expected()[0])
