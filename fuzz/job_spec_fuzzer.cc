// Fuzzes ParseJobSpec (common/job_spec.h), which reads the job specs users submit. Any
// bytes must give a spec or an INVALID_ARGUMENT of one line of printable ASCII (the parser
// escapes what it quotes); an accepted spec must come back from JobSpecToJson as itself.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/job_spec.h"

namespace {

[[noreturn]] void Fail(const char* what, absl::string_view detail) {
  std::fprintf(stderr, "job_spec_fuzzer: %s: %.*s\n", what, static_cast<int>(detail.size()),
               detail.data());
  std::abort();
}

bool IsOneLine(absl::string_view message) {
  for (char c : message) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte < 0x20 || byte >= 0x7f) return false;
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view text(reinterpret_cast<const char*>(data), size);
  const absl::StatusOr<lathe::JobSpec> spec = lathe::ParseJobSpec(text, "job.yaml");
  if (!spec.ok()) {
    if (!absl::IsInvalidArgument(spec.status())) {
      Fail("not INVALID_ARGUMENT", spec.status().ToString());
    }
    if (!IsOneLine(spec.status().message())) {
      Fail("message is not one printable line", spec.status().ToString());
    }
    return 0;
  }
  const std::string json = lathe::JobSpecToJson(*spec);
  const absl::StatusOr<lathe::JobSpec> again = lathe::ParseJobSpec(json, "job.json");
  if (!again.ok()) Fail("JobSpecToJson's output is refused", again.status().ToString());
  if (lathe::JobSpecToJson(*again) != json) Fail("JobSpecToJson does not round-trip", json);
  return 0;
}
