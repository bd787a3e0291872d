// The verify-window ops on the CPU: backend/window_rows.h's steps over every row or token, in
// order (a settled commit lists a slot once, so the order changes nothing).
#include <cstring>

#include "tandem/backend/cpu/cpu_ops.h"
#include "tandem/backend/window_rows.h"

namespace tandem::cpu {

void accept_windows(const int32_t* verified, const int32_t* ids, const int32_t* source,
                    const int32_t* from, const int32_t* bounds, const int32_t* limits,
                    int64_t n_rows, int32_t* accepted, int32_t* next) {
  for (int64_t r = 0; r < n_rows; ++r)
    window_rows::accept_row(verified, ids, source, from, bounds, limits, r, accepted, next);
}

void settle_windows(const int32_t* accepted, const ops::SettledRow* rows, int64_t n_rows,
                    int64_t* shift, ops::RecurrentRow* replay, int64_t layers) {
  for (int64_t i = 0; i < n_rows; ++i)
    window_rows::settle_row(accepted, rows, n_rows, i, shift, replay, layers);
}

void shift_positions(const ops::PositionShift& s, int64_t* positions, int64_t* kv_slots) {
  for (int64_t t = 0; t < s.tokens; ++t) window_rows::shift_token(s, t, positions, kv_slots);
  for (int64_t r = 0; r < s.rows; ++r) window_rows::shift_row_draw(s, r);
}

void gather_window_rows(const float* src, int64_t width, int64_t row_stride, int64_t at,
                        const int32_t* offsets, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i)
    std::memcpy(dst + i * width, src + window_rows::window_row(i, row_stride, at, offsets) * width,
                sizeof(float) * static_cast<size_t>(width));
}

}  // namespace tandem::cpu
