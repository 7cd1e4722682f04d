#include "worker/agent/host_resources.h"

#include <algorithm>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "common/file_util.h"
#include "common/status_macros.h"
#include "spdlog/spdlog.h"

namespace lathe {

absl::StatusOr<std::vector<GpuInfo>> ParseNvidiaSmiGpus(absl::string_view csv) {
  std::vector<GpuInfo> gpus;
  for (absl::string_view line : absl::StrSplit(csv, '\n', absl::SkipWhitespace())) {
    std::vector<absl::string_view> fields = absl::StrSplit(line, ',');
    GpuInfo gpu;
    uint64_t total_mib = 0;
    uint64_t used_mib = 0;
    if (fields.size() != 5 ||
        !absl::SimpleAtoi(absl::StripAsciiWhitespace(fields[0]), &gpu.index) ||
        !absl::SimpleAtoi(absl::StripAsciiWhitespace(fields[3]), &total_mib) ||
        !absl::SimpleAtoi(absl::StripAsciiWhitespace(fields[4]), &used_mib)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "nvidia-smi: expected \"index, uuid, name, memory total MiB, memory used MiB\", got \"",
          absl::StripAsciiWhitespace(line), "\""));
    }
    gpu.uuid = std::string(absl::StripAsciiWhitespace(fields[1]));
    gpu.name = std::string(absl::StripAsciiWhitespace(fields[2]));
    gpu.memory_bytes = total_mib << 20;
    gpu.memory_used_bytes = used_mib << 20;
    gpus.push_back(std::move(gpu));
  }
  return gpus;
}

absl::StatusOr<std::vector<GpuInfo>> QueryGpus(ProcessLauncher& launcher) {
  absl::Mutex mu;
  std::string out;
  std::string err;
  LaunchOptions options;
  options.argv = {"nvidia-smi", "--query-gpu=index,uuid,name,memory.total,memory.used",
                  "--format=csv,noheader,nounits"};
  options.on_stdout_line = [&](absl::string_view line) {
    absl::MutexLock lock(&mu);
    absl::StrAppend(&out, line, "\n");
  };
  options.on_stderr_line = [&](absl::string_view line) {
    absl::MutexLock lock(&mu);
    absl::StrAppend(&err, line, "\n");
  };
  LATHE_ASSIGN_OR_RETURN(std::unique_ptr<ChildProcess> child, launcher.Launch(std::move(options)));
  ExitStatus status = child->Wait();
  absl::MutexLock lock(&mu);
  if (!status.success()) {
    return absl::UnavailableError(
        absl::StrCat("nvidia-smi ", status.ToString(), ": ", absl::StripAsciiWhitespace(err)));
  }
  return ParseNvidiaSmiGpus(out);
}

int64_t DefaultCudaSlots(absl::string_view visible_devices, const std::vector<GpuInfo>& gpus) {
  const std::vector<absl::string_view> entries =
      absl::StrSplit(visible_devices, ',', absl::SkipWhitespace());
  if (!entries.empty()) return static_cast<int64_t>(entries.size());
  return std::max<int64_t>(1, static_cast<int64_t>(gpus.size()));
}

absl::StatusOr<std::vector<std::string>> SlotCudaDevices(absl::string_view visible_devices,
                                                         int64_t slots) {
  std::vector<std::string> devices;
  if (absl::StripAsciiWhitespace(visible_devices).empty()) {
    for (int64_t i = 0; i < slots; ++i) devices.push_back(absl::StrCat(i));
    return devices;
  }
  for (absl::string_view entry : absl::StrSplit(visible_devices, ',', absl::SkipWhitespace())) {
    devices.emplace_back(absl::StripAsciiWhitespace(entry));
  }
  if (static_cast<int64_t>(devices.size()) < slots) {
    return absl::InvalidArgumentError(absl::StrCat("--slots ", slots, ": CUDA_VISIBLE_DEVICES=\"",
                                                   visible_devices, "\" names only ",
                                                   devices.size(), " devices"));
  }
  devices.resize(static_cast<size_t>(slots));
  return devices;
}

std::vector<v1::DeviceInfo> SlotDevices(v1::Device device, int64_t slots,
                                        const std::vector<std::string>& slot_devices,
                                        const std::vector<GpuInfo>& gpus,
                                        uint64_t host_memory_bytes) {
  std::vector<v1::DeviceInfo> devices;
  for (int64_t slot = 0; slot < slots; ++slot) {
    v1::DeviceInfo& info = devices.emplace_back();
    info.set_index(slot);
    if (device != v1::DEVICE_CUDA) {
      info.set_name("cpu");
      info.set_memory_bytes(host_memory_bytes / static_cast<uint64_t>(slots));
      continue;
    }
    info.set_name("cuda");
    if (static_cast<size_t>(slot) >= slot_devices.size()) continue;
    if (const GpuInfo* gpu = FindGpu(gpus, slot_devices[static_cast<size_t>(slot)])) {
      info.set_name(gpu->name);
      info.set_memory_bytes(gpu->memory_bytes);
    }
  }
  return devices;
}

const GpuInfo* FindGpu(const std::vector<GpuInfo>& gpus, absl::string_view entry) {
  for (const GpuInfo& gpu : gpus) {
    if (gpu.uuid == entry || absl::StrCat(gpu.index) == entry) return &gpu;
  }
  return nullptr;
}

GpuMemoryProbe::GpuMemoryProbe(ProcessLauncher* launcher, std::vector<std::string> slot_devices,
                               const Clock* clock, absl::Duration max_age)
    : launcher_(launcher),
      slot_devices_(std::move(slot_devices)),
      clock_(clock),
      max_age_(max_age),
      used_(slot_devices_.size()) {}

std::vector<std::optional<uint64_t>> GpuMemoryProbe::UsedBytes() {
  absl::MutexLock lock(&mu_);
  const absl::Time now = clock_->Now();
  if (asked_ && now - *asked_ < max_age_) return used_;
  asked_ = now;
  used_.assign(slot_devices_.size(), std::nullopt);
  absl::StatusOr<std::vector<GpuInfo>> gpus = QueryGpus(*launcher_);
  if (!gpus.ok()) {
    if (!failing_) spdlog::warn("device memory in use unknown: {}", gpus.status().ToString());
    failing_ = true;
    return used_;
  }
  failing_ = false;
  for (size_t slot = 0; slot < slot_devices_.size(); ++slot) {
    if (const GpuInfo* gpu = FindGpu(*gpus, slot_devices_[slot])) {
      used_[slot] = gpu->memory_used_bytes;
    }
  }
  return used_;
}

}  // namespace lathe
