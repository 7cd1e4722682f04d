#include "worker/engine/profile_scope.h"

#include <algorithm>
#include <array>
#include <atomic>

#include "absl/strings/str_cat.h"

namespace lathe {
namespace {

// Deeper nesting is counted but not stored: Current() then names the deepest stored scope.
constexpr int kMaxDepth = 64;

struct ScopeStack {
  std::array<ScopeName, kMaxDepth> names;
  int depth = 0;
};

thread_local ScopeStack scope_stack;

std::atomic<ScopeListener> scope_listener{nullptr};

}  // namespace

std::string ScopeName::ToString() const {
  if (name == nullptr) return "";
  return index < 0 ? std::string(name) : absl::StrCat(name, ".", index);
}

ProfileScope::ProfileScope(const char* name, int64_t index) : record_(at::RecordScope::USER_SCOPE) {
  ScopeStack& stack = scope_stack;
  if (stack.depth < kMaxDepth) stack.names[stack.depth] = {name, index};
  ++stack.depth;
  NotifyListener();
  if (record_.isActive()) {
    formatted_ = ScopeName{name, index}.ToString();
    record_.before(std::string_view(formatted_));
  }
}

ProfileScope::~ProfileScope() {
  --scope_stack.depth;
  NotifyListener();
}

ScopeName ProfileScope::Current() {
  const ScopeStack& stack = scope_stack;
  if (stack.depth == 0) return {};
  return stack.names[std::min(stack.depth, kMaxDepth) - 1];
}

void ProfileScope::NotifyListener() {
  if (ScopeListener listener = scope_listener.load(std::memory_order_relaxed)) listener();
}

void ProfileScope::SetListener(ScopeListener listener) {
  scope_listener.store(listener, std::memory_order_relaxed);
}

}  // namespace lathe
