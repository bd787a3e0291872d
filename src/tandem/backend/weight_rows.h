// A weight's leading rows as a weight of its own: the head of a reduced draft vocabulary (token
// ids 0..rows-1). Row-major [rows, cols] storage makes the prefix a view, and an fp8 weight's
// row-block scales keep their grid (the prefix's scale rows are the first ones).
#pragma once

#include <cstdint>

#include "tandem/backend/ops.h"
#include "tandem/core/error.h"

namespace tandem::ops {

// The first `rows` rows of `w` (1 <= rows <= w.rows; throws Error naming `what` otherwise).
inline WeightRef leading_rows(const WeightRef& w, int64_t rows, const char* what) {
  if (rows < 1 || rows > w.rows)
    fail(what, ": ", rows, " leading rows asked of a weight of ", w.rows);
  WeightRef v = w;
  v.rows = rows;
  return v;
}

}  // namespace tandem::ops
