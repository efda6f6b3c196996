// The .npy reader/writer: round trips, format 2.0, and every kind of bad header or body.
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "indexcp/error.hpp"
#include "indexcp/npy.hpp"

using namespace indexcp;
namespace fs = std::filesystem;

namespace {

fs::path temp_dir() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const fs::path d = fs::temp_directory_path() /
                     ("indexcp_npy_" + std::to_string(::getpid()) + "_" + info->test_suite_name() + "_" + info->name());
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

void write_bytes(const fs::path& p, const std::vector<uint8_t>& b) {
  std::ofstream out(p, std::ios::binary);
  out.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

// A .npy image with a hand-written header (version 1.0 unless told otherwise).
std::vector<uint8_t> image(const std::string& header, std::size_t data_bytes, int major = 1, int minor = 0) {
  std::vector<uint8_t> f = {0x93, 'N', 'U', 'M', 'P', 'Y', static_cast<uint8_t>(major), static_cast<uint8_t>(minor)};
  const std::size_t hl = header.size();
  f.push_back(static_cast<uint8_t>(hl & 0xff));
  f.push_back(static_cast<uint8_t>(hl >> 8));
  if (major >= 2) {
    f.push_back(static_cast<uint8_t>(hl >> 16));
    f.push_back(static_cast<uint8_t>(hl >> 24));
  }
  f.insert(f.end(), header.begin(), header.end());
  for (std::size_t i = 0; i < data_bytes; ++i) f.push_back(static_cast<uint8_t>(i));
  return f;
}

// Expects parse() to refuse the image with a message holding the file name and `needle`.
void expect_refused(const std::vector<uint8_t>& img, const std::string& needle) {
  try {
    npy::parse(img, "some/file.npy");
    ADD_FAILURE() << "accepted; expected an error containing: " << needle;
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_EQ(m.rfind("some/file.npy: ", 0), 0u) << m;
    EXPECT_NE(m.find(needle), std::string::npos) << m;
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  }
}

}  // namespace

TEST(Npy, RoundTripEveryDtype) {
  const fs::path d = temp_dir();
  const std::vector<float> f32 = {1.5f, -0.0f, std::numeric_limits<float>::infinity(), 3e-39f, 7.0f, -2.25f};
  const std::vector<int32_t> i32 = {0, -1, 2147483647, -2147483647 - 1, 5, 6};
  const std::vector<int64_t> i64 = {0, -1, int64_t{1} << 40, -(int64_t{1} << 62), 5, 6};
  const std::vector<uint8_t> u8 = {0, 1, 0x7f, 0x80, 0xff, 42};
  const std::vector<uint16_t> f16 = {0x3c00, 0x8000, 0x7c00, 0x0001, 0x3555, 0xc000};
  npy::save((d / "f32.npy").string(), {2, 3}, f32.data());
  npy::save((d / "i32.npy").string(), {6}, i32.data());
  npy::save((d / "i64.npy").string(), {3, 1, 2}, i64.data());
  npy::save((d / "u8.npy").string(), {1, 6}, u8.data());
  npy::save((d / "f16.npy").string(), npy::Dtype::kFloat16, {6}, f16.data());
  auto a = npy::load((d / "f32.npy").string());
  EXPECT_EQ(a.dtype, npy::Dtype::kFloat32);
  EXPECT_EQ(a.shape, (std::vector<int64_t>{2, 3}));
  ASSERT_EQ(a.bytes.size(), 24u);
  EXPECT_EQ(std::memcmp(a.bytes.data(), f32.data(), 24), 0);
  a = npy::load_checked((d / "i32.npy").string(), npy::Dtype::kInt32, 1);
  EXPECT_EQ(std::vector<int32_t>(a.data<int32_t>(), a.data<int32_t>() + 6), i32);
  a = npy::load_checked((d / "i64.npy").string(), npy::Dtype::kInt64, 3);
  EXPECT_EQ(std::vector<int64_t>(a.data<int64_t>(), a.data<int64_t>() + 6), i64);
  a = npy::load_checked((d / "u8.npy").string(), npy::Dtype::kUint8, 2);
  EXPECT_EQ(std::vector<uint8_t>(a.bytes.begin(), a.bytes.end()), u8);
  a = npy::load_checked((d / "f16.npy").string(), npy::Dtype::kFloat16, 1);
  const auto f = npy::to_float32(a, "f16.npy");
  EXPECT_EQ(f[0], 1.0f);
  EXPECT_TRUE(std::signbit(f[1]) && f[1] == 0.0f);
  EXPECT_TRUE(std::isinf(f[2]));
  EXPECT_EQ(f[3], std::ldexp(1.0f, -24));
  EXPECT_EQ(f[5], -2.0f);
  fs::remove_all(d);
}

TEST(Npy, HeaderIsWhatNumPyWrites) {
  const std::vector<int32_t> v = {1, 2, 3};
  const auto img = npy::serialize(npy::Dtype::kInt32, {3}, v.data());
  const std::size_t hl = img[8] | (img[9] << 8);
  EXPECT_EQ(img[6], 1);
  EXPECT_EQ(img[7], 0);
  EXPECT_EQ((10 + hl) % 64, 0u);
  const std::string header(img.begin() + 10, img.begin() + 10 + static_cast<std::ptrdiff_t>(hl));
  EXPECT_EQ(header.rfind("{'descr': '<i4', 'fortran_order': False, 'shape': (3,), }", 0), 0u) << header;
  EXPECT_EQ(header.back(), '\n');
  const auto u8 = npy::serialize(npy::Dtype::kUint8, {2, 0}, nullptr);
  const std::string h2(u8.begin() + 10, u8.end());
  EXPECT_NE(h2.find("'descr': '|u1'"), std::string::npos);
  EXPECT_NE(h2.find("'shape': (2, 0)"), std::string::npos);
}

TEST(Npy, ZeroDimensionalAndEmptyArrays) {
  const float x = 4.0f;
  auto a = npy::parse(npy::serialize(npy::Dtype::kFloat32, {}, &x), "scalar");
  EXPECT_EQ(a.ndim(), 0);
  EXPECT_EQ(a.size(), 1);
  EXPECT_EQ(*a.data<float>(), 4.0f);
  a = npy::parse(npy::serialize(npy::Dtype::kFloat32, {0, 128}, nullptr), "empty");
  EXPECT_EQ(a.size(), 0);
  EXPECT_EQ(a.shape, (std::vector<int64_t>{0, 128}));
}

TEST(Npy, ReadsFormat2AndOtherSpellings) {
  // version 2.0 (4-byte header length), double quotes, no trailing comma, Python 2 long suffix
  auto a = npy::parse(image("{\"descr\": \"<f4\", \"fortran_order\": False, \"shape\": (2L, 1L)}   \n", 8, 2, 0), "v2");
  EXPECT_EQ(a.dtype, npy::Dtype::kFloat32);
  EXPECT_EQ(a.shape, (std::vector<int64_t>{2, 1}));
  // keys in another order; '<u1' and '=' byte orders; 1-d Fortran order is the same as C order
  a = npy::parse(image("{'shape': (4,), 'fortran_order': True, 'descr': '<u1', }\n", 4), "u1");
  EXPECT_EQ(a.dtype, npy::Dtype::kUint8);
  a = npy::parse(image("{'descr': '=i8', 'fortran_order': False, 'shape': (1,), }\n", 8), "i8");
  EXPECT_EQ(a.dtype, npy::Dtype::kInt64);
}

TEST(Npy, EveryBadHeaderIsRefusedWithTheFileNamed) {
  const std::string ok = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }\n";
  expect_refused({}, "empty file");
  expect_refused({'P', 'K', 3, 4, 0, 0, 0, 0, 0, 0, 0, 0}, "bad magic");
  auto v = image(ok, 24);
  v[0] = 0x92;
  expect_refused(v, "bad magic");
  // a file that starts with the magic but ends inside the preamble is truncated, not "bad magic"
  for (std::size_t n : {3, 6, 7, 8, 9}) {
    std::vector<uint8_t> head = image(ok, 24);
    head.resize(n);
    try {
      npy::parse(head, "some/file.npy");
      ADD_FAILURE() << n << " bytes accepted";
    } catch (const Error& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("truncated"), std::string::npos) << n << ": " << m;
      EXPECT_EQ(m.find("magic"), std::string::npos) << n << ": " << m;
    }
  }
  v = image(ok, 24, 2, 0);
  v.resize(11);
  expect_refused(v, "truncated inside the .npy preamble");
  expect_refused({'P', 'K'}, "bad magic");
  expect_refused(image(ok, 24, 3, 0), "version 3.0 is not supported");
  expect_refused(image(ok, 24, 1, 1), "version 1.1 is not supported");
  expect_refused(image(ok, 24, 4, 0), "version 4.0");
  // header length beyond the file
  v = image(ok, 0);
  v[8] = 0xff;
  v[9] = 0x7f;
  expect_refused(v, "truncated");
  // header contents
  expect_refused(image("['descr', '<f4']\n", 24), "not a dictionary");
  expect_refused(image("{'descr': '<f4', 'fortran_order': False}\n", 24), "missing key 'shape'");
  expect_refused(image("{'fortran_order': False, 'shape': (6,)}\n", 24), "missing key 'descr'");
  expect_refused(image("{'descr': '<f4', 'shape': (6,)}\n", 24), "missing key 'fortran_order'");
  expect_refused(image("{'descr': '<f4', 'fortran_order': False, 'shape': (6,), 'extra': 1}\n", 24), "unknown key 'extra'");
  expect_refused(image("{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (6,)}\n", 24), "appears twice");
  expect_refused(image("{'descr': '<f4', 'fortran_order': False, 'shape': (6,)", 24), "expected");
  expect_refused(image("{'descr': '<f4', 'fortran_order': False, 'shape': (6,)} junk\n", 24), "unexpected text");
  expect_refused(image("{'descr': '<f4 , 'fortran_order': False, 'shape': (6,)}\n", 24), "malformed");
  expect_refused(image("{'descr': '<f4', 'fortran_order': 0, 'shape': (6,)}\n", 24), "fortran_order");
  expect_refused(image("{'descr': '<f4', 'fortran_order': False, 'shape': [6]}\n", 24), "unsupported value");
  expect_refused(image("{'descr': '<f4', 'fortran_order': False, 'shape': 6}\n", 24), "shape must be a tuple");
  expect_refused(image("{'descr': '<f4', 'fortran_order': False, 'shape': ('6',)}\n", 24), "shape must be a tuple");
  expect_refused(image("{'descr': '<f4', 'fortran_order': False, 'shape': (-6,)}\n", 24), "negative");
  expect_refused(image("{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999,)}\n", 24),
                 "too large");
  expect_refused(image("{'descr': '<f4', 'fortran_order': False, 'shape': (4611686018427387904, 4)}\n", 24),
                 "too large");
  expect_refused(image("{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (6,)}\n", 24), "unsupported value");
  // a tuple inside a tuple is refused where it starts, however deep the nesting (one recursion per
  // '(' overflowed the stack at 50,000 levels)
  expect_refused(image("{'descr': '<f4', 'fortran_order': False, 'shape': ((6,),)}\n", 24), "a tuple inside a tuple");
  expect_refused(image("{'descr': '<f4', 'fortran_order': False, 'shape': " + std::string(200000, '(') + "}\n", 24, 2, 0),
                 "a tuple inside a tuple");
  // dtypes
  expect_refused(image("{'descr': '>f4', 'fortran_order': False, 'shape': (6,)}\n", 24), "big-endian");
  expect_refused(image("{'descr': '<f8', 'fortran_order': False, 'shape': (3,)}\n", 24), "'<f8' is not supported");
  expect_refused(image("{'descr': '<c8', 'fortran_order': False, 'shape': (3,)}\n", 24), "is not supported");
  expect_refused(image("{'descr': '|f4', 'fortran_order': False, 'shape': (6,)}\n", 24), "is not supported");
  expect_refused(image("{'descr': '<U3', 'fortran_order': False, 'shape': (2,)}\n", 24), "is not supported");
  expect_refused(image("{'descr': '|O', 'fortran_order': False, 'shape': (3,)}\n", 24), "is not supported");
  // Fortran order of a 2-d array
  expect_refused(image("{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3)}\n", 24), "Fortran");
  // data size
  expect_refused(image(ok, 23), "truncated");
  expect_refused(image(ok, 0), "truncated");
  expect_refused(image(ok, 25), "1 bytes after the data");
}

