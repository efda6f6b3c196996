// libFuzzer target: the replay case loader (replay_case: case.json, the .npy headers and
// contents, every cross-file check) and, for accepted cases, the replay itself.
//
// Input format: a sequence of records, each writing one file of the case directory:
//   byte 0: file id (low 3 bits: case.json, block_table.npy, seq_lens.npy, keys.npy, cache.npy,
//           q.npy, query_start.npy, expected_topk.npy); bit 7 set: a generated array
//   raw record (bit 7 clear): u16 length, then that many bytes written verbatim
//   generated record (bit 7 set): dtype byte (npy::Dtype), ndim (0..3), ndim u16 dims, a u8
//           value parameter: a valid .npy of that dtype and shape with deterministic contents
//           (ints: value parameter - 8 + i % 4 ... small ids; floats: a smooth pattern, with
//           NaN when the parameter is 0xFF). At most 2^20 elements.
// The case directory is a per-process temporary directory, emptied for every input; replay
// writes into a sibling output directory. Only indexcp::Error may escape.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "indexcp/error.hpp"
#include "indexcp/npy.hpp"
#include "indexcp/replay.hpp"

namespace fs = std::filesystem;

namespace {

const char* const kNames[8] = {"case.json", "block_table.npy", "seq_lens.npy",  "keys.npy",
                               "cache.npy", "q.npy",           "query_start.npy", "expected_topk.npy"};

struct Reader {
  const uint8_t* p;
  size_t n;
  uint8_t u8() {
    if (!n) return 0;
    --n;
    return *p++;
  }
  uint16_t u16() { return static_cast<uint16_t>(u8() | (u8() << 8)); }
};

// The per-process scratch directory, removed at exit.
struct Scratch {
  fs::path dir;
  Scratch() {
    const char* t = std::getenv("TMPDIR");
    dir = fs::path(t && *t ? t : "/tmp") / ("indexcp_fuzz_replay_" + std::to_string(::getpid()));
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  ~Scratch() {
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
};

const fs::path& base_dir() {
  static const Scratch s;
  return s.dir;
}

void write_bytes(const fs::path& p, const uint8_t* d, size_t n) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(d), static_cast<std::streamsize>(n));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace indexcp;
  const fs::path cdir = base_dir() / "case", odir = base_dir() / "out";
  std::error_code ec;
  fs::remove_all(cdir, ec);
  fs::remove_all(odir, ec);
  fs::create_directories(cdir);
  Reader rd{data, size};
  while (rd.n) {
    const uint8_t id = rd.u8();
    const fs::path f = cdir / kNames[id & 7];
    if (!(id & 0x80)) {
      const size_t len = std::min<size_t>(rd.u16(), rd.n);
      write_bytes(f, rd.p, len);
      rd.p += len;
      rd.n -= len;
      continue;
    }
    const auto dt = static_cast<npy::Dtype>(rd.u8() % 5);
    const int ndim = rd.u8() % 4;
    std::vector<int64_t> shape;
    int64_t count = 1;
    for (int i = 0; i < ndim; ++i) {
      shape.push_back(rd.u16());
      count *= shape.back();
    }
    const uint8_t param = rd.u8();
    if (count > (1 << 20)) continue;
    std::vector<uint8_t> bytes(static_cast<size_t>(count) * npy::itemsize(dt));
    for (int64_t i = 0; i < count; ++i) {
      switch (dt) {
        case npy::Dtype::kInt32: {
          const int32_t v = (param == 0xFF) ? static_cast<int32_t>(i * 128 + 1)  // seq_lens-like
                                            : static_cast<int32_t>(param) - 8 + static_cast<int32_t>(i % 4);
          std::memcpy(bytes.data() + i * 4, &v, 4);
          break;
        }
        case npy::Dtype::kInt64: {
          const int64_t v = static_cast<int64_t>(param) - 8 + i % 4;
          std::memcpy(bytes.data() + i * 8, &v, 8);
          break;
        }
        case npy::Dtype::kFloat32: {
          const float v = (param == 0xFF && i == count / 2) ? NAN : std::sin(0.37f * i + param) * 2.0f;
          std::memcpy(bytes.data() + i * 4, &v, 4);
          break;
        }
        case npy::Dtype::kFloat16: {
          const uint16_t v = npy::float_to_half(std::cos(0.11f * i + param));
          std::memcpy(bytes.data() + i * 2, &v, 2);
          break;
        }
        case npy::Dtype::kUint8:
          bytes[i] = static_cast<uint8_t>((i * 29 + param) % 0x7E);
          break;
      }
    }
    npy::save(f.string(), dt, shape, bytes.data());
  }
  try {
    const ReplayResult r = replay_case(cdir.string(), odir.string());
    if (static_cast<int64_t>(r.topk.size()) != r.rows * r.heads * r.topk_k) std::abort();
    (void)r.summary();
  } catch (const Error&) {
  }
  return 0;
}
