// Fuzzes ParseJobSpec (common/job_spec.h), which reads the job specs users submit. Any
// bytes must give a spec or an INVALID_ARGUMENT of one line of printable ASCII (the parser
// escapes what it quotes); an accepted spec must come back from JobSpecToJson as itself.
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/job_spec.h"
#include "common/json_fields.h"
#include "fuzz/fuzz_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view text(reinterpret_cast<const char*>(data), size);
  const absl::StatusOr<lathe::JobSpec> spec = lathe::ParseJobSpec(text, "job.yaml");
  if (!spec.ok()) {
    if (!absl::IsInvalidArgument(spec.status())) {
      lathe::FuzzFail("job_spec_fuzzer", "not INVALID_ARGUMENT", spec.status().ToString());
    }
    if (lathe::PrintableAscii(spec.status().message()) != spec.status().message()) {
      lathe::FuzzFail("job_spec_fuzzer", "message is not one printable line",
                      spec.status().ToString());
    }
    return 0;
  }
  const std::string json = lathe::JobSpecToJson(*spec);
  const absl::StatusOr<lathe::JobSpec> again = lathe::ParseJobSpec(json, "job.json");
  if (!again.ok())
    lathe::FuzzFail("job_spec_fuzzer", "JobSpecToJson's output is refused",
                    again.status().ToString());
  if (lathe::JobSpecToJson(*again) != json)
    lathe::FuzzFail("job_spec_fuzzer", "JobSpecToJson does not round-trip", json);
  return 0;
}