TEST(Npy, FileErrorsNameThePath) {
  const fs::path d = temp_dir();
  const std::string missing = (d / "nope.npy").string();
  try {
    npy::load(missing);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), missing + ": no such file");
    EXPECT_EQ(e.code(), ErrorCode::kIo);
  }
  try {
    npy::load(d.string());
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("is a directory"), std::string::npos);
  }
  // truncated on disk: every prefix of a valid file is refused, never crashes
  const std::vector<float> v(40, 1.0f);
  const auto img = npy::serialize(npy::Dtype::kFloat32, {5, 8}, v.data());
  for (std::size_t n = 0; n < img.size(); n += 7) {
    write_bytes(d / "t.npy", std::vector<uint8_t>(img.begin(), img.begin() + static_cast<std::ptrdiff_t>(n)));
    EXPECT_THROW(npy::load((d / "t.npy").string()), Error) << n;
  }
  // dtype / rank checks of load_checked
  npy::save((d / "f.npy").string(), {5, 8}, v.data());
  try {
    npy::load_checked((d / "f.npy").string(), npy::Dtype::kInt32, 2);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("f.npy: dtype is float32, expected int32"), std::string::npos) << e.what();
  }
  try {
    npy::load_checked((d / "f.npy").string(), npy::Dtype::kFloat32, 3);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("shape [5, 8] has 2 dimensions, expected 3"), std::string::npos) << e.what();
  }
  // cannot write into a missing directory
  EXPECT_THROW(npy::save((d / "no" / "x.npy").string(), {1}, v.data()), Error);
  // not regular files: a FIFO (opening it would block until a writer came) and a device behind a
  // symbolic link (/dev/zero never ends) are refused before they are opened
  ASSERT_EQ(::mkfifo((d / "fifo.npy").c_str(), 0600), 0);
  fs::create_symlink("/dev/zero", d / "zero.npy");
  for (const char* name : {"fifo.npy", "zero.npy"}) {
    try {
      npy::load((d / name).string());
      ADD_FAILURE() << name;
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()), (d / name).string() + ": not a regular file (a FIFO, socket or device)");
      EXPECT_EQ(e.code(), ErrorCode::kIo);
    }
  }
  fs::remove_all(d);
}

