// What the devices of each worker pool can do, for the planner's cost model and fit
// (docs/planner.md, "Device pools"). A pool is a kind of device: "cpu" holds every CPU
// worker; a GPU worker belongs to the first pool whose name its device name contains,
// ignoring case ("h100" holds "NVIDIA H100 80GB HBM3"). Defaults are compiled in for cpu,
// h100 and h200; the coordinator's --device-rates file overrides them and adds pools.
//
// Thread-safety: plain values and pure functions.
#ifndef LATHE_PLANNER_DEVICE_POOLS_H_
#define LATHE_PLANNER_DEVICE_POOLS_H_

#include <cstdint>
#include <map>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace lathe {

// What one rank's device can do.
struct DeviceRates {
  double flops = 0;                   // sustained FLOP/s of the matrix products
  double half_saturation_tokens = 0;  // tokens per micro-batch at which it runs at half rate
  double link_bytes_per_s = 0;        // between ranks, per rank (bus bandwidth of a ring)
  double host_link_bytes_per_s = 0;   // device <-> host memory (offload)
  uint64_t memory_bytes = 0;          // per rank; 0: unknown (the caller sets it)
};

using DevicePools = std::map<std::string, DeviceRates, std::less<>>;

// cpu (this kind of 2-core machine), h100 and h200.
DevicePools DefaultPools();

// A default pool's rates; INVALID_ARGUMENT naming the known pools otherwise.
absl::StatusOr<DeviceRates> DefaultRates(absl::string_view pool);

// The defaults overlaid by a --device-rates file's text, a JSON object of pools:
//   {"cpu": {"flops": 1.2e11}, "a100": {"flops": 1.2e14, "half_saturation_tokens": 1024,
//    "link_bytes_per_s": 2.4e11, "host_link_bytes_per_s": 2.5e10}}
// A default pool's fields default to its own; a new pool must give all four. Errors name
// `source` and the field: INVALID_ARGUMENT "<source>: <pool>.<field>: <problem>".
absl::StatusOr<DevicePools> ParseDevicePools(absl::string_view text, absl::string_view source);

// The pool of a device: "cpu" for the CPU; for a GPU the first pool (in name order) whose
// name `device_name` contains, ignoring case; "h100" when none does (an unknown GPU is
// planned like an H100 until the operator gives its pool).
std::string PoolOf(const DevicePools& pools, bool cuda, absl::string_view device_name);

}  // namespace lathe

#endif  // LATHE_PLANNER_DEVICE_POOLS_H_
