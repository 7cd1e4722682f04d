#include "planner/device_pools.h"

#include <nlohmann/json.hpp>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/json_fields.h"
#include "common/status_macros.h"

namespace lathe {

DevicePools DefaultPools() {
  DevicePools pools;
  // One thread per rank of a 2-core AVX-512 machine, float32 products through OpenBLAS,
  // gloo over loopback: fitted to 39 measured configurations (bench/plan_quality.py,
  // bench/RESULTS.md); memcpy for "offload" within the same memory.
  DeviceRates& cpu = pools["cpu"];
  cpu.flops = 80e9;
  cpu.half_saturation_tokens = 16;
  cpu.link_bytes_per_s = 0.8e9;
  cpu.host_link_bytes_per_s = 10e9;
  for (const char* gpu : {"h100", "h200"}) {
    // 40% of the bf16 dense peak; NVLink 4's ring bus bandwidth; PCIe 5 x16 to the host.
    DeviceRates& r = pools[gpu];
    r.flops = 0.4 * 989.4e12;
    r.half_saturation_tokens = 1024;
    r.link_bytes_per_s = 360e9;
    r.host_link_bytes_per_s = 50e9;
  }
  pools["h100"].memory_bytes = uint64_t{80} << 30;
  pools["h200"].memory_bytes = uint64_t{141} * 1000000000;
  return pools;
}

absl::StatusOr<DeviceRates> DefaultRates(absl::string_view pool) {
  const DevicePools pools = DefaultPools();
  auto it = pools.find(pool);
  if (it == pools.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("device rates: unknown pool \"", pool, "\" (known: cpu, h100, h200)"));
  }
  return it->second;
}

absl::StatusOr<DevicePools> ParseDevicePools(absl::string_view text, absl::string_view source) {
  const nlohmann::json json = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded() || !json.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": expected a JSON object of device pools"));
  }
  DevicePools pools = DefaultPools();
  for (const auto& [name, fields] : json.items()) {
    if (name.empty() || absl::AsciiStrToLower(name) != name) {
      return absl::InvalidArgumentError(
          absl::StrCat(source, ": \"", name, "\": a pool name must be lower case and not empty"));
    }
    if (!fields.is_object()) {
      return absl::InvalidArgumentError(
          absl::StrCat(source, ": ", name, ": expected an object of rates"));
    }
    const ConfigFields f(fields, source, name + ".");
    for (const auto& [key, value] : fields.items()) {
      if (key != "flops" && key != "half_saturation_tokens" && key != "link_bytes_per_s" &&
          key != "host_link_bytes_per_s") {
        return f.Error(key,
                       "unknown field (known: flops, half_saturation_tokens, link_bytes_per_s, "
                       "host_link_bytes_per_s)");
      }
    }
    const bool known = pools.count(name) > 0;
    DeviceRates& r = pools[name];
    const std::pair<const char*, double*> rates[] = {
        {"flops", &r.flops},
        {"half_saturation_tokens", &r.half_saturation_tokens},
        {"link_bytes_per_s", &r.link_bytes_per_s},
        {"host_link_bytes_per_s", &r.host_link_bytes_per_s},
    };
    for (const auto& [key, field] : rates) {
      LATHE_ASSIGN_OR_RETURN(*field, f.PositiveDouble(key, known ? *field : 0));
      if (*field == 0) return f.Error(key, "required for a pool without defaults");
    }
  }
  return pools;
}

std::string PoolOf(const DevicePools& pools, bool cuda, absl::string_view device_name) {
  if (!cuda) return "cpu";
  const std::string lower = absl::AsciiStrToLower(device_name);
  for (const auto& [name, rates] : pools) {
    if (name != "cpu" && absl::StrContains(lower, name)) return name;
  }
  return "h100";
}

}  // namespace lathe
