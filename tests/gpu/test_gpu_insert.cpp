// GPU insert and index-Q cast: bytes identical to the CPU reference (formats.md, indexer.md
// section 6), refusals that write nothing; cases C01, C02, C06, C11.
#include <fstream>
#include <nlohmann/json.hpp>

#include "gpu_util.hpp"
#include "indexcp/error.hpp"

using namespace gpu;

namespace {

std::string shared_dir() {
  if (const char* e = std::getenv("INDEXCP_SHARED_DIR")) return e;
  return INDEXCP_SHARED_DIR;
}

// Host cache filled by the CPU insert, device cache by the GPU insert, same keys: bytes equal.
void expect_same_bytes(KvDtype dt, int32_t P, int32_t W, const std::vector<float>& keys, const std::vector<int64_t>& slots,
                       int64_t num_pages, const InsertOptions& host_opts, const std::vector<float>* norm_w,
                       const std::vector<int64_t>* positions, bool bf16, const std::string& what) {
  const PageLayout l = make_page_layout(dt, P, W);
  const int64_t n = static_cast<int64_t>(slots.size());
  DevArr<int64_t> ds(slots);
  DevArr<float> dk(keys);
  std::vector<uint16_t> kb(keys.size());
  std::vector<float> kf = keys;
  if (bf16) {
    for (size_t i = 0; i < keys.size(); ++i) kb[i] = bf16_encode(keys[i]);
    for (size_t i = 0; i < keys.size(); ++i) kf[i] = bf16_decode(kb[i]);
  }
  DevArr<uint16_t> dkb(kb);
  DevArr<float> dw(norm_w ? *norm_w : std::vector<float>(128, 0.0f));
  DevArr<int64_t> dp(positions ? *positions : std::vector<int64_t>(slots.size(), 0));
  InsertOptions dev_opts = host_opts;
  if (norm_w) dev_opts.pre.norm_weight = dw.get();
  if (positions) dev_opts.pre.positions = dp.get();
  for (int32_t rank = 0; rank < W; ++rank) {
    IndexCache host(l, num_pages, 2, rank);
    if (bf16) insert_keys_bf16(host, 1, kb.data(), slots.data(), n, host_opts);
    else insert_keys(host, 1, kf.data(), slots.data(), n, host_opts);
    cuda::DeviceCache dev(l, num_pages, 2, rank);
    if (bf16) cuda::insert_keys_bf16(dev, 1, dkb.get(), ds.get(), n, dev_opts, nullptr);
    else cuda::insert_keys(dev, 1, dk.get(), ds.get(), n, dev_opts, nullptr);
    IndexCache back(l, num_pages, 2, rank);
    dev.download(back);
    ASSERT_EQ(std::memcmp(back.data(), host.data(), static_cast<size_t>(host.size_bytes())), 0)
        << what << " rank " << rank << ": GPU bytes differ from the CPU's";
  }
}

}  // namespace

class GpuInsert : public ::testing::TestWithParam<std::tuple<KvDtype, int32_t, int32_t>> {};

TEST_P(GpuInsert, BytesEqualCpu) {
  REQUIRE_GPU();
  const auto [dt, P, W] = GetParam();
  auto req = make_requests({1, 129, 300, 1000}, P, 3u + P + W);
  std::vector<float> keys;
  std::vector<int64_t> slots;
  make_keys(req, 17u + W, keys, slots, 1.7f);
  // C01 / C02 material in a few tokens: zero keys, -0 keys, a zero group, values above midpoints
  for (int d = 0; d < 128; ++d) {
    keys[0 * 128 + d] = 0.0f;
    keys[1 * 128 + d] = -0.0f;
    if (d / 16 == 3) keys[2 * 128 + d] = 0.0f;
    keys[3 * 128 + d] = d % 2 ? fmt::bits_f32(0x43c8198c) : std::nextafter(1.0625f, 2.0f);
  }
  slots[5] = -1;  // a skipped token
  for (float S : {1.0f, 268.8f}) {
    InsertOptions o;
    o.encode_scale = S;
    expect_same_bytes(dt, P, W, keys, slots, req.num_pages, o, nullptr, nullptr, false, "plain S=" + std::to_string(S));
  }
  // RMSNorm + RoPE, fp32 and bf16 keys
  std::vector<float> w(128);
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 0.3f);
  for (auto& x : w) x = nd(rng);
  std::vector<int64_t> pos(slots.size());
  for (size_t i = 0; i < pos.size(); ++i) pos[i] = static_cast<int64_t>(i * 7919 % 200000);
  InsertOptions o;
  o.pre.norm_weight = w.data();
  o.pre.rope = true;
  o.pre.positions = pos.data();
  expect_same_bytes(dt, P, W, keys, slots, req.num_pages, o, &w, &pos, false, "norm+rope");
  expect_same_bytes(dt, P, W, keys, slots, req.num_pages, o, &w, &pos, true, "norm+rope bf16");
  InsertOptions onorm;
  onorm.pre.norm_weight = w.data();
  expect_same_bytes(dt, P, W, keys, slots, req.num_pages, onorm, &w, nullptr, true, "norm bf16");
}

