// A strict .npy reader/writer (see include/indexcp/npy.hpp).
#include "indexcp/npy.hpp"

#include <bit>
#include <cctype>
#include <cmath>
#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <system_error>

#include "core/file_util.hpp"
#include "indexcp/error.hpp"

namespace indexcp::npy {

static_assert(std::endian::native == std::endian::little,
              "the .npy reader/writer assumes a little-endian host");

namespace {

constexpr unsigned char kMagic[6] = {0x93, 'N', 'U', 'M', 'P', 'Y'};
constexpr std::size_t kMaxHeader = 1u << 20;  // far above anything NumPy writes
constexpr int kMaxDims = 32;

[[noreturn]] void fail(const std::string& name, const std::string& what) {
  throw Error(ErrorCode::kInvalidArgument, name + ": " + what);
}

// Printable form of a header excerpt for messages.
std::string excerpt(const std::string& s, std::size_t pos, std::size_t n = 24) {
  std::string out;
  for (std::size_t i = pos; i < s.size() && i < pos + n; ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c >= 0x20 && c < 0x7f) out += static_cast<char>(c);
    else out += "\\x" + std::string(1, "0123456789abcdef"[c >> 4]) + "0123456789abcdef"[c & 15];
  }
  return out.empty() ? "end of header" : "'" + out + "'";
}

// A value of the header dictionary (a Python literal restricted to what .npy headers hold).
struct Value {
  enum Kind { kString, kBool, kTuple, kInt, kOther } kind = kOther;
  std::string str;
  bool b = false;
  int64_t i = 0;
  std::vector<Value> items;
};

class HeaderParser {
 public:
  HeaderParser(const std::string& text, const std::string& name) : s_(text), name_(name) {}

  std::map<std::string, Value> parse_dict() {
    std::map<std::string, Value> out;
    skip_ws();
    expect('{', "the header does not start with '{' (not a dictionary)");
    skip_ws();
    while (peek() != '}') {
      if (peek() != '\'' && peek() != '"')
        bad("expected a quoted key at " + excerpt(s_, i_));
      const std::string key = parse_string();
      skip_ws();
      expect(':', "expected ':' after key '" + key + "'");
      skip_ws();
      Value v = parse_value();
      if (!out.emplace(key, std::move(v)).second) bad("key '" + key + "' appears twice");
      skip_ws();
      if (peek() == ',') {
        ++i_;
        skip_ws();
      } else if (peek() != '}') {
        bad("expected ',' or '}' at " + excerpt(s_, i_));
      }
    }
    ++i_;  // '}'
    // only whitespace (NumPy pads with spaces and ends with '\n') may follow
    while (i_ < s_.size()) {
      const char c = s_[i_];
      if (c != ' ' && c != '\n' && c != '\t' && c != '\r' && c != '\0')
        bad("unexpected text after the header dictionary: " + excerpt(s_, i_));
      ++i_;
    }
    return out;
  }

 private:
  [[noreturn]] void bad(const std::string& what) { fail(name_, "malformed .npy header: " + what); }
  char peek() const { return i_ < s_.size() ? s_[i_] : '\0'; }
  void skip_ws() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\t' || s_[i_] == '\n' || s_[i_] == '\r')) ++i_;
  }
  void expect(char c, const std::string& msg) {
    if (peek() != c) bad(msg);
    ++i_;
  }
  std::string parse_string() {
    const char q = s_[i_++];
    std::string out;
    while (true) {
      if (i_ >= s_.size()) bad("unterminated string");
      const char c = s_[i_++];
      if (c == q) break;
      if (c == '\\') bad("escape sequences are not supported in header strings");
      out += c;
    }
    return out;
  }
  // depth: 0 for a value of the dictionary, 1 inside a tuple (a simple header's only tuple, the
  // shape, holds integers: a nested tuple is refused, before any recursion can exhaust the stack)
  Value parse_value(int depth = 0) {
    Value v;
    const char c = peek();
    if (c == '\'' || c == '"') {
      v.kind = Value::kString;
      v.str = parse_string();
    } else if (s_.compare(i_, 4, "True") == 0) {
      v.kind = Value::kBool;
      v.b = true;
      i_ += 4;
    } else if (s_.compare(i_, 5, "False") == 0) {
      v.kind = Value::kBool;
      v.b = false;
      i_ += 5;
    } else if (c == '(') {
      if (depth > 0) bad("a tuple inside a tuple at " + excerpt(s_, i_) + " (shape must be a tuple of integers)");
      v.kind = Value::kTuple;
      ++i_;
      skip_ws();
      while (peek() != ')') {
        Value item = parse_value(depth + 1);
        v.items.push_back(std::move(item));
        if (v.items.size() > static_cast<std::size_t>(kMaxDims)) bad("tuple has more than 32 entries");
        skip_ws();
        if (peek() == ',') {
          ++i_;
          skip_ws();
        } else if (peek() != ')') {
          bad("expected ',' or ')' in a tuple at " + excerpt(s_, i_));
        }
      }
      ++i_;
    } else if (c == '-' || std::isdigit(static_cast<unsigned char>(c))) {
      v.kind = Value::kInt;
      bool neg = false;
      if (c == '-') {
        neg = true;
        ++i_;
      }
      if (!std::isdigit(static_cast<unsigned char>(peek()))) bad("malformed integer at " + excerpt(s_, i_));
      int64_t x = 0;
      while (std::isdigit(static_cast<unsigned char>(peek()))) {
        const int d = s_[i_++] - '0';
        if (x > (std::numeric_limits<int64_t>::max() - d) / 10) bad("integer too large in the header");
        x = x * 10 + d;
      }
      if (peek() == 'L' || peek() == 'l') ++i_;  // Python 2 long suffix
      v.i = neg ? -x : x;
    } else {
      // anything else (lists, dicts, None, floats) is not part of a valid simple header
      v.kind = Value::kOther;
      bad("unsupported value at " + excerpt(s_, i_));
    }
    return v;
  }

