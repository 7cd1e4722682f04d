// Macros for propagating absl::Status and absl::StatusOr through call chains.
//
//   LATHE_RETURN_IF_ERROR(DoThing());
//   LATHE_ASSIGN_OR_RETURN(auto value, ComputeValue());
//
// Both return the failing status from the enclosing function unchanged. Thread-safe (they
// are expressions over their arguments).
#ifndef LATHE_COMMON_STATUS_MACROS_H_
#define LATHE_COMMON_STATUS_MACROS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

#define LATHE_RETURN_IF_ERROR(expr)                \
  do {                                             \
    ::absl::Status lathe_status_ = (expr);         \
    if (!lathe_status_.ok()) return lathe_status_; \
  } while (false)

#define LATHE_STATUS_CONCAT_INNER_(a, b) a##b
#define LATHE_STATUS_CONCAT_(a, b) LATHE_STATUS_CONCAT_INNER_(a, b)

#define LATHE_ASSIGN_OR_RETURN(lhs, expr) \
  LATHE_ASSIGN_OR_RETURN_IMPL_(LATHE_STATUS_CONCAT_(lathe_statusor_, __LINE__), lhs, expr)

#define LATHE_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, expr)  \
  auto statusor = (expr);                                  \
  if (!statusor.ok()) return std::move(statusor).status(); \
  lhs = std::move(statusor).value()

namespace lathe {

// Returns `status` with `context` prepended to its message ("context: message"), keeping
// the code. An OK status is returned unchanged.
inline absl::Status Annotate(const absl::Status& status, absl::string_view context) {
  if (status.ok()) return status;
  return absl::Status(status.code(), absl::StrCat(context, ": ", status.message()));
}

}  // namespace lathe

#endif  // LATHE_COMMON_STATUS_MACROS_H_
