#include "tandem/spec/drafter_health.h"

#include <cstdio>

#include "tandem/core/error.h"

namespace tandem::spec {

DrafterHealth::DrafterHealth(DrafterHealthOptions options) : options_(options) {
  if (options_.window < 1) fail("drafter health: the window must hold at least one proposal");
  if (!(options_.floor >= 0.0 && options_.floor <= 1.0))
    fail("drafter health: the acceptance floor must be in [0, 1]");
}

bool DrafterHealth::record(int64_t drafted, int64_t accepted) {
  TANDEM_CHECK(drafted >= 0 && accepted >= 0 && accepted <= drafted, "drafter health: ", accepted,
               " accepted of ", drafted);
  if (collapsed_ || drafted == 0) return false;
  rounds_.push_back({drafted, accepted});
  drafted_ += drafted;
  accepted_ += accepted;
  // Keep the newest rounds that still fill the window.
  while (drafted_ - rounds_.front().drafted >= options_.window) {
    drafted_ -= rounds_.front().drafted;
    accepted_ -= rounds_.front().accepted;
    rounds_.pop_front();
  }
  if (drafted_ < options_.window) return false;
  if (acceptance() >= options_.floor) return false;
  collapsed_ = true;
  return true;
}

double DrafterHealth::acceptance() const {
  return drafted_ > 0 ? static_cast<double>(accepted_) / static_cast<double>(drafted_) : 0.0;
}

std::string drafter_collapse_message(const std::string& drafter_id, const DrafterHealth& health) {
  char share[32];
  std::snprintf(share, sizeof(share), "%.1f%%", 100.0 * health.acceptance());
  std::string msg = "drafter '" + drafter_id + "' collapsed: " + share + " of its last " +
                    std::to_string(health.window_proposals()) +
                    " first proposals were accepted, too few for speculation to pay. ";
  if (drafter_id == "qwen-mtp") {
    msg +=
        "Likely causes: --mtp-hidden does not match the hidden the MTP head was trained on (try "
        "the other of final / prenorm), a damaged quantization of the drafter, or a companion "
        "(--draft-model) made for another checkpoint. ";
  } else if (drafter_id == "eagle3") {
    msg +=
        "Likely causes: the head (--draft-model) was trained for another checkpoint of the same "
        "shape, its tap layers (eagle_config.eagle_aux_hidden_state_layer_ids) are not the ones "
        "it was trained on, or its weights are damaged. ";
  } else if (drafter_id == "ngram") {
    msg += "The text may simply not repeat itself (n-gram lookup needs repetition). ";
  } else {
    msg +=
        "Likely causes: a drafter made for another checkpoint, or a damaged quantization of the "
        "drafter. ";
  }
  msg += "Speculation is off (depth 0) for this engine; the output is unchanged.";
  return msg;
}

}  // namespace tandem::spec