  const std::string& s_;
  const std::string& name_;
  std::size_t i_ = 0;
};

bool dtype_from_descr(const std::string& descr, Dtype* out) {
  // '<' little-endian, '|' not applicable (1-byte types), '=' native (little-endian here)
  static const struct {
    const char* code;
    Dtype d;
  } table[] = {{"f2", Dtype::kFloat16}, {"f4", Dtype::kFloat32}, {"i4", Dtype::kInt32},
               {"i8", Dtype::kInt64}, {"u1", Dtype::kUint8}};
  if (descr.size() != 3) return false;
  const char order = descr[0];
  const std::string code = descr.substr(1);
  for (const auto& e : table) {
    if (code != e.code) continue;
    if (e.d == Dtype::kUint8) {
      if (order != '|' && order != '<' && order != '=') return false;
    } else if (order != '<' && order != '=') {
      return false;
    }
    *out = e.d;
    return true;
  }
  return false;
}

std::string descr_of(Dtype d) {
  switch (d) {
    case Dtype::kFloat16: return "<f2";
    case Dtype::kFloat32: return "<f4";
    case Dtype::kInt32: return "<i4";
    case Dtype::kInt64: return "<i8";
    case Dtype::kUint8: return "|u1";
  }
  return "?";
}

}  // namespace

std::string dtype_name(Dtype d) {
  switch (d) {
    case Dtype::kFloat16: return "float16";
    case Dtype::kFloat32: return "float32";
    case Dtype::kInt32: return "int32";
    case Dtype::kInt64: return "int64";
    case Dtype::kUint8: return "uint8";
  }
  return "?";
}

std::size_t itemsize(Dtype d) {
  switch (d) {
    case Dtype::kFloat16: return 2;
    case Dtype::kFloat32: return 4;
    case Dtype::kInt32: return 4;
    case Dtype::kInt64: return 8;
    case Dtype::kUint8: return 1;
  }
  return 1;
}

