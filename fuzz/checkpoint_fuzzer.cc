// Fuzzes the readers of a checkpoint's manifest.json and state.json
// (worker/engine/checkpoint.h): any bytes must give a result or DATA_LOSS.
#include <cstddef>
#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "fuzz/fuzz_check.h"
#include "worker/engine/checkpoint.h"

namespace {

void ExpectOkOrDataLoss(const absl::Status& status, const char* what) {
  if (!status.ok() && !absl::IsDataLoss(status)) {
    lathe::FuzzFail("checkpoint_fuzzer", what, "not DATA_LOSS: " + status.ToString());
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view text(reinterpret_cast<const char*>(data), size);
  ExpectOkOrDataLoss(lathe::ParseCheckpointManifest(text).status(), "ParseCheckpointManifest");
  ExpectOkOrDataLoss(lathe::ParseTrainingState(text, "/c/step-00000010/state.json").status(),
                     "ParseTrainingState");
  return 0;
}
