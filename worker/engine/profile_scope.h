// Named stretches of engine work for the profiler (docs/observability.md, "Profiling").
//
// A ProfileScope marks a stretch of work on the calling thread with a name: "forward/block.3",
// "backward", "comm/all_gather/unit.2". Two things see it:
//  - libtorch's profiler (Kineto): the scope is an at::RecordFunction (RecordScope::USER_SCOPE,
//    as Python's record_function), so it shows as a slice around the operators it encloses
//    in the Chrome trace;
//  - the memory recorder (memory_tracker.h): each allocation recorded while profiling names
//    the innermost scope of its thread (ProfileScope::Current()).
//
//   {
//     ProfileScope scope("forward/block", l);  // "forward/block.<l>"
//     x = Block(l, x, ...);
//   }
//
// Cost when nothing profiles: RecordFunction's check for active callbacks (a thread-local read
// and a branch), a push and a pop on a small thread-local array, and one relaxed atomic load
// (the CUDA scope listener). No allocation: the name is formatted only when Kineto records it.
//
// Scopes are per thread, as MemoryScope: work that ATen runs on its intra-op pool is inside
// the caller's scope in the Kineto trace (libtorch carries the profiler's state to the pool),
// but its allocations name no scope.
//
// Thread safety: a ProfileScope affects only the thread that creates it.
#ifndef LATHE_WORKER_ENGINE_PROFILE_SCOPE_H_
#define LATHE_WORKER_ENGINE_PROFILE_SCOPE_H_

#include <ATen/record_function.h>

#include <cstdint>
#include <string>

namespace lathe {

// A scope's name: `name`, with ".<index>" appended when index >= 0. `name` is a string
// literal (never freed), so that a ScopeName can be copied and kept for free.
struct ScopeName {
  const char* name = nullptr;  // null: outside every scope
  int64_t index = -1;

  bool empty() const { return name == nullptr; }
  std::string ToString() const;  // "" when empty
};

// Called on the calling thread whenever its innermost ProfileScope or its MemoryScope
// changes, while set (the CUDA memory history tags allocations through it:
// worker/train/profiler.cc). Null: none (the default).
using ScopeListener = void (*)();

class ProfileScope {
 public:
  // REQUIRES: `name` is a string literal; destroyed on the creating thread, in reverse order
  // of creation (scopes nest).
  explicit ProfileScope(const char* name, int64_t index = -1);
  ~ProfileScope();

  ProfileScope(const ProfileScope&) = delete;
  ProfileScope& operator=(const ProfileScope&) = delete;

  // The calling thread's innermost scope (empty outside every scope).
  static ScopeName Current();

  // Installs `listener` (null: removes it). Not synchronized with scopes being entered on
  // other threads: a change takes effect at their next scope.
  static void SetListener(ScopeListener listener);
  // Calls the listener, if any (MemoryScope calls it too).
  static void NotifyListener();

 private:
  // Declared before record_, so that it outlives the RecordFunction that may point into it.
  std::string formatted_;
  at::RecordFunction record_;
};

}  // namespace lathe

#endif  // LATHE_WORKER_ENGINE_PROFILE_SCOPE_H_