// Bytes of an array of `shape` (entries >= 0) of `itemsize`-byte elements, or -1 when they exceed
// int64 (an empty shape entry makes 0 whatever the others): the reader's and the writer's rule.
int64_t data_bytes(const std::vector<int64_t>& shape, std::size_t itemsize) {
  unsigned __int128 bytes = itemsize;
  bool zero = false, over = false;
  for (int64_t d : shape) {
    if (d == 0) zero = true;
    if (!over) bytes *= static_cast<unsigned __int128>(d);
    if (bytes > static_cast<unsigned __int128>(std::numeric_limits<int64_t>::max())) over = true;
  }
  return zero ? 0 : over ? -1 : static_cast<int64_t>(bytes);
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

int64_t Array::size() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

Array parse(const std::vector<uint8_t>& f, const std::string& name) {
  if (f.empty()) fail(name, "empty file (not a .npy file)");
  // a file that starts as a .npy file but ends early is truncated, not of the wrong kind
  if (std::memcmp(f.data(), kMagic, std::min<std::size_t>(f.size(), 6)) != 0)
    fail(name, "not a .npy file (bad magic: the file must start with \\x93NUMPY)");
  if (f.size() < 8)
    fail(name, "file is truncated inside the .npy preamble (" + std::to_string(f.size()) +
                   " bytes of the 10 it takes)");
  const int major = f[6], minor = f[7];
  std::size_t header_len = 0, header_start = 0;
  if (major == 1 && minor == 0) {
    if (f.size() < 10) fail(name, "file is truncated inside the .npy preamble");
    header_len = static_cast<std::size_t>(f[8]) | (static_cast<std::size_t>(f[9]) << 8);
    header_start = 10;
  } else if (major == 2 && minor == 0) {
    if (f.size() < 12) fail(name, "file is truncated inside the .npy preamble");
    header_len = static_cast<std::size_t>(f[8]) | (static_cast<std::size_t>(f[9]) << 8) |
                 (static_cast<std::size_t>(f[10]) << 16) | (static_cast<std::size_t>(f[11]) << 24);
    header_start = 12;
  } else {
    fail(name, ".npy format version " + std::to_string(major) + "." + std::to_string(minor) +
                   " is not supported (1.0 and 2.0 are)");
  }
  if (header_len > kMaxHeader)
    fail(name, "header length " + std::to_string(header_len) + " is implausibly large (corrupt file)");
  if (header_start + header_len > f.size())
    fail(name, "file is truncated: the header claims " + std::to_string(header_len) + " bytes but only " +
                   std::to_string(f.size() - header_start) + " follow the preamble");
  const std::string header(reinterpret_cast<const char*>(f.data() + header_start), header_len);
  HeaderParser hp(header, name);
  const auto dict = hp.parse_dict();
  for (const auto& kv : dict)
    if (kv.first != "descr" && kv.first != "fortran_order" && kv.first != "shape")
      fail(name, "malformed .npy header: unknown key '" + kv.first + "' (expected descr, fortran_order, shape)");
  for (const char* k : {"descr", "fortran_order", "shape"})
    if (!dict.count(k)) fail(name, std::string("malformed .npy header: missing key '") + k + "'");

  const Value& descr = dict.at("descr");
  if (descr.kind != Value::kString)
    fail(name, "descr is not a simple dtype string (structured dtypes are not supported)");
  Array a;
  if (!dtype_from_descr(descr.str, &a.dtype)) {
    std::string why;
    if (!descr.str.empty() && descr.str[0] == '>') why = " (big-endian data is not supported; use little-endian)";
    fail(name, "dtype '" + descr.str + "' is not supported" + why +
                   "; supported: float16, float32, int32, int64, uint8 (little-endian)");
  }
  const Value& fo = dict.at("fortran_order");
  if (fo.kind != Value::kBool) fail(name, "malformed .npy header: fortran_order must be True or False");
  const Value& sh = dict.at("shape");
  if (sh.kind != Value::kTuple) fail(name, "malformed .npy header: shape must be a tuple of integers");
  for (const Value& v : sh.items) {
    if (v.kind != Value::kInt) fail(name, "malformed .npy header: shape must be a tuple of integers");
    if (v.i < 0) fail(name, "shape " + std::to_string(v.i) + " is negative");
    a.shape.push_back(v.i);
  }
  if (fo.b && a.shape.size() > 1)
    fail(name, "Fortran-ordered arrays are not supported; save a C-ordered array (np.ascontiguousarray)");

  // element count and byte count without overflow
  const std::size_t avail = f.size() - header_start - header_len;
  const int64_t bytes = data_bytes(a.shape, itemsize(a.dtype));
  if (bytes < 0) fail(name, "shape " + shape_string(a.shape) + " is too large (corrupt header?)");
  if (static_cast<uint64_t>(bytes) > avail)
    fail(name, "file is truncated: shape " + shape_string(a.shape) + " of " + dtype_name(a.dtype) + " needs " +
                   std::to_string(static_cast<uint64_t>(bytes)) + " data bytes but the file holds " +
                   std::to_string(avail));
  if (static_cast<uint64_t>(bytes) < avail)
    fail(name, "file has " + std::to_string(avail - static_cast<std::size_t>(bytes)) +
                   " bytes after the data of shape " + shape_string(a.shape) + " (corrupt or not one array)");
  const std::size_t off = header_start + header_len;
  a.bytes.assign(f.begin() + static_cast<std::ptrdiff_t>(off), f.end());
  return a;
}

Array load(const std::string& path) {
  // a regular file only: a FIFO or a device is refused before anything is read
  return parse(detail::read_regular_file(path, "", std::numeric_limits<std::uintmax_t>::max()), path);
}

Array load_checked(const std::string& path, Dtype dtype, int ndim) {
  Array a = load(path);
  if (a.dtype != dtype)
    fail(path, "dtype is " + dtype_name(a.dtype) + ", expected " + dtype_name(dtype));
  if (a.ndim() != ndim)
    fail(path, "shape " + shape_string(a.shape) + " has " + std::to_string(a.ndim()) + " dimensions, expected " +
                   std::to_string(ndim));
  return a;
}

std::vector<uint8_t> serialize(Dtype dtype, const std::vector<int64_t>& shape, const void* data) {
  std::string dict = "{'descr': '" + descr_of(dtype) + "', 'fortran_order': False, 'shape': (";
  if (shape.size() > static_cast<std::size_t>(kMaxDims))
    throw Error(ErrorCode::kInvalidArgument, "npy::save: shape has " + std::to_string(shape.size()) +
                                                 " dimensions; at most 32 (what parse reads back)");
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 0) throw Error(ErrorCode::kInvalidArgument, "npy::save: negative shape entry");
    dict += (i ? ", " : "") + std::to_string(shape[i]);
  }
  const int64_t array_bytes = data_bytes(shape, itemsize(dtype));  // the reader's rule
  if (array_bytes < 0) throw Error(ErrorCode::kInvalidArgument, "npy::save: shape " + shape_string(shape) + " is too large");
  const int64_t n = array_bytes / static_cast<int64_t>(itemsize(dtype));
  if (shape.size() == 1) dict += ",";
  dict += "), }";
  // pad with spaces so that preamble + header is a multiple of 64, ending in '\n'
  const bool v2 = dict.size() + 1 + 10 > 65535;
  const std::size_t pre = v2 ? 12 : 10;
  std::size_t total = pre + dict.size() + 1;
  const std::size_t pad = (64 - total % 64) % 64;
  dict.append(pad, ' ');
  dict += '\n';
  std::vector<uint8_t> out(kMagic, kMagic + 6);
  out.push_back(v2 ? 2 : 1);
  out.push_back(0);
  const std::size_t hl = dict.size();
  out.push_back(static_cast<uint8_t>(hl & 0xff));
  out.push_back(static_cast<uint8_t>((hl >> 8) & 0xff));
  if (v2) {
    out.push_back(static_cast<uint8_t>((hl >> 16) & 0xff));
    out.push_back(static_cast<uint8_t>((hl >> 24) & 0xff));
  }
  out.insert(out.end(), dict.begin(), dict.end());
  const std::size_t nbytes = static_cast<std::size_t>(n) * itemsize(dtype);
  if (nbytes) {
    if (!data) throw Error(ErrorCode::kInvalidArgument, "npy::save: data is null");
    const auto* p = static_cast<const uint8_t*>(data);
    out.insert(out.end(), p, p + nbytes);
  }
  return out;
}

