// The backend resources one model works with: on CUDA its stream, library handles (cuBLAS,
// cuBLASLt and its workspace), the ops' internal scratch and workspaces, the prompt-prefill mode
// and the device caches of the launch helpers; on the CPU nothing yet (the thread pool is the
// machine's, shared by every model so that two models never oversubscribe the cores).
//
// Ops take no context argument: they run on the calling thread's current context, the one of
// the innermost ContextScope, or the process's default context of the active backend where no
// scope is open (single-op tests, tools). A model holds its context and opens a scope in each of
// its entry points, so two models (a target and a separate drafter model) can live in one process
// with their own streams and scratch, and a later multi-GPU engine gives each device its own.
//
// Ordering: ops of one context are ordered by its stream. Entering or leaving a scope whose
// context differs from the one before orders the two streams (the new one waits for what the old
// one had queued), so a program that switches contexts sees its ops in program order, exactly as
// with one stream; a scope that re-enters the current context costs nothing. A switch during a
// CUDA graph capture forks the other stream into the capture and joins it back on leaving.
#pragma once

#include <cstdint>
#include <memory>

#include "tandem/backend/ops.h"

namespace tandem::ops {

class Context : public std::enable_shared_from_this<Context> {
 public:
  // A new context on the active backend (ops::backend()); on CUDA on device `device`. Throws
  // Error if the device does not exist or its resources cannot be created.
  static std::shared_ptr<Context> create(int device = 0);
  // The context a model being built should hold: the current scope's, when one is open (a
  // drafter loaded inside its target's scope shares the target's stream and scratch), else a
  // new one.
  static std::shared_ptr<Context> for_new_model();

  ~Context();  // waits for the context's queued work, then frees its resources
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  Backend backend() const { return backend_; }
  int device() const { return device_; }
  // Unique in the process and never reused (graph keys include it: a graph captured with one
  // context's scratch never replays under another).
  uint64_t id() const { return id_; }
  // The backend's object (cuda::Context*), null on the CPU.
  void* native() const { return native_; }

 private:
  Context(Backend backend, int device, void* native);
  friend Context& default_context(Backend b);
  Backend backend_;
  int device_ = 0;
  uint64_t id_ = 0;
  void* native_ = nullptr;
};

// The process's default context of backend `b`, created on first use and never destroyed (it
// lives as long as the CUDA runtime). Ops outside any scope run on it.
Context& default_context(Backend b);
// The calling thread's current context: the innermost open scope's, else default_context of the
// active backend.
Context& current_context();

// Makes `context` current on this thread for a scope (restored on leaving, also by an exception),
// ordering the streams as described above. Scopes nest and must be left in reverse order (RAII
// does that). The context must outlive the scope.
class ContextScope {
 public:
  explicit ContextScope(Context& context);
  explicit ContextScope(const std::shared_ptr<Context>& context) : ContextScope(*context) {}
  ~ContextScope();
  ContextScope(const ContextScope&) = delete;
  ContextScope& operator=(const ContextScope&) = delete;

 private:
  Context* entered_;   // null: the scope re-entered the current context and changes nothing
  Context* previous_;  // the thread's scope context before this one (null: none)
  // The backend's own current context and device before this scope (unused without CUDA).
  [[maybe_unused]] void* previous_native_ = nullptr;
  [[maybe_unused]] int previous_device_ = -1;
};

}  // namespace tandem::ops
