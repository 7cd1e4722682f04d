// Closing the planner's loop (issue #11, docs/planner.md "Learning from measurements"): the
// ratio of every finished attempt's measured peak (the largest over its ranks) to the memory
// model's prediction, kept per calibration key, and the correction later plans apply.
//
// A key names what the memory model's error depends on: the model's shape, the method, the
// precision, the strategy (ZeRO stage, offload, checkpointing, loss, kernels), the ranks and
// the device pool, but not the micro-batch or the sequence length, so that one job's
// measurement corrects the other micro-batches the planner weighs for the same model. The
// correction is the mean ratio of the key's last kWindow attempts.
//
// Thread-safety: MemoryCalibration is a plain value (copy it to read it from another thread);
// CalibrationKey is a pure function.
#ifndef LATHE_PLANNER_CALIBRATION_H_
#define LATHE_PLANNER_CALIBRATION_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <string>

#include "absl/strings/string_view.h"
#include "planner/memory_model.h"

namespace lathe {

// "llama h512 L4 i1408 a8/4 d64 v8192 | lora r8 q,k,v,o | fp32 | ZeRO-2 ckpt fused | 2 x cpu".
std::string CalibrationKey(const JobShape& job, const Strategy& point, absl::string_view pool);

struct MemoryCorrection {
  double factor = 1.0;  // multiplies the memory model's per-rank peak
  int64_t samples = 0;  // attempts it was learned from; 0: no correction
};

class MemoryCalibration {
 public:
  static constexpr size_t kWindow = 8;

  // Records one attempt. Ignored when the key is empty, a number is 0 or the ratio is
  // outside [0.25, 4] (a measurement that cannot be of the predicted run).
  void Record(absl::string_view key, uint64_t predicted, uint64_t measured);

  // The correction for `key`; {1, 0} when nothing was recorded.
  MemoryCorrection Lookup(absl::string_view key) const;

  // Every key with its correction, ordered by key.
  std::map<std::string, MemoryCorrection> All() const;

 private:
  std::map<std::string, std::deque<double>, std::less<>> ratios_;
};

}  // namespace lathe

#endif  // LATHE_PLANNER_CALIBRATION_H_
