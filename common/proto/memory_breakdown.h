// MemoryBreakdown (proto/lathe/v1/job.proto) by MemoryComponent (common/memory_components.h),
// so that code which fills or reads a breakdown loops over the components instead of
// spelling the eight fields again.
//
// Thread-safety: pure functions.
#ifndef LATHE_COMMON_PROTO_MEMORY_BREAKDOWN_H_
#define LATHE_COMMON_PROTO_MEMORY_BREAKDOWN_H_

#include <cstdint>

#include "common/memory_components.h"
#include "lathe/v1/job.pb.h"

namespace lathe {

uint64_t ComponentBytes(const v1::MemoryBreakdown& memory, MemoryComponent component);
void SetComponentBytes(v1::MemoryBreakdown* memory, MemoryComponent component, uint64_t bytes);

// A plan's memory_correction as a factor: 0, from a plan stored before corrections existed,
// counts as 1.
double EffectiveCorrection(double stored);

// A prediction's total times a plan's memory_correction: the per-rank peak a job is placed by.
uint64_t CorrectedTotal(const v1::MemoryBreakdown& predicted, double correction);

}  // namespace lathe

#endif  // LATHE_COMMON_PROTO_MEMORY_BREAKDOWN_H_