TEST(Npy, RandomCorruptionNeverCrashes) {
  const std::vector<int32_t> v(64, 7);
  const auto img = npy::serialize(npy::Dtype::kInt32, {8, 8}, v.data());
  uint32_t s = 12345;
  for (int trial = 0; trial < 3000; ++trial) {
    auto c = img;
    const int flips = 1 + trial % 4;
    for (int f = 0; f < flips; ++f) {
      s = s * 1664525u + 1013904223u;
      const std::size_t at = (s >> 8) % 128;  // inside the preamble and header
      s = s * 1664525u + 1013904223u;
      c[at] = static_cast<uint8_t>(s >> 24);
    }
    try {
      const auto a = npy::parse(c, "x");
      EXPECT_EQ(static_cast<int64_t>(a.bytes.size()), a.size() * static_cast<int64_t>(npy::itemsize(a.dtype)));
    } catch (const Error&) {
    }
  }
}

TEST(Npy, HalfConversions) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = npy::half_to_float(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    EXPECT_EQ(npy::float_to_half(f), h) << std::hex << h;
  }
  EXPECT_EQ(npy::float_to_half(65520.0f), 0x7c00);  // rounds to Inf
  EXPECT_EQ(npy::float_to_half(65504.0f), 0x7bff);
  EXPECT_EQ(npy::float_to_half(std::ldexp(1.0f, -25)), 0x0000);  // tie to even (0)
  EXPECT_EQ(npy::float_to_half(std::ldexp(1.5f, -25)), 0x0001);
  EXPECT_EQ(npy::float_to_half(1.0f + std::ldexp(1.0f, -11)), 0x3c00);  // tie to even
  EXPECT_EQ(npy::float_to_half(1.0f + std::ldexp(3.0f, -11)), 0x3c02);
}