void save(const std::string& path, Dtype dtype, const std::vector<int64_t>& shape, const void* data) {
  const auto bytes = serialize(dtype, shape, data);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw Error(ErrorCode::kIo, path + ": cannot open for writing");
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  out.close();
  if (!out) {
    std::error_code ec;
    std::filesystem::remove(path, ec);
    throw Error(ErrorCode::kIo, path + ": write error");
  }
}

float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while ((mant & 0x400u) == 0);
      mant &= 0x3ffu;
      bits = sign | (static_cast<uint32_t>(127 - 15 - e) << 23) | (mant << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 112u) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t float_to_half(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t au = u & 0x7fffffffu;
  if (au > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (au >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to >= 65520: Inf
  if (au < 0x38800000u) {  // below 2^-14: subnormal half (or zero)
    // value = au * 2^-24 units; shift the 24-bit significand, round half to even
    if (au < 0x33000000u) return sign;  // < 2^-25: rounds to 0 (2^-25 itself ties to 0)
    const uint32_t e = au >> 23;
    const uint32_t m = (au & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - e;  // 14 + (113 - e) - 1 ... result in units of 2^-24
    uint32_t r = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1);
    const uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return static_cast<uint16_t>(sign | r);
  }
  uint32_t r = au + 0xfffu + ((au >> 13) & 1u);
  r -= 0x38000000u;  // rebias 127 -> 15
  return static_cast<uint16_t>(sign | (r >> 13));
}

std::vector<float> to_float32(const Array& a, const std::string& name) {
  const int64_t n = a.size();
  std::vector<float> out(static_cast<std::size_t>(n));
  if (a.dtype == Dtype::kFloat32) {
    if (n) std::memcpy(out.data(), a.bytes.data(), static_cast<std::size_t>(n) * 4);
  } else if (a.dtype == Dtype::kFloat16) {
    const uint8_t* p = a.bytes.data();
    for (int64_t i = 0; i < n; ++i)
      out[i] = half_to_float(static_cast<uint16_t>(p[2 * i] | (p[2 * i + 1] << 8)));
  } else {
    fail(name, "dtype is " + dtype_name(a.dtype) + ", expected float16 or float32");
  }
  return out;
}

}  // namespace indexcp::npy
