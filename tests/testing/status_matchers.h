// gmock matchers for absl::Status and absl::StatusOr:
//   EXPECT_THAT(DoThing(), StatusIs(absl::StatusCode::kNotFound, "no such file"));
// matches when the code is equal and the message contains the fragment.
#ifndef LATHE_TESTS_TESTING_STATUS_MATCHERS_H_
#define LATHE_TESTS_TESTING_STATUS_MATCHERS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "gmock/gmock.h"

namespace lathe::testing {

inline const absl::Status& GetStatus(const absl::Status& status) { return status; }
template <typename T>
const absl::Status& GetStatus(const absl::StatusOr<T>& status_or) {
  return status_or.status();
}

MATCHER_P2(StatusIs, code, fragment, "") {
  const absl::Status& status = GetStatus(arg);
  *result_listener << "status is " << status;
  return status.code() == code && status.message().find(fragment) != absl::string_view::npos;
}

}  // namespace lathe::testing

#endif  // LATHE_TESTS_TESTING_STATUS_MATCHERS_H_
