// The one RAII device allocation of src/ (the CUDA backend and `indexcp bench`). Self-contained (the
// CUDA runtime only) because it is the one header of cuda/ that bench may include (tests/test_layers.cpp).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <vector>

namespace indexcp::cuda::detail {

/// A device array of T (cudaMalloc / cudaFree). `Errors` keeps each user's own error texts:
///   static void check(cudaError_t, const char* what)  throws naming `what` when not cudaSuccess
///   kMalloc, kUpload, kDownload                        the `what` of the allocation and copies
///   kAllocateEmpty                                     the size constructor allocates even for 0
///                                                      (one element; else 0 leaves it null)
template <class T, class Errors>
class BasicDeviceBuffer {
 public:
  BasicDeviceBuffer() = default;
  explicit BasicDeviceBuffer(size_t n) {
    if (Errors::kAllocateEmpty)
      allocate(n);
    else
      resize(n);
  }
  /// A buffer of h.size() elements holding h.
  explicit BasicDeviceBuffer(const std::vector<T>& h) : BasicDeviceBuffer(h.size()) { upload(h.data(), h.size()); }
  ~BasicDeviceBuffer() { reset(); }
  BasicDeviceBuffer(const BasicDeviceBuffer&) = delete;
  BasicDeviceBuffer& operator=(const BasicDeviceBuffer&) = delete;
  BasicDeviceBuffer(BasicDeviceBuffer&& o) noexcept : p_(o.p_), n_(o.n_) { o.p_ = nullptr; o.n_ = 0; }
  BasicDeviceBuffer& operator=(BasicDeviceBuffer&& o) noexcept {
    if (this != &o) { reset(); p_ = o.p_; n_ = o.n_; o.p_ = nullptr; o.n_ = 0; }
    return *this;
  }
  /// Grows to at least n elements (contents not kept); never shrinks.
  void resize(size_t n) {
    if (n <= n_) return;
    reset();
    allocate(n);
  }
  void reset() {
    if (p_) cudaFree(p_);
    p_ = nullptr;
    n_ = 0;
  }
  T* get() const { return p_; }
  size_t size() const { return n_; }
  /// Copies n elements from host memory to the start of the buffer (synchronous cudaMemcpy).
  void upload(const T* host, size_t n) {
    Errors::check(cudaMemcpy(p_, host, n * sizeof(T), cudaMemcpyHostToDevice), Errors::kUpload);
  }
  /// The whole buffer, copied to the host (synchronous cudaMemcpy).
  std::vector<T> host() const {
    std::vector<T> h(n_);
    Errors::check(cudaMemcpy(h.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost), Errors::kDownload);
    return h;
  }

 private:
  void allocate(size_t n) {
    void* p = nullptr;
    Errors::check(cudaMalloc(&p, (n ? n : 1) * sizeof(T)), Errors::kMalloc);
    p_ = static_cast<T*>(p);
    n_ = n;
  }

  T* p_ = nullptr;
  size_t n_ = 0;
};

}  // namespace indexcp::cuda::detail
