#include "planner/plan_proto.h"

#include "absl/strings/str_cat.h"
#include "common/proto/job_spec_proto.h"

namespace lathe {

v1::PlanJobResponse PlanResultToProto(const PlanResult& result, uint64_t memory_per_rank) {
  v1::PlanJobResponse out;
  *out.mutable_plan() = PlanToProto(result.plan);
  for (const Candidate& c : result.candidates) {
    v1::PlanCandidate* p = out.add_candidates();
    p->set_zero_stage(c.point.zero_stage);
    p->set_offload_optimizer(c.point.offload_optimizer);
    p->set_offload_params(c.point.offload_params);
    p->set_activation_checkpointing(c.point.activation_checkpointing);
    p->set_chunked_loss(c.point.chunked_loss);
    p->set_micro_batch(c.point.micro_batch);
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
