#include "tandem/spec/checkpoint.h"

#include "tandem/core/error.h"

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

}  // namespace tandem::spec
