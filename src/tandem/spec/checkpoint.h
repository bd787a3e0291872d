// Drafter state snapshots that outlive a batch row (DESIGN.md §5.2): what a drafter knew after
// exactly `processed_tokens` target tokens, restorable into a fresh row of a compatible drafter.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace tandem::spec {

struct CheckpointTensor {
  std::vector<int64_t> shape;
  std::vector<float> data;
};

// Immutable once built; shared between whoever holds it (a request, a prefix cache).
struct Checkpoint {
  int64_t processed_tokens = 0;  // target tokens the drafter state covers
  std::string schema;            // "qwen-mtp-v1", "ngram-history-v1", ...
  std::string ns;                // the drafter namespace it was captured under (identity)
  nlohmann::json metadata;       // schema-specific scalars
  std::map<std::string, CheckpointTensor> tensors;
  std::vector<int32_t> tokens;  // token history, for drafters that keep one
  // The state knows the tokens from here on only: a row that adopted a cached prefix without a
  // checkpoint of its namespace (DraftRows::adopt_prefix) starts its history there. Such a state
  // is not the one a cold prefill reaches, so the prefix cache never keeps it.
  int64_t history_from = 0;
};

using CheckpointPtr = std::shared_ptr<const Checkpoint>;

// Throws tandem::Error unless `c` has the expected schema and namespace and covers exactly
// `processed_tokens` tokens; `who` names the drafter in the message.
void check_checkpoint(const Checkpoint& c, const std::string& who, const std::string& schema,
                      const std::string& ns, int64_t processed_tokens);

// The tensor `name` of `c` (whose schema check_checkpoint has passed), which must have shape
// `want` and as many values; throws tandem::Error naming `who`, the schema and both shapes.
const CheckpointTensor& checkpoint_tensor(const Checkpoint& c, const std::string& who,
                                          const char* name, const std::vector<int64_t>& want);

}  // namespace tandem::spec
