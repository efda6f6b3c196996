// libFuzzer target: validation of decode / prefill batches (decode_rows, prefill_rows, and the
// full decode_select / prefill_select / icp_decode on accepted batches) and of insert_keys'
// slot_mapping and keys, on tiny caches. Everything is derived from the fuzz bytes through a
// small reader (bytes run out -> zeros), so any input is meaningful.
//
// Contracts checked (std::abort() otherwise, which libFuzzer reports as a crash):
//   - only indexcp::Error escapes;
//   - a refused insert leaves every cache byte unchanged (replicated and both rank shards);
//   - the replicated cache and the two shards accept or refuse the same insert batch;
//   - selections hold -1 or ids below the row's visible blocks, ascending, no duplicates;
//   - icp_decode over 2 shards equals decode_select over the replicated cache.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "indexcp/cache.hpp"
#include "indexcp/comm.hpp"
#include "indexcp/error.hpp"
#include "indexcp/icp.hpp"
#include "indexcp/indexer.hpp"

namespace {

using namespace indexcp;

struct Reader {
  const uint8_t* p;
  size_t n;
  uint8_t u8() {
    if (!n) return 0;
    --n;
    return *p++;
  }
  int8_t i8() { return static_cast<int8_t>(u8()); }
  int16_t i16() { return static_cast<int16_t>(u8() | (u8() << 8)); }
  float key_value() {
    const uint8_t b = u8();
    if (b == 0xFF) return std::numeric_limits<float>::quiet_NaN();
    if (b == 0xFE) return std::numeric_limits<float>::infinity();
    if (b == 0xFD) return 3.0e38f;
    return static_cast<int8_t>(b) / 16.0f;
  }
};

void check_selection(const std::vector<int32_t>& out, const std::vector<QueryRow>& rows, int32_t nh, int32_t K) {
  for (size_t r = 0; r < rows.size(); ++r)
    for (int32_t h = 0; h < nh; ++h) {
      const int32_t* s = out.data() + (r * nh + h) * K;
      const int64_t vis = visible_blocks(rows[r]);
      int32_t prev = -1;
      bool pad = false;
      for (int32_t k = 0; k < K; ++k) {
        if (s[k] == -1) {
          pad = true;
          continue;
        }
        if (pad || s[k] < 0 || s[k] >= vis || s[k] <= prev) std::abort();
        prev = s[k];
      }
    }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Reader rd{data, size};
  const uint8_t mode = rd.u8();
  static const KvDtype dts[] = {KvDtype::kNvfp4, KvDtype::kFp8, KvDtype::kBf16, KvDtype::kNvfp4};
  const KvDtype dt = dts[mode & 3];
  const bool sharded_ok = dt != KvDtype::kBf16;
  const int32_t P = (mode & 4) ? 256 : 128;
  const bool prefill = mode & 8;
  const int64_t num_pages = 1 + (rd.u8() % 6);
  const int32_t W = 2;

  IndexCache repl(make_page_layout(dt, P, 1), num_pages, 1, 0);
  std::vector<IndexCache> shards;
  if (sharded_ok)
    for (int32_t r = 0; r < W; ++r) shards.emplace_back(make_page_layout(dt, P, W), num_pages, 1, r);

  // ---- insert batches: a few, each with its own slot mapping and keys
  const int n_inserts = 1 + rd.u8() % 3;
  for (int it = 0; it < n_inserts; ++it) {
    const int64_t n = rd.u8() % 24;
    std::vector<int64_t> slots(static_cast<size_t>(n));
    std::vector<float> keys(static_cast<size_t>(n) * kHeadDim, 0.5f);
    for (int64_t i = 0; i < n; ++i) {
      const uint8_t how = rd.u8();
      if (how == 0xFF) slots[i] = -1;
      else if (how == 0xFE) slots[i] = std::numeric_limits<int64_t>::min() + rd.u8();
      else if (how == 0xFD) slots[i] = std::numeric_limits<int64_t>::max() - rd.u8();
      else slots[i] = rd.i16();
      // a few key values per token from the input, the rest a fixed pattern
      const int nv = rd.u8() % 4;
      for (int v = 0; v < nv; ++v) keys[i * kHeadDim + rd.u8() % kHeadDim] = rd.key_value();
      for (int d = 0; d < kHeadDim; ++d) keys[i * kHeadDim + d] += static_cast<float>((i * 7 + d * 3) % 11) / 8.0f;
    }
    InsertOptions io;
    const uint8_t sc = rd.u8();
    io.encode_scale = sc == 0xFF ? std::numeric_limits<float>::quiet_NaN() : sc == 0xFE ? 0.0f : 1.0f + sc / 64.0f;
    const int32_t layer = (rd.u8() == 0xFF) ? 1 : 0;
    std::vector<IndexCache*> all{&repl};
    for (auto& s : shards) all.push_back(&s);
    int accepted = 0;
    for (IndexCache* c : all) {
      const std::vector<uint8_t> before(c->data(), c->data() + c->size_bytes());
      try {
        insert_keys(*c, layer, keys.data(), slots.data(), n, io);
        ++accepted;
      } catch (const Error&) {
        if (!std::equal(before.begin(), before.end(), c->data())) std::abort();  // refused call wrote
      }
    }
    if (accepted != 0 && accepted != static_cast<int>(all.size())) std::abort();  // ranks disagree
  }

  // ---- a batch
  const int32_t B = rd.u8() % 5;
  const int32_t max_pages = rd.u8() % 5;
  static const int32_t head_choices[] = {4, 2, 1, 8, 0, 65, 3, 4};
  const int32_t H = head_choices[rd.u8() & 7];
  const int32_t Q = rd.i8();
  std::vector<int32_t> block_table(static_cast<size_t>(B) * max_pages + 1);
  for (auto& x : block_table) x = rd.i8() % 8;
  std::vector<int32_t> seq_lens(static_cast<size_t>(B) + 1);
  for (auto& x : seq_lens) x = rd.i16();
  std::vector<int32_t> query_start(static_cast<size_t>(B) + 1);
  for (auto& x : query_start) x = rd.i16() % 64;
  SelectionParams sel;
  sel.topk = 2 + rd.u8() % 20;
  sel.init_blocks = rd.u8() % 4;
  if (rd.u8() == 0xFF) sel.local_blocks = 2;
  // q holds exactly the rows the batch claims (B * Q, or query_start[B]) x heads x 128 bytes: a
  // read past it is a library bug that ASan reports.
  int64_t claimed = prefill ? query_start[B] : static_cast<int64_t>(B) * Q;
  // q holds exactly rows() rows: prefill_rows must validate all of query_start before reading q
  // (regression: tests/regressions/fuzz_batch/prefill_rows_q_overread, query_start = [0, 8, 4]).
  const int64_t rows_cap = std::max<int64_t>(claimed, 0);
  const int64_t hmax = std::max<int32_t>(H, 0);
  std::vector<uint8_t> q(static_cast<size_t>(std::max<int64_t>(rows_cap * hmax * kHeadDim, 1)));
  for (size_t i = 0; i < q.size(); ++i) q[i] = static_cast<uint8_t>((i * 37 + 11) % 0x7E);
  {
    const int nq = rd.u8() % 4;
    for (int i = 0; i < nq; ++i) q[(static_cast<size_t>(rd.u8()) << 8 | rd.u8()) % q.size()] = rd.u8();
  }
  const KRounding kr = (rd.u8() & 1) ? KRounding::kE4m3 : KRounding::kExact;

  try {
    if (!prefill) {
      DecodeBatch db{q.data(), H, block_table.data(), B, max_pages, seq_lens.data(), Q};
      const auto rows = decode_rows(db, num_pages, P);
      if (static_cast<int64_t>(rows.size()) != db.rows() || db.rows() > rows_cap) std::abort();
      sel.validate();
      std::vector<int32_t> expect(static_cast<size_t>(db.rows()) * H * sel.topk, -7);
      decode_select(repl, 0, db, 0, H, sel, kr, expect.data());
      check_selection(expect, rows, H, sel.topk);
      if (sharded_ok && H >= W && H % W == 0) {
        const int32_t nh = H / W;
        std::vector<std::vector<int32_t>> got(W, std::vector<int32_t>(static_cast<size_t>(db.rows()) * nh * sel.topk, -7));
        run_ranks(W, [&](int rank, Communicator& comm) {
          icp_decode(comm, shards[rank], 0, db, sel, kr, got[rank].data());
        });
        for (int64_t r = 0; r < db.rows(); ++r)
          for (int32_t h = 0; h < H; ++h)
            if (!std::equal(expect.begin() + (r * H + h) * sel.topk, expect.begin() + (r * H + h + 1) * sel.topk,
                            got[h / nh].begin() + (r * nh + h % nh) * sel.topk))
              std::abort();  // sharded != replicated
      }
    } else {
      PrefillBatch pb{q.data(), H, block_table.data(), B, max_pages, seq_lens.data(), query_start.data()};
      const auto rows = prefill_rows(pb, num_pages, P);
      if (static_cast<int64_t>(rows.size()) != pb.rows()) std::abort();
      sel.validate();
      std::vector<int32_t> out(static_cast<size_t>(pb.rows()) * H * sel.topk, -7);
      prefill_select(repl, 0, pb, 0, H, sel, out.data());
      check_selection(out, rows, H, sel.topk);
    }
  } catch (const Error&) {
  }
  return 0;
}
