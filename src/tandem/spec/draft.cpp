#include "tandem/spec/draft.h"

#include "tandem/core/error.h"

namespace tandem::spec {

std::string HiddenTaps::describe() const {
  if (hidden) return hidden_tap_name(*hidden);
  if (layers.empty()) return "none";
  std::string s = "layers [";
  for (size_t i = 0; i < layers.size(); ++i) s += (i ? ", " : "") + std::to_string(layers[i]);
  return s + "]";
}

void check_target_taps(const TargetView& target, const HiddenTaps& taps, const std::string& who) {
  TANDEM_CHECK(!(taps.hidden && !taps.layers.empty()), "a drafter asks for one kind of tap");
  if (taps.hidden && !target.can_tap(*taps.hidden))
    fail(who, ": the target cannot provide the ", hidden_tap_name(*taps.hidden),
         " hidden state this drafter consumes");
  for (int layer : taps.layers)
    if (!target.can_tap_layer(layer))
      fail(who, ": the target cannot tap the input of layer ", layer, " (it has ",
           target.layer_count(), " layers, so taps must be in [0, ", target.layer_count(),
           "); this target ", target.can_tap_layer(0) ? "taps any of them" : "taps no layer", ")");
}

std::unique_ptr<PreparedChange> DraftRows::prepare_copy_rows(const DraftRows& from,
                                                             std::span<const int> rows) {
  if (from.ns() != ns())
    fail("copy_rows: the rows come from drafter namespace '", from.ns(), "', these are '", ns(),
         "'");
  std::vector<CheckpointPtr> ckpts;
  ckpts.reserve(rows.size());
  for (int r : rows) ckpts.push_back(from.capture(r));
  return prepare_append(ckpts);
}

}  // namespace tandem::spec
