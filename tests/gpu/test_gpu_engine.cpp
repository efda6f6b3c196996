// The engine API on the GPU (docs/embedding.md): device cache views over caller memory (a pool
// slice, unusual strides, per-layer allocations), the asynchronous insert and Q cast with their
// device status, capture in a CUDA graph (cudaStreamCaptureModeGlobal, as torch.cuda.graph), and
// the validating paths on the caller's non-blocking stream. Every result against the CPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gpu_util.hpp"
#include "indexcp/cache_view.hpp"

namespace {

using namespace gpu;

cuda::Stream S(cudaStream_t s) { return reinterpret_cast<cuda::Stream>(s); }

std::vector<float> rand_keys(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> k(static_cast<size_t>(n) * kHeadDim);
  for (auto& v : k) v = nd(rng);
  return k;
}

std::vector<int64_t> rand_slots(int64_t n, int64_t num_slots, uint32_t seed) {
  std::vector<int64_t> all(static_cast<size_t>(num_slots));
  for (int64_t i = 0; i < num_slots; ++i) all[i] = i;
  std::mt19937 rng(seed);
  std::shuffle(all.begin(), all.end(), rng);
  std::vector<int64_t> s(all.begin(), all.begin() + n);
  for (int64_t i = 0; i < n; i += 5) s[i] = -1;
  return s;
}

// One pool of device memory and its host twin of the same geometry: the view at the same offset
// and strides in both; the CPU writes the host twin, the GPU the pool, and the bytes must agree.
struct Twin {
  size_t bytes;
  DevArr<uint8_t> dev;
  std::vector<uint8_t> host;  // 16-byte aligned through `hbase`
  uint8_t* hbase;
  std::vector<uint8_t> hraw;
  explicit Twin(size_t n) : bytes(n), dev(n), hraw(n + 32, 0x5A) {
    hbase = hraw.data() + (16 - reinterpret_cast<uintptr_t>(hraw.data()) % 16) % 16;
    dev.fill_bytes(0x5A);  // (waits: the legacy-stream memset before non-blocking streams use it)
  }
  std::vector<uint8_t> dev_bytes() const { return dev.host(); }
  std::vector<uint8_t> host_bytes() const { return std::vector<uint8_t>(hbase, hbase + bytes); }
};

struct Geo {
  KvDtype dt;
  int32_t P, W, rank;
  int64_t extra, offset, gap;
};

const std::vector<Geo> kGeos = {
    {KvDtype::kNvfp4, 128, 1, 0, 0, 0, 0},     {KvDtype::kNvfp4, 128, 2, 1, 48, 4096 + 16, 160},
    {KvDtype::kNvfp4, 256, 4, 3, 16, 32, 16},  {KvDtype::kFp8, 128, 2, 0, 112, 1024, 0},
    {KvDtype::kFp8, 256, 1, 0, 16, 16, 4096},  {KvDtype::kBf16, 128, 1, 0, 32, 48, 48},
};

// Cache bytes written through device views with unusual strides and offsets (synchronous and
// asynchronous insert, fp32 and bf16 keys, RMSNorm + RoPE) equal the CPU's through the same
// geometry on host memory, bit for bit, pool bytes outside the rows included.
TEST(GpuEngine, InsertThroughDeviceViewsEqualsTheCpuBitForBit) {
  REQUIRE_GPU();
  cudaStream_t st;
  CUDA_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  const int64_t num_pages = 9, n = 700, table_n = 4096;
  const int32_t layers = 3;
  std::vector<float> table(64 * table_n);
  fill_rope_table(table.data(), table_n, 5e6);
  DevArr<float> dtable(table_n * 64);
  cuda::fill_rope_table(dtable.get(), table_n, 5e6, S(st));
  EXPECT_EQ(dtable.host(), table) << "cuda::fill_rope_table";
  std::vector<float> w(kHeadDim);
  for (int d = 0; d < kHeadDim; ++d) w[d] = 0.004f * d - 0.1f;
  DevArr<float> dw(w);
  std::vector<int64_t> pos(n);
  for (int64_t i = 0; i < n; ++i) pos[i] = (i * 37) % table_n;
  DevArr<int64_t> dpos(pos);
  const auto keys = rand_keys(n, 5);
  std::vector<uint16_t> kb(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) kb[i] = bf16_encode(keys[i]);
  DevArr<float> dkeys(keys);
  DevArr<uint16_t> dkb(kb);
  const size_t wsb = cuda::insert_workspace_bytes(n);
  DevArr<uint8_t> ws(wsb);
  DevArr<InsertStatus> status(1);
  cuda::reset_status(status.get(), S(st));
  for (const Geo& g : kGeos) {
    const PageLayout l = make_page_layout(g.dt, g.P, g.W, make_page_layout(g.dt, g.P, g.W).page_bytes() + g.extra);
    const int64_t lb = (num_pages - 1) * l.page_stride + l.page_bytes();
    const int64_t ls = lb + g.gap + (16 - lb % 16) % 16;
    Twin t(static_cast<size_t>(g.offset + ls * layers));
    const CacheView dv =
        make_cache_view(l, t.dev.get() + g.offset, num_pages, layers, g.rank, ls, MemoryLocation::kDevice);
    const CacheView hv = make_cache_view(l, t.hbase + g.offset, num_pages, layers, g.rank, ls, MemoryLocation::kHost);
    for (int32_t layer = 0; layer < layers; ++layer) {
      const auto slots = rand_slots(n, num_pages * g.P, 3u + layer);
      DevArr<int64_t> dslots(slots);
      InsertOptions h, d;
      if (layer >= 1) {
        h.pre.norm_weight = w.data();
        d.pre.norm_weight = dw.get();
        h.pre.rope = d.pre.rope = true;
        h.pre.positions = pos.data();
        d.pre.positions = dpos.get();
        h.pre.rope_cos_sin = table.data();
        d.pre.rope_cos_sin = dtable.get();
        h.pre.rope_table_positions = d.pre.rope_table_positions = table_n;
      }
      if (layer == 2) {  // bf16 keys, asynchronous; the CPU synchronous
        insert_keys_bf16(hv, layer, kb.data(), slots.data(), n, h);
        cuda::insert_keys_bf16_async(dv, layer, dkb.get(), dslots.get(), n, d, ws.get(), wsb, status.get(), S(st));
      } else if (layer == 1) {  // fp32, asynchronous on both
        InsertStatus hs;
        reset_status(&hs);
        insert_keys_async(hv, layer, keys.data(), slots.data(), n, h, nullptr, 0, &hs);
        ASSERT_EQ(hs.reason, 0);
        cuda::insert_keys_async(dv, layer, dkeys.get(), dslots.get(), n, d, ws.get(), wsb, status.get(), S(st));
      } else {  // synchronous on both
        insert_keys(hv, layer, keys.data(), slots.data(), n, h);
        cuda::insert_keys(dv, layer, dkeys.get(), dslots.get(), n, d, S(st));
      }
      CUDA_OK(cudaStreamSynchronize(st));
    }
    const InsertStatus s = cuda::read_status(status.get(), S(st));
    EXPECT_EQ(s.reason, 0) << status_error(s).what();
    EXPECT_TRUE(t.dev_bytes() == t.host_bytes())
        << to_string(g.dt) << " P" << g.P << " W" << g.W << " rank " << g.rank << ": device pool != host pool";
  }
  // per-layer device allocations: a view of pointers
  const PageLayout l = make_page_layout(KvDtype::kNvfp4, 128, 2);
  std::vector<DevArr<uint8_t>> per;
  std::vector<uint8_t*> ptrs;
  for (int i = 0; i < 3; ++i) {
    per.emplace_back(static_cast<size_t>(num_pages * l.page_stride));
    per.back().fill_bytes(0);
    ptrs.push_back(per.back().get());
  }
  const CacheView pv = make_cache_view_layers(l, ptrs.data(), num_pages, 3, 1, MemoryLocation::kDevice);
  IndexCache ref(l, num_pages, 3, 1);
  for (int32_t layer = 0; layer < 3; ++layer) {
    const auto slots = rand_slots(n, num_pages * 128, 40u + layer);
    DevArr<int64_t> dslots(slots);
    insert_keys(ref, layer, keys.data(), slots.data(), n);
    cuda::insert_keys_async(pv, layer, dkeys.get(), dslots.get(), n, {}, ws.get(), wsb, status.get(), S(st));
    CUDA_OK(cudaStreamSynchronize(st));
    const auto got = per[layer].host();
    EXPECT_EQ(0, std::memcmp(got.data(), ref.page_ptr(layer, 0), got.size())) << "per-layer pointer view, layer "
                                                                                << layer;
  }
  CUDA_OK(cudaStreamDestroy(st));
}

struct Spoil {
  std::string name;
  std::function<void(std::vector<float>&, std::vector<int64_t>&, std::vector<int64_t>&)> fn;
  InsertRefusal reason;
};

// Each kind of bad token: the device status equals the CPU's (reason, token, value, dim, the
// message), the refused batch writes nothing, and the status stays with the first refusal.
TEST(GpuEngine, DeviceStatusReportsEachRefusalAsTheCpuAndWritesNothing) {
  REQUIRE_GPU();
  cudaStream_t st;
  CUDA_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  const PageLayout l = make_page_layout(KvDtype::kNvfp4, 128, 2);
  const int64_t table_n = 1000;
  std::vector<float> table(64 * table_n);
  fill_rope_table(table.data(), table_n, 5e6);
  DevArr<float> dtable(table);
  std::vector<float> w(kHeadDim, 0.25f);
  DevArr<float> dw(w);
  const std::vector<Spoil> spoils = {
      {"slot out of range", [](auto&, auto& s, auto&) { s[219] = 1 << 20; }, InsertRefusal::kSlotOutOfRange},
      {"slot below -1", [](auto&, auto& s, auto&) { s[3] = -7; }, InsertRefusal::kSlotOutOfRange},
      {"duplicate slot", [](auto&, auto& s, auto&) { s[250] = s[4]; s[260] = s[4]; }, InsertRefusal::kDuplicateSlot},
      {"NaN key", [](auto& k, auto&, auto&) { k[112 * kHeadDim + 77] = NAN; }, InsertRefusal::kNonFiniteKey},
      {"Inf key", [](auto& k, auto&, auto&) { k[2 * kHeadDim + 127] = -INFINITY; }, InsertRefusal::kNonFiniteKey},
      {"position beyond the table", [](auto&, auto&, auto& p) { p[151] = 1000; }, InsertRefusal::kPositionOutOfTable},
      {"zero key, eps 0", [](auto& k, auto&, auto&) {
         for (int d = 0; d < kHeadDim; ++d) k[33 * kHeadDim + d] = 0.0f;
       }, InsertRefusal::kNonFiniteAfterPreprocess},
      {"several bad tokens", [](auto& k, auto& s, auto&) {
         s[290] = 99999;
         s[200] = s[201];
         k[180 * kHeadDim + 5] = NAN;
         k[181 * kHeadDim + 5] = NAN;
       }, InsertRefusal::kNonFiniteKey},
  };
  // n = 300: the one-CTA duplicate check; n = 3000: the device-wide sort (src/cuda/insert.cu)
  for (const int64_t n : {int64_t{300}, int64_t{3000}})
  for (const Spoil& sp : spoils) {
    SCOPED_TRACE("n = " + std::to_string(n));
    const int64_t num_pages = n <= 300 ? 6 : 32;
    DevArr<uint8_t> ws(cuda::insert_workspace_bytes(n));
    auto keys = rand_keys(n, 77);
    auto slots = rand_slots(n, num_pages * 128, 78);
    std::vector<int64_t> pos(n);
    for (int64_t i = 0; i < n; ++i) pos[i] = (3 * i) % table_n;
    sp.fn(keys, slots, pos);
    DevArr<float> dkeys(keys);
    DevArr<int64_t> dslots(slots), dpos(pos);
    InsertOptions h, d;
    h.pre.norm_weight = w.data();
    d.pre.norm_weight = dw.get();
    h.pre.eps = d.pre.eps = 0.0f;
    h.pre.rope = d.pre.rope = true;
    h.pre.positions = pos.data();
    d.pre.positions = dpos.get();
    h.pre.rope_cos_sin = table.data();
    d.pre.rope_cos_sin = dtable.get();
    h.pre.rope_table_positions = d.pre.rope_table_positions = table_n;
    IndexCache hc(l, num_pages, 2, 1);
    cuda::DeviceCache dc(l, num_pages, 2, 1);
    dc.upload(hc);
    InsertStatus hs;
    reset_status(&hs);
    insert_keys_async(hc, 1, keys.data(), slots.data(), n, h, nullptr, 0, &hs);
    DevArr<InsertStatus> ds(1);
    cuda::reset_status(ds.get(), S(st));
    cuda::insert_keys_async(dc, 1, dkeys.get(), dslots.get(), n, d, ws.get(), ws.size(), ds.get(), S(st));
    const InsertStatus g = cuda::read_status(ds.get(), S(st));
    EXPECT_EQ(g.reason, static_cast<int32_t>(sp.reason)) << sp.name;
    EXPECT_EQ(g.reason, hs.reason) << sp.name;
    EXPECT_EQ(g.token, hs.token) << sp.name;
    EXPECT_EQ(g.value, hs.value) << sp.name;
    EXPECT_EQ(g.limit, hs.limit) << sp.name;
    EXPECT_EQ(g.dim, hs.dim) << sp.name;
    EXPECT_EQ(g.layer, 1) << sp.name;
    EXPECT_EQ(g.refused_calls, 1) << sp.name;
    EXPECT_EQ(g.refused_tokens, hs.refused_tokens) << sp.name;
    EXPECT_EQ(std::string(status_error(g).what()), std::string(status_error(hs).what())) << sp.name;
    IndexCache back(l, num_pages, 2, 1);
    dc.download(back);
    EXPECT_EQ(0, std::memcmp(back.data(), hc.data(), static_cast<size_t>(hc.size_bytes())))
        << sp.name << ": the refused batch wrote";
    // the synchronous GPU call throws the CPU synchronous call's message (no table there)
    if (sp.reason != InsertRefusal::kPositionOutOfTable) {
      InsertOptions hs_opts = h, ds_opts = d;
      hs_opts.pre.rope_cos_sin = ds_opts.pre.rope_cos_sin = nullptr;
      const std::string cpu = error_of([&] { insert_keys(hc, 1, keys.data(), slots.data(), n, hs_opts); });
      const std::string gpu =
          error_of([&] { cuda::insert_keys(dc, 1, dkeys.get(), dslots.get(), n, ds_opts, S(st)); });
      EXPECT_EQ(gpu, cpu) << sp.name;
    }
    // sticky: another refused call keeps these details, counts add up; a good call still writes
    cuda::insert_keys_async(dc, 0, dkeys.get(), dslots.get(), n, d, ws.get(), ws.size(), ds.get(), S(st));
    const InsertStatus g2 = cuda::read_status(ds.get(), S(st));
    EXPECT_EQ(g2.layer, 1);
    EXPECT_EQ(g2.token, g.token);
    EXPECT_EQ(g2.refused_calls, 2);
    EXPECT_EQ(g2.refused_tokens, 2 * g.refused_tokens);
  }
  CUDA_OK(cudaStreamDestroy(st));
}

// The duplicate check's two paths at their edges (one token: none; 2,048: the one-CTA check's
// last item; 2,049: the device-wide sort): a repeat of an earlier slot in the last token is
// refused there as on the CPU, two tokens with the same out-of-range slot are both refused as out
// of range (not as duplicates), and a good batch writes the CPU's bytes.
TEST(GpuEngine, DuplicateCheckAtItsEdgesEqualsTheCpu) {
  REQUIRE_GPU();
  cudaStream_t st;
  CUDA_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  const PageLayout l = make_page_layout(KvDtype::kFp8, 128, 1);
  const int64_t num_pages = 40;
  for (const int64_t n : {int64_t{1}, int64_t{2}, int64_t{2047}, int64_t{2048}, int64_t{2049}}) {
    SCOPED_TRACE("n = " + std::to_string(n));
    const auto keys = rand_keys(n, 5);
    DevArr<float> dkeys(keys);
    DevArr<uint8_t> ws(cuda::insert_workspace_bytes(n));
    DevArr<InsertStatus> ds(1);
    std::vector<std::vector<int64_t>> batches = {rand_slots(n, num_pages * 128, 9)};
    if (n >= 2) {
      auto dup = batches[0];  // token 0 is skipped (-1) in rand_slots, token n - 1 is not
      dup[0] = dup[n - 1];    // so token n - 1 repeats token 0's slot
      batches.push_back(dup);
      auto oor = batches[0];
      oor[0] = oor[n - 1] = num_pages * 128 + 5;
      batches.push_back(oor);
    } else {
      batches.push_back({-5});
    }
    for (const auto& slots : batches) {
      DevArr<int64_t> dslots(slots);
      IndexCache hc(l, num_pages, 1, 0);
      cuda::DeviceCache dc(l, num_pages, 1, 0);
      InsertStatus hs;
      reset_status(&hs);
      insert_keys_async(hc, 0, keys.data(), slots.data(), n, {}, nullptr, 0, &hs);
      cuda::reset_status(ds.get(), S(st));
      cuda::insert_keys_async(dc, 0, dkeys.get(), dslots.get(), n, {}, ws.get(), ws.size(), ds.get(), S(st));
      const InsertStatus g = cuda::read_status(ds.get(), S(st));
      EXPECT_EQ(g.reason, hs.reason);
      EXPECT_EQ(g.token, hs.token);
      EXPECT_EQ(g.value, hs.value);
      EXPECT_EQ(g.refused_tokens, hs.refused_tokens);
      IndexCache back(l, num_pages, 1, 0);
      dc.download(back);
      EXPECT_EQ(0, std::memcmp(back.data(), hc.data(), static_cast<size_t>(hc.size_bytes())));
    }
  }
  CUDA_OK(cudaStreamDestroy(st));
}

// Insert (fp32 and bf16, RMSNorm + RoPE from the table) and Q cast captured in one graph in
// cudaStreamCaptureModeGlobal, replayed with new keys, slots, positions and q written into the same
// device buffers: the cache, the E4M3 q and the status equal eager execution; no allocation node.
TEST(GpuEngine, InsertAndQCastCapturedInAGraphReplayAsEager) {
  REQUIRE_GPU();
  cuda::prepare_device();
  cudaStream_t st;
  CUDA_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  for (const int64_t n : {int64_t{512}, int64_t{4096}}) {  // the one-CTA and the device-wide duplicate check
  SCOPED_TRACE("n = " + std::to_string(n));
  const PageLayout l = make_page_layout(KvDtype::kNvfp4, 128, 2);
  const int64_t num_pages = 64, table_n = 8192;
  const int32_t H = 4, layers = 2;
  DevArr<float> dtable(table_n * 64);
  cuda::fill_rope_table(dtable.get(), table_n, 5e6, S(st));
  std::vector<float> w(kHeadDim, 0.1f);
  DevArr<float> dw(w);
  DevArr<float> dkeys(n * kHeadDim), dq(n * H * kHeadDim);
  DevArr<uint16_t> dkb(n * kHeadDim);
  DevArr<int64_t> dslots(n), dpos(n);
  DevArr<uint8_t> qout(n * H * kHeadDim);
  const size_t wsb = cuda::insert_workspace_bytes(n);
  DevArr<uint8_t> ws(wsb);
  DevArr<InsertStatus> status(1);
  auto load = [&](uint32_t seed) {
    const auto k = rand_keys(n, seed);
    std::vector<uint16_t> b(k.size());
    for (size_t i = 0; i < k.size(); ++i) b[i] = bf16_encode(k[i]);
    dkeys.upload(k);
    dkb.upload(b);
    dslots.upload(rand_slots(n, num_pages * 128, seed + 1));
    std::vector<int64_t> p(n);
    for (int64_t i = 0; i < n; ++i) p[i] = (seed * 7 + i * 13) % table_n;
    dpos.upload(p);
    dq.upload(rand_keys(n * H, seed + 2));
  };
  InsertOptions o;
  o.pre.norm_weight = dw.get();
  o.pre.rope = true;
  o.pre.positions = dpos.get();
  o.pre.rope_cos_sin = dtable.get();
  o.pre.rope_table_positions = table_n;
  auto step = [&](const CacheView& c) {
    cuda::insert_keys_async(c, 0, dkeys.get(), dslots.get(), n, o, ws.get(), wsb, status.get(), S(st));
    cuda::insert_keys_bf16_async(c, 1, dkb.get(), dslots.get(), n, o, ws.get(), wsb, status.get(), S(st));
    cuda::quantize_queries_async(dq.get(), n, H, o.pre, qout.get(), status.get(), S(st));
  };
  cuda::DeviceCache graphed(l, num_pages, layers, 0), eager(l, num_pages, layers, 0);
  cuda::reset_status(status.get(), S(st));
  load(100);
  cudaGraph_t graph;
  CUDA_OK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
  step(graphed);
  CUDA_OK(cudaStreamEndCapture(st, &graph));
  EXPECT_FALSE(graph_has_alloc_node(graph)) << "the captured insert / Q cast holds a memory-allocation node";
  cudaGraphExec_t exec;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (uint32_t seed : {100u, 200u, 300u}) {
    load(seed);
    CUDA_OK(cudaGraphLaunch(exec, st));
    CUDA_OK(cudaStreamSynchronize(st));
    const auto q_graph = qout.host();
    qout.fill_bytes(0);
    step(eager);
    CUDA_OK(cudaStreamSynchronize(st));
    EXPECT_EQ(qout.host(), q_graph) << "replay " << seed << ": q";
    IndexCache a(l, num_pages, layers, 0), b(l, num_pages, layers, 0);
    graphed.download(a);
    eager.download(b);
    EXPECT_EQ(0, std::memcmp(a.data(), b.data(), static_cast<size_t>(a.size_bytes()))) << "replay " << seed;
  }
  EXPECT_EQ(cuda::read_status(status.get(), S(st)).reason, 0);
  // a replay whose new slots repeat a slot: refused by the graph as by an eager call
  auto s = rand_slots(n, num_pages * 128, 400);
  s[10] = s[11];
  dslots.upload(s);
  IndexCache before(l, num_pages, layers, 0), after(l, num_pages, layers, 0);
  graphed.download(before);
  CUDA_OK(cudaGraphLaunch(exec, st));
  const InsertStatus rs = cuda::read_status(status.get(), S(st));
  EXPECT_EQ(rs.reason, static_cast<int32_t>(InsertRefusal::kDuplicateSlot));
  EXPECT_EQ(rs.token, 11);
  EXPECT_EQ(rs.refused_calls, 2);  // both layers' inserts of the replay
  graphed.download(after);
  EXPECT_EQ(0, std::memcmp(before.data(), after.data(), static_cast<size_t>(before.size_bytes())));
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  }
  CUDA_OK(cudaStreamDestroy(st));
}

// The validating paths read device metadata on the caller's stream, after the caller's writes:
// seq_lens written on a non-blocking stream behind a slow host callback are the ones validated.
TEST(GpuEngine, ValidatingPathSeesTheCallersWritesOnANonBlockingStream) {
  REQUIRE_GPU();
  cudaStream_t st;
  CUDA_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  const auto req = make_requests({700, 300}, 128, 5);
  const int32_t H = 4;
  std::vector<float> keys;
  std::vector<int64_t> slots;
  make_keys(req, 9, keys, slots);
  IndexCache hc(make_page_layout(KvDtype::kNvfp4, 128, 1), req.num_pages, 1, 0);
  insert_keys(hc, 0, keys.data(), slots.data(), static_cast<int64_t>(slots.size()));
  cuda::DeviceCache dc(hc.layout(), req.num_pages, 1, 0);
  dc.upload(hc);
  const auto q = make_q(2, H, 3);
  DevDecode d(req, q, H, 1);
  // the device seq_lens hold garbage that validation refuses; the caller's stream overwrites them
  // with the real ones after a 200 ms host callback
  d.sl.upload({1 << 30, 1 << 30});
  int32_t* pinned = nullptr;
  CUDA_OK(cudaMallocHost(&pinned, 2 * sizeof(int32_t)));
  pinned[0] = req.seq_lens[0];
  pinned[1] = req.seq_lens[1];
  CUDA_OK(cudaLaunchHostFunc(
      st, [](void*) { std::this_thread::sleep_for(std::chrono::milliseconds(200)); }, nullptr));
  CUDA_OK(cudaMemcpyAsync(d.sl.get(), pinned, 2 * sizeof(int32_t), cudaMemcpyHostToDevice, st));
  SelectionParams sel;
  DevArr<int32_t> out(static_cast<size_t>(2) * H * sel.topk);
  EXPECT_NO_THROW(cuda::decode_select(dc, 0, d.b, 0, H, sel, KRounding::kE4m3, out.get(), S(st), true));
  CUDA_OK(cudaStreamSynchronize(st));
  std::vector<int32_t> ref(out.size());
  DecodeBatch hb = decode_batch(req, q, H, 1);
  decode_select(hc, 0, hb, 0, H, sel, KRounding::kE4m3, ref.data());
  EXPECT_EQ(out.host(), ref);
  // and validate_decode_batch itself, on the stream
  d.sl.upload({1 << 30, 1 << 30});
  CUDA_OK(cudaLaunchHostFunc(
      st, [](void*) { std::this_thread::sleep_for(std::chrono::milliseconds(200)); }, nullptr));
  CUDA_OK(cudaMemcpyAsync(d.sl.get(), pinned, 2 * sizeof(int32_t), cudaMemcpyHostToDevice, st));
  EXPECT_NO_THROW(cuda::validate_decode_batch(d.b, dc.num_pages(), 128, S(st)));
  CUDA_OK(cudaFreeHost(pinned));
  CUDA_OK(cudaStreamDestroy(st));
}

// Views of the wrong kind and bad workspace are refused by name before anything is enqueued; the
// device check passes on this (Hopper) device.
TEST(GpuEngine, BadArgumentsAreRefusedByName) {
  REQUIRE_GPU();
  EXPECT_NO_THROW(cuda::require_supported_device());
  EXPECT_NO_THROW(cuda::prepare_device());
  IndexCache hc(make_page_layout(KvDtype::kNvfp4, 128, 1), 4, 1, 0);
  DevArr<float> k(kHeadDim);
  DevArr<int64_t> s(1);
  DevArr<uint8_t> ws(cuda::insert_workspace_bytes(1) + 64);
  DevArr<InsertStatus> st(1);
  EXPECT_NE(error_of([&] { cuda::insert_keys(hc, 0, k.get(), s.get(), 1, {}, nullptr); }).find("cache is a host view"),
            std::string::npos);
  cuda::DeviceCache dc(hc.layout(), 4, 1, 0);
  EXPECT_NE(error_of([&] { cuda::insert_keys_async(dc, 0, k.get(), s.get(), 1, {}, ws.get(), 8, st.get(), nullptr); })
                .find("workspace_bytes = 8 is smaller than insert_workspace_bytes"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              cuda::insert_keys_async(dc, 0, k.get(), s.get(), 1, {}, ws.get() + 4, ws.size() - 4, st.get(), nullptr);
            }).find("workspace is not 16-byte aligned"),
            std::string::npos);
  EXPECT_NE(error_of([&] { cuda::insert_keys_async(dc, 0, k.get(), s.get(), 1, {}, ws.get(), ws.size(), nullptr, nullptr); })
                .find("status is null"),
            std::string::npos);
  EXPECT_NE(error_of([&] { cuda::insert_keys_async(dc, 3, k.get(), s.get(), 1, {}, ws.get(), ws.size(), st.get(), nullptr); })
                .find("layer = 3"),
            std::string::npos);
  SelectionParams sel;
  DecodeBatch b;
  EXPECT_NE(error_of([&] { cuda::decode_select(hc, 0, b, 0, 1, sel, KRounding::kE4m3, nullptr, nullptr); })
                .find("cache is a host view"),
            std::string::npos);
}

}  // namespace
