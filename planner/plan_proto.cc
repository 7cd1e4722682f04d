#include "planner/plan_proto.h"

#include "absl/strings/str_cat.h"
#include "common/proto/job_spec_proto.h"

namespace lathe {

v1::PlanJobResponse PlanResultToProto(const PlanResult& result, uint64_t memory_per_rank) {
  v1::PlanJobResponse out;
  *out.mutable_plan() = PlanToProto(result.plan);
  for (const Candidate& c : result.candidates) {
    v1::PlanCandidate* p = out.add_candidates();
    *p->mutable_strategy() = StrategyToProto(c.point);
    *p->mutable_memory() = MemoryBytesToProto(c.memory.device);
    p->set_host_memory(c.memory.host);
    p->set_step_seconds(c.step_seconds);
    p->set_fits(c.fits);
    p->set_verdict(c.verdict);
    p->set_memory_correction(c.correction.factor);
  }
  out.set_tokens_per_second(result.tokens_per_second);
  out.set_memory_per_rank(memory_per_rank);
  return out;
}

}  // namespace lathe