INSTANTIATE_TEST_SUITE_P(All, GpuInsert,
                         ::testing::Combine(::testing::Values(KvDtype::kNvfp4, KvDtype::kFp8), ::testing::Values(128, 256),
                                            ::testing::Values(1, 2, 4, 8)));

TEST(GpuInsert, Bf16CacheBytesEqualCpu) {
  REQUIRE_GPU();
  auto req = make_requests({300, 70}, 128, 9);
  std::vector<float> keys;
  std::vector<int64_t> slots;
  make_keys(req, 10, keys, slots);
  expect_same_bytes(KvDtype::kBf16, 128, 1, keys, slots, req.num_pages, InsertOptions{}, nullptr, nullptr, false, "bf16");
}

// The acceptance vectors through the GPU insert: each block as group 2 of a key.
TEST(GpuInsert, AcceptanceVectors) {
  REQUIRE_GPU();
  std::ifstream f(shared_dir() + "/vectors/nvfp4_blocks.json");
  ASSERT_TRUE(f.good()) << "set INDEXCP_SHARED_DIR";
  const auto v = nlohmann::json::parse(f);
  auto hexv = [](const std::string& s) { return static_cast<uint32_t>(std::stoul(s, nullptr, 16)); };
  for (const auto& blk : v["nvfp4_blocks"]) {
    std::vector<float> key(128, 0.0f);
    for (int i = 0; i < 16; ++i) key[32 + i] = fmt::bits_f32(hexv(blk["x_bits"][i]));
    const float S = fmt::bits_f32(hexv(blk["S_bits"]));
    const PageLayout l = make_page_layout(KvDtype::kNvfp4, 128, 1);
    cuda::DeviceCache dev(l, 1, 1, 0);
    DevArr<float> dk(key);
    DevArr<int64_t> ds(std::vector<int64_t>{77});
    InsertOptions o;
    o.encode_scale = S;
    bool finite = true;
    for (float x : key) finite = finite && fmt::is_finite(x);
    if (!finite) continue;  // the insert path refuses non-finite keys; the quantizer test covers them
    cuda::insert_keys(dev, 0, dk.get(), ds.get(), 1, o, nullptr);
    IndexCache back(l, 1, 1, 0);
    dev.download(back);
    const auto row = read_row_bytes(back, 0, 0, 77);
    EXPECT_EQ(row[64 + 2], hexv(blk["scale"])) << blk["name"];
    char buf[17];
    for (int j = 0; j < 8; ++j) std::snprintf(buf + 2 * j, 3, "%02X", row[16 + j]);
    EXPECT_EQ(std::string(buf), blk["packed"].get<std::string>()) << blk["name"];
  }
}

TEST(GpuInsert, RefusalsWriteNothingAndNameTheToken) {
  REQUIRE_GPU();
  auto req = make_requests({600}, 128, 21);
  std::vector<float> keys;
  std::vector<int64_t> slots;
  make_keys(req, 22, keys, slots);
  const PageLayout l = make_page_layout(KvDtype::kNvfp4, 128, 1);
  cuda::DeviceCache dev(l, req.num_pages, 1, 0);
  IndexCache cpu(l, req.num_pages, 1, 0);
  auto expect_refused = [&](std::vector<float> k, std::vector<int64_t> s, InsertOptions o, const std::string& what) {
    std::string cpu_msg, gpu_msg;
    try {
      insert_keys(cpu, 0, k.data(), s.data(), static_cast<int64_t>(s.size()), o);
    } catch (const Error& e) {
      cpu_msg = e.what();
    }
    DevArr<float> dk(k);
    DevArr<int64_t> ds(s);
    try {
      cuda::insert_keys(dev, 0, dk.get(), ds.get(), static_cast<int64_t>(s.size()), o, nullptr);
      ADD_FAILURE() << what << ": accepted";
    } catch (const Error& e) {
      gpu_msg = e.what();
    }
    EXPECT_FALSE(cpu_msg.empty()) << what;
    EXPECT_EQ(gpu_msg, cpu_msg) << what;
    IndexCache back(l, req.num_pages, 1, 0);
    dev.download(back);
    for (int64_t i = 0; i < back.size_bytes(); ++i)
      if (back.data()[i] != 0) {
        ADD_FAILURE() << what << ": a refused batch wrote byte " << i;
        break;
      }
  };
  auto s = slots;
  s[400] = req.num_pages * 128;
  expect_refused(keys, s, {}, "slot past the end");
  s = slots;
  s[10] = -2;
  expect_refused(keys, s, {}, "slot -2");
  s = slots;
  s[500] = s[17];
  expect_refused(keys, s, {}, "duplicate slot");
  auto k = keys;
  k[300 * 128 + 5] = NAN;
  expect_refused(k, slots, {}, "NaN key");
  k = keys;
  k[599 * 128 + 127] = -INFINITY;
  expect_refused(k, slots, {}, "-Inf key");
  // C11: bad encode scales
  for (float S : {0.0f, -1.0f, NAN, INFINITY}) {
    InsertOptions o;
    o.encode_scale = S;
    try {
      DevArr<float> dk(keys);
      DevArr<int64_t> ds(slots);
      cuda::insert_keys(dev, 0, dk.get(), ds.get(), static_cast<int64_t>(slots.size()), o, nullptr);
      ADD_FAILURE() << "accepted S = " << S;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("encode_scale"), std::string::npos) << e.what();
    }
  }
  // non-finite after RMSNorm: a huge key overflows the sum of squares
  k = keys;
  for (int d = 0; d < 128; ++d) k[42 * 128 + d] = 3e38f;
  std::vector<float> w(128, 0.0f);
  DevArr<float> dw(w);
  InsertOptions hn;
  hn.pre.norm_weight = w.data();
  std::string cpu_msg, gpu_msg;
  try {
    insert_keys(cpu, 0, k.data(), slots.data(), static_cast<int64_t>(slots.size()), hn);
  } catch (const Error& e) {
    cpu_msg = e.what();
  }
  InsertOptions dn;
  dn.pre.norm_weight = dw.get();
  DevArr<float> dk(k);
  DevArr<int64_t> ds(slots);
  try {
    cuda::insert_keys(dev, 0, dk.get(), ds.get(), static_cast<int64_t>(slots.size()), dn, nullptr);
  } catch (const Error& e) {
    gpu_msg = e.what();
  }
  EXPECT_EQ(gpu_msg, cpu_msg);
}

