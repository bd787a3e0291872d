#include "tandem/model/position_cache.h"

#include <algorithm>

#include "tandem/core/error.h"

namespace tandem {

void PositionCache::append(const float* src, int64_t n, int64_t stride) {
  TANDEM_CHECK(n >= 0 && stride >= width_, "PositionCache::append: ", n, " entries of stride ",
               stride, " into entries of ", width_);
  if (n == 0 || width_ == 0) {
    length_ += n;
    return;
  }
  const int64_t need = (length_ + n) * width_;
  if (need > entries_.size())
    entries_.grow_to(std::max(need, std::max<int64_t>(2 * entries_.size(), 16 * width_)));
  ops::copy_rows(entries_.data() + length_ * width_, width_, src, stride, n, width_);
  length_ += n;
}

void PositionCache::truncate(int64_t length) {
  TANDEM_CHECK(length >= 0 && length <= length_, "PositionCache::truncate: to ", length, " of ",
               length_, " entries");
  length_ = length;
}

void PositionCache::release() {
  entries_ = Buffer<float>();
  length_ = 0;
}

std::vector<float> PositionCache::to_host(int64_t length) const {
  TANDEM_CHECK(length >= 0 && length <= length_, "PositionCache::to_host: ", length, " of ",
               length_, " entries");
  std::vector<float> out(static_cast<size_t>(length * width_));
  if (!out.empty()) ops::copy_to_host(out.data(), entries_.data(), sizeof(float) * out.size());
  return out;
}

void PositionCache::assign_host(std::span<const float> values) {
  TANDEM_CHECK(width_ > 0 || values.empty(), "PositionCache::assign_host: entries of width 0");
  const int64_t n = width_ > 0 ? static_cast<int64_t>(values.size()) / width_ : 0;
  TANDEM_CHECK(n * width_ == static_cast<int64_t>(values.size()),
               "PositionCache::assign_host: ", values.size(), " values are not whole entries of ",
               width_);
  if (n * width_ > entries_.size()) entries_.grow_to(n * width_);
  if (n > 0) ops::copy_from_host(entries_.data(), values.data(), sizeof(float) * values.size());
  length_ = n;
}

}  // namespace tandem
