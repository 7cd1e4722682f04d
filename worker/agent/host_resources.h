// What a worker has to offer, for its registration: host memory (common/host_memory.h) and
// the devices behind its slots. Reading the machine is kept apart from parsing, so that the
// parsers are tested on fixed text.
//
// Thread-safety: free functions; safe to call concurrently.
#ifndef LATHE_WORKER_AGENT_HOST_RESOURCES_H_
#define LATHE_WORKER_AGENT_HOST_RESOURCES_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/host_memory.h"  // HostMemoryBytes, ParseMemTotalBytes
#include "lathe/v1/coordinator.pb.h"
#include "worker/agent/process_launcher.h"

namespace lathe {

// One GPU as nvidia-smi lists it.
struct GpuInfo {
  int64_t index = 0;               // nvidia-smi's (physical) index
  std::string uuid;                // "GPU-..."
  std::string name;                // "NVIDIA H200"
  uint64_t memory_bytes = 0;       // total
  uint64_t memory_used_bytes = 0;  // in use by every process when asked
};

// Parses `nvidia-smi --query-gpu=index,uuid,name,memory.total,memory.used
// --format=csv,noheader,nounits` (memory in MiB). INVALID_ARGUMENT naming the line when one
// does not have these five fields.
absl::StatusOr<std::vector<GpuInfo>> ParseNvidiaSmiGpus(absl::string_view csv);

// Runs that nvidia-smi query. NOT_FOUND when nvidia-smi is missing, UNAVAILABLE when it fails.
absl::StatusOr<std::vector<GpuInfo>> QueryGpus(ProcessLauncher& launcher);

// The GPU of `gpus` that a CUDA_VISIBLE_DEVICES entry names (its index or its UUID); null
// when none does.
const GpuInfo* FindGpu(const std::vector<GpuInfo>& gpus, absl::string_view entry);

// The device memory in use on each slot's GPU (`slot_devices` as SlotCudaDevices gives
// them), for the agent's metrics: nvidia-smi is asked at most once per `max_age`, so that
// scrapes do not each start a process. A slot whose GPU nvidia-smi does not list, or every
// slot while nvidia-smi fails (logged once until it answers again), has no value.
//
// Thread-safety: thread-safe; a caller waits while another asks nvidia-smi.
class GpuMemoryProbe {
 public:
  // REQUIRES: `launcher` and `clock` outlive the probe.
  GpuMemoryProbe(ProcessLauncher* launcher, std::vector<std::string> slot_devices,
                 const Clock* clock, absl::Duration max_age);

  std::vector<std::optional<uint64_t>> UsedBytes();

 private:
  ProcessLauncher* const launcher_;
  const std::vector<std::string> slot_devices_;
  const Clock* const clock_;
  const absl::Duration max_age_;
  absl::Mutex mu_;
  std::optional<absl::Time> asked_ ABSL_GUARDED_BY(mu_);
  std::vector<std::optional<uint64_t>> used_ ABSL_GUARDED_BY(mu_);
  bool failing_ ABSL_GUARDED_BY(mu_) = false;
};

// The slots of a cuda agent started without --slots: one per GPU it may use, that is each
// entry of `visible_devices` (its CUDA_VISIBLE_DEVICES) when that is set, else each GPU
// nvidia-smi lists (`gpus`), else 1.
int64_t DefaultCudaSlots(absl::string_view visible_devices, const std::vector<GpuInfo>& gpus);

// The CUDA device each slot uses, as CUDA_VISIBLE_DEVICES entries: slot i gets entry i of
// `visible_devices` (the agent's own CUDA_VISIBLE_DEVICES, comma-separated) when that is
// set, else "i". INVALID_ARGUMENT when `visible_devices` lists fewer than `slots` devices.
absl::StatusOr<std::vector<std::string>> SlotCudaDevices(absl::string_view visible_devices,
                                                         int64_t slots);

// DeviceInfo for each slot: for cuda the GPU named by `slot_devices[i]` (an index or a UUID
// found in `gpus`; name "cuda" and no memory when unknown); for cpu one "cpu" entry per slot
// with an equal share of `host_memory_bytes`.
std::vector<v1::DeviceInfo> SlotDevices(v1::Device device, int64_t slots,
                                        const std::vector<std::string>& slot_devices,
                                        const std::vector<GpuInfo>& gpus,
                                        uint64_t host_memory_bytes);

}  // namespace lathe

#endif  // LATHE_WORKER_AGENT_HOST_RESOURCES_H_