// C06: distinct keys of 3 requests in scattered pages read back through the owning rank.
TEST(GpuCases, C06_WriteReadRoundTrip) {
  REQUIRE_GPU();
  for (KvDtype dt : {KvDtype::kNvfp4, KvDtype::kFp8})
    for (int32_t P : {128, 256})
      for (int32_t W : {1, 2, 4}) {
        auto req = make_requests({1, 129, 300}, P, 40u + P + W);
        std::vector<float> keys;
        std::vector<int64_t> slots;
        make_keys(req, 41u + W, keys, slots);
        auto shards = device_shards(dt, req, W, keys, slots);
        const PageLayout l = make_page_layout(dt, P, W);
        std::vector<IndexCache> back;
        for (int32_t r = 0; r < W; ++r) {
          back.emplace_back(l, req.num_pages, 1, r);
          shards[r].download(back.back());
        }
        for (size_t t = 0; t < slots.size(); ++t) {
          const SlotLocation loc = locate_slot(l, slots[t]);
          EXPECT_EQ(read_row_bytes(back[loc.rank], 0, loc.page, loc.row), quantize_key_bytes(dt, keys.data() + t * 128))
              << to_string(dt) << " P" << P << " W" << W << " token " << t;
        }
      }
}

TEST(GpuQCast, BytesEqualCpuAndNaNRefused) {
  REQUIRE_GPU();
  const int64_t T = 37;
  const int32_t H = 4;
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  std::vector<float> q(static_cast<size_t>(T) * H * 128);
  for (auto& x : q) x = nd(rng);
  q[7] = std::nextafter(1.0625f, 2.0f);  // C02
  q[8] = fmt::bits_f32(0x43c8198c);
  std::vector<float> w(128);
  for (auto& x : w) x = nd(rng) * 0.1f;
  std::vector<int64_t> pos(T);
  for (int64_t i = 0; i < T; ++i) pos[i] = 1000 + 33 * i;
  DevArr<float> dq(q), dw(w);
  DevArr<int64_t> dp(pos);
  DevArr<uint8_t> out(q.size());
  for (int variant = 0; variant < 3; ++variant) {
    KeyPreprocess hp, dpre;
    if (variant >= 1) {
      hp.norm_weight = w.data();
      dpre.norm_weight = dw.get();
    }
    if (variant == 2) {
      hp.rope = dpre.rope = true;
      hp.positions = pos.data();
      dpre.positions = dp.get();
    }
    std::vector<uint8_t> ref(q.size());
    quantize_queries(q.data(), T, H, hp, ref.data());
    cuda::quantize_queries(dq.get(), T, H, dpre, out.get(), nullptr);
    EXPECT_EQ(out.host(), ref) << "variant " << variant;
  }
  auto qn = q;
  qn[(5 * H + 2) * 128 + 9] = NAN;
  std::string cpu_msg;
  std::vector<uint8_t> tmp(q.size());
  try {
    quantize_queries(qn.data(), T, H, {}, tmp.data());
  } catch (const Error& e) {
    cpu_msg = e.what();
  }
  DevArr<float> dqn(qn);
  out.fill_bytes(0x55);
  try {
    cuda::quantize_queries(dqn.get(), T, H, {}, out.get(), nullptr);
    ADD_FAILURE() << "NaN q accepted";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), cpu_msg);
  }
  for (uint8_t b : out.host()) ASSERT_EQ(b, 0x55) << "a refused cast wrote its output";
}
