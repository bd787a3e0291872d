// An owning array in the memory of a backend (host memory on the CPU, device memory on CUDA):
// activations, workspaces, KV pools and recurrent states. The backend is the one active when the
// buffer first allocates; it never moves between backends.
#pragma once

#include <cstdint>
#include <utility>

#include "tandem/backend/ops.h"
#include "tandem/core/error.h"

namespace tandem {

template <class T>
class Buffer {
 public:
  Buffer() = default;
  explicit Buffer(int64_t n) { grow_to(n); }
  ~Buffer() { release(); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  Buffer(Buffer&& o) noexcept { *this = std::move(o); }
  Buffer& operator=(Buffer&& o) noexcept {
    if (this != &o) {
      release();
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
      where_ = o.where_;
    }
    return *this;
  }

  T* data() { return data_; }
  const T* data() const { return data_; }
  int64_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  ops::Backend where() const { return where_; }

  // Grows to at least n elements keeping the first size() elements; never shrinks (workspaces
  // are sized once per shape and reused, so the hot path does not allocate). New elements are
  // zero.
  void grow_to(int64_t n) {
    if (n <= size_) return;
    if (data_ && where_ != ops::backend())
      fail("Buffer::grow_to: buffer lives on ", ops::backend_name(where_), " but the active ",
           "backend is ", ops::backend_name(ops::backend()));
    const ops::Backend where = ops::backend();
    T* p = static_cast<T*>(ops::mem_alloc(where, sizeof(T) * static_cast<size_t>(n)));
    if (size_ > 0) ops::copy(p, data_, sizeof(T) * static_cast<size_t>(size_));
    ops::fill_zero(p + size_, sizeof(T) * static_cast<size_t>(n - size_));
    release();
    data_ = p;
    size_ = n;
    where_ = where;
  }
  void zero() { ops::fill_zero(data_, sizeof(T) * static_cast<size_t>(size_)); }

 private:
  T* data_ = nullptr;
  int64_t size_ = 0;
  ops::Backend where_ = ops::Backend::Cpu;
  void release() {
    if (data_) ops::mem_free(where_, data_);
    data_ = nullptr;
    size_ = 0;
  }
};

template <class T>
inline void grow_to(Buffer<T>& b, int64_t n) {
  b.grow_to(n);
}

}  // namespace tandem
