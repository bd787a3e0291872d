#include "tandem/spec/checkpoint.h"

#include "tandem/core/error.h"
#include "tandem/core/tensor.h"

namespace tandem::spec {

void check_checkpoint(const Checkpoint& c, const std::string& who, const std::string& schema,
                      const std::string& ns, int64_t processed_tokens) {
  if (c.schema != schema)
    fail(who, ": checkpoint schema '", c.schema, "' cannot be restored (expected '", schema, "')");
  if (c.ns != ns)
    fail(who, ": checkpoint namespace '", c.ns, "' does not match this drafter ('", ns,
         "'): it was captured with other weights or another target");
  if (c.processed_tokens != processed_tokens)
    fail(who, ": checkpoint covers ", c.processed_tokens, " tokens but the row has ",
         processed_tokens, " (token alignment mismatch)");
}

const CheckpointTensor& checkpoint_tensor(const Checkpoint& c, const std::string& who,
                                          const char* name, const std::vector<int64_t>& want) {
  auto it = c.tensors.find(name);
  if (it == c.tensors.end()) fail(who, ": checkpoint (", c.schema, ") has no tensor '", name, "'");
  const CheckpointTensor& t = it->second;
  int64_t numel = 1;
  for (int64_t d : want) numel *= d;
  if (t.shape != want || static_cast<int64_t>(t.data.size()) != numel)
    fail(who, ": checkpoint tensor '", name, "' has shape ", shape_str(t.shape), " (",
         t.data.size(), " values), expected ", shape_str(want),
         " (captured by a drafter of another shape?)");
  return t;
}

}  // namespace tandem::spec
