#include "coordinator/store/schema1_records.h"

#include <cstdint>
#include <map>
#include <set>
#include <string>

#include "google/protobuf/unknown_field_set.h"

namespace lathe {
namespace {

using google::protobuf::Message;
using google::protobuf::UnknownField;
using google::protobuf::UnknownFieldSet;

// Unknown fields by number: varints (the last occurrence wins, as for a scalar) and
// length-delimited fields (every occurrence, in order: a repeated string's).
struct OldFields {
  std::map<int, uint64_t> varints;
  std::multimap<int, std::string> strings;
  bool Has(int number) const { return varints.count(number) > 0 || strings.count(number) > 0; }
  uint64_t Varint(int number) const {
    auto it = varints.find(number);
    return it == varints.end() ? 0 : it->second;
  }
};

OldFields Read(const UnknownFieldSet& set) {
  OldFields out;
  for (int i = 0; i < set.field_count(); ++i) {
    const UnknownField& f = set.field(i);
    if (f.type() == UnknownField::TYPE_VARINT) out.varints[f.number()] = f.varint();
    if (f.type() == UnknownField::TYPE_LENGTH_DELIMITED) {
      out.strings.emplace(f.number(), f.length_delimited());
    }
  }
  return out;
}

// The unknown fields of `message`, removed from it.
OldFields Take(Message* message) {
  UnknownFieldSet* set = message->GetReflection()->MutableUnknownFields(message);
  OldFields out = Read(*set);
  set->Clear();
  return out;
}

void MigrateSpec(v1::JobSpec* spec) {
  const OldFields train = Take(spec->mutable_train());
  const OldFields root = Take(spec);
  v1::Strategy* strategy = spec->mutable_strategy();
  if (train.Varint(4) > 0) strategy->set_micro_batch(static_cast<int64_t>(train.Varint(4)));
  auto old_strategy = root.strings.find(8);
  if (old_strategy == root.strings.end()) return;  // absent: auto
  UnknownFieldSet parsed;
  if (!parsed.ParseFromString(old_strategy->second)) return;
  const OldFields s = Read(parsed);
  if (s.Has(7)) strategy->set_fused_kernels(s.Varint(7) != 0);
  if (s.Varint(1) != 0) return;  // automatic: the planner chooses every field
  std::set<std::string> chosen_by_planner;
  for (auto [it, end] = s.strings.equal_range(8); it != end; ++it) {
    chosen_by_planner.insert(it->second);
  }
  auto fixed = [&](const char* name) { return chosen_by_planner.count(name) == 0; };
  if (fixed("zero_stage")) strategy->set_zero_stage(static_cast<int64_t>(s.Varint(2)));
  if (fixed("offload_optimizer")) strategy->set_offload_optimizer(s.Varint(3) != 0);
  if (fixed("offload_params")) strategy->set_offload_params(s.Varint(4) != 0);
  if (fixed("activation_checkpointing")) {
    strategy->set_activation_checkpointing(s.Varint(5) != 0);
  }
  if (fixed("chunked_loss")) strategy->set_chunked_loss(s.Varint(6) != 0);
}

void MigratePlan(v1::Plan* plan) {
  const OldFields p = Take(plan);
  if (!p.Has(3) && !p.Has(4) && !p.Has(5) && !p.Has(6) && !p.Has(7) && !p.Has(8) && !p.Has(14)) {
    return;
  }
  v1::Strategy* strategy = plan->mutable_strategy();
  strategy->set_zero_stage(static_cast<int64_t>(p.Varint(3)));
  strategy->set_offload_optimizer(p.Varint(4) != 0);
  strategy->set_offload_params(p.Varint(5) != 0);
  strategy->set_activation_checkpointing(p.Varint(6) != 0);
  strategy->set_chunked_loss(p.Varint(7) != 0);
  strategy->set_micro_batch(static_cast<int64_t>(p.Varint(8)));
  strategy->set_fused_kernels(p.Varint(14) != 0);  // a plain bool: absent was false
}

}  // namespace

void MigrateSchema1Record(v1::JobStatus* job) {
  if (job->has_spec()) MigrateSpec(job->mutable_spec());
  if (job->has_plan()) MigratePlan(job->mutable_plan());
}

}  // namespace lathe
