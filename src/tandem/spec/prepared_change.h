// All-or-nothing state changes (DESIGN.md §1.4, §5.2): a change is fully built (allocations,
// validation) before anything visible changes; then either every change commits or none does.
#pragma once

#include <functional>
#include <memory>
#include <utility>
#include <vector>

namespace tandem::spec {

class PreparedChange {
 public:
  virtual ~PreparedChange() = default;
  // Makes the change visible. Must not throw: everything that can fail happened while preparing.
  virtual void commit() noexcept = 0;
  // Releases what preparing built; the state is as if nothing was prepared.
  virtual void dispose() noexcept = 0;
};

// A change whose commit and dispose are callbacks, each run at most once (whichever comes first
// wins); destroying it undone disposes it. The callbacks must not throw.
class CallbackChange : public PreparedChange {
 public:
  CallbackChange(std::function<void()> commit, std::function<void()> dispose)
      : commit_(std::move(commit)), dispose_(std::move(dispose)) {}
  ~CallbackChange() override { dispose(); }
  void commit() noexcept override {
    if (done_) return;
    done_ = true;
    commit_();
  }
  void dispose() noexcept override {
    if (done_) return;
    done_ = true;
    dispose_();
  }

 private:
  std::function<void()> commit_, dispose_;
  bool done_ = false;
};

using PrepareFn = std::function<std::unique_ptr<PreparedChange>()>;

// Prepares every change in order; if all succeed, commits them all. If one throws, disposes the
// ones already built and rethrows, leaving every state untouched.
void apply_changes(const std::vector<PrepareFn>& prepare);

}  // namespace tandem::spec
