// The README's library example: insert keys into a TP2-sharded NVFP4 index cache, run one ICP
// decode step (score, publish, exchange, merge) on both ranks, and compare with the replicated
// cache. Built and run by ctest (test "example_quickstart"), so it stays true.
#include <cstdio>
#include <random>
#include <vector>

#include "indexcp/icp.hpp"

int main() {
  using namespace indexcp;
  const int P = 128, W = 2, H = 4, Q = 8, tokens = 4096;
  const int64_t num_pages = tokens / P;

  // one request of 4096 tokens in pages 0..31; keys: fp32 [tokens, 128]
  std::vector<int32_t> block_table(num_pages), seq_lens = {tokens};
  std::vector<int64_t> slots(tokens);
  for (int i = 0; i < num_pages; ++i) block_table[i] = i;
  for (int t = 0; t < tokens; ++t) slots[t] = t;
  std::mt19937 rng(0);
  std::normal_distribution<float> nd;
  std::vector<float> keys(tokens * 128), q_f32(Q * H * 128);
  for (float& x : keys) x = nd(rng);
  for (float& x : q_f32) x = nd(rng);

  // the replicated cache and the two rank shards (each stores 64 rows of every page: 36 B/token)
  IndexCache replicated(make_page_layout(KvDtype::kNvfp4, P, 1), num_pages, /*num_layers=*/1);
  std::vector<IndexCache> shards;
  for (int r = 0; r < W; ++r) shards.emplace_back(make_page_layout(KvDtype::kNvfp4, P, W), num_pages, 1, r);
  insert_keys(replicated, 0, keys.data(), slots.data(), tokens);
  for (auto& s : shards) insert_keys(s, 0, keys.data(), slots.data(), tokens);  // owner rows only

  // index Q of the 8 decode rows to E4M3, and the decode batch
  std::vector<uint8_t> q(Q * H * 128);
  quantize_queries(q_f32.data(), Q, H, {}, q.data());
  DecodeBatch batch{q.data(), H, block_table.data(), 1, static_cast<int32_t>(num_pages), seq_lens.data(), Q};
  SelectionParams sel;  // top-16: 15 ranked blocks + the local block

  // replicated: all 4 heads
  std::vector<int32_t> expect(Q * H * 16);
  decode_select(replicated, 0, batch, 0, H, sel, KRounding::kE4m3, expect.data());

  // ICP: both ranks as threads; rank r merges its owned heads 2r, 2r+1
  std::vector<std::vector<int32_t>> got(W, std::vector<int32_t>(Q * 2 * 16));
  run_ranks(W, [&](int rank, Communicator& comm) {
    icp_decode(comm, shards[rank], 0, batch, sel, KRounding::kE4m3, got[rank].data());
  });

  int mismatches = 0;
  for (int row = 0; row < Q; ++row)
    for (int h = 0; h < H; ++h)
      for (int k = 0; k < 16; ++k)
        mismatches += got[h / 2][(row * 2 + h % 2) * 16 + k] != expect[(row * H + h) * 16 + k];
  std::printf("row 7 head 0 selects:");
  for (int k = 0; k < 16; ++k) std::printf(" %d", expect[(7 * H) * 16 + k]);
  std::printf("\nshard bytes per rank: %lld (replicated %lld); mismatches: %d\n",
              static_cast<long long>(shards[0].size_bytes()), static_cast<long long>(replicated.size_bytes()),
              mismatches);
  return mismatches == 0 ? 0 : 1;
}
