// indexcp: a small, strict reader and writer of NumPy .npy files (used by the replay cases of
// spec/cases.md and by `indexcp run` for its data).
//
// Read: format versions 1.0 and 2.0, little-endian, C order, dtypes float16, float32, int32,
// int64 and uint8. Write: format 1.0 (2.0 only when the header would not fit in 1.0).
// Every malformed file is refused with indexcp::Error whose message starts with the file name and
// says what is wrong (bad magic, unsupported version, header not a dict, missing or unknown key,
// unsupported dtype or byte order, Fortran order, bad shape, truncated data, trailing bytes);
// a file that cannot be opened or read gives ErrorCode::kIo, a malformed one kInvalidArgument.
// The reader never allocates more than the file holds, so a corrupt shape cannot exhaust memory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace indexcp::npy {

/// Element types this module reads and writes.
enum class Dtype : int { kFloat16 = 0, kFloat32 = 1, kInt32 = 2, kInt64 = 3, kUint8 = 4 };

/// "float16" | "float32" | "int32" | "int64" | "uint8" (NumPy's names).
std::string dtype_name(Dtype d);
/// Bytes per element: 2, 4, 4, 8, 1.
std::size_t itemsize(Dtype d);
/// "[4, 33024, 128]" (NumPy shows tuples; this is the form used in messages).
std::string shape_string(const std::vector<int64_t>& shape);

/// An array as read from a file: dtype, shape (C order) and the raw little-endian element bytes.
struct Array {
  Dtype dtype = Dtype::kUint8;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;

  /// Number of elements (product of the shape; 1 for a 0-d array).
  int64_t size() const;
  int ndim() const { return static_cast<int>(shape.size()); }
  /// Element pointer; T must match dtype in size (checked only by the caller).
  template <class T>
  const T* data() const {
    return reinterpret_cast<const T*>(bytes.data());
  }
};

/// Parses a whole .npy file image; `name` is used in messages (usually the path).
Array parse(const std::vector<uint8_t>& file, const std::string& name);

/// Reads a .npy file. Errors: see the header comment.
Array load(const std::string& path);

/// Reads a .npy file and checks its dtype and number of dimensions; `what` names the array in
/// messages (e.g. "block_table.npy"). Throws Error "<path>: dtype is float32, expected int32".
Array load_checked(const std::string& path, Dtype dtype, int ndim);

/// Serializes an array (format 1.0, header padded to a multiple of 64 bytes).
std::vector<uint8_t> serialize(Dtype dtype, const std::vector<int64_t>& shape, const void* data);

/// Writes an array to `path` (format 1.0). `data` holds size * itemsize little-endian bytes.
/// Throws Error (kIo) naming the path if it cannot be written.
void save(const std::string& path, Dtype dtype, const std::vector<int64_t>& shape, const void* data);

/// Typed conveniences.
inline void save(const std::string& path, const std::vector<int64_t>& shape, const float* d) {
  save(path, Dtype::kFloat32, shape, d);
}
inline void save(const std::string& path, const std::vector<int64_t>& shape, const int32_t* d) {
  save(path, Dtype::kInt32, shape, d);
}
inline void save(const std::string& path, const std::vector<int64_t>& shape, const int64_t* d) {
  save(path, Dtype::kInt64, shape, d);
}
inline void save(const std::string& path, const std::vector<int64_t>& shape, const uint8_t* d) {
  save(path, Dtype::kUint8, shape, d);
}

/// IEEE binary16 -> binary32 (exact; NaN stays NaN, Inf stays Inf).
float half_to_float(uint16_t h);
/// binary32 -> binary16, round to nearest even (overflow -> Inf).
uint16_t float_to_half(float f);

/// The elements of a float16 or float32 array as float32 (Error naming `name` otherwise).
std::vector<float> to_float32(const Array& a, const std::string& name);

}  // namespace indexcp::npy
