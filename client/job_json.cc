#include "client/job_json.h"

#include <cmath>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "client/status_text.h"
#include "common/job_spec.h"
#include "common/memory_components.h"
#include "common/proto/job_spec_proto.h"
#include "common/proto/memory_breakdown.h"

namespace lathe {
namespace {

using Json = nlohmann::ordered_json;

// The schema's word for an enum value: its proto name, lowercase, without the prefix.
// "unknown" for UNSPECIFIED and for a value this client has no name for (a newer
// coordinator's), so that scripts see one word for "not a state I can name".
std::string EnumWord(const std::string& proto_name, absl::string_view prefix) {
  if (proto_name.empty() || absl::EndsWith(proto_name, "_UNSPECIFIED")) return "unknown";
  return absl::AsciiStrToLower(absl::StripPrefix(proto_name, prefix));
}

// UNSPECIFIED is the documented default for a device (cpu) and a precision (fp32).
std::string DeviceWord(v1::Device device) {
  if (device == v1::DEVICE_UNSPECIFIED) return "cpu";
  return EnumWord(v1::Device_Name(device), "DEVICE_");
}

std::string PrecisionWord(v1::Precision precision) {
  if (precision == v1::PRECISION_UNSPECIFIED) return "fp32";
  return EnumWord(v1::Precision_Name(precision), "PRECISION_");
}

// JSON has no spelling for NaN or infinity: such a value (a diverged loss or gradient norm)
// is null.
Json Number(double value) { return std::isfinite(value) ? Json(value) : Json(nullptr); }

Json Number(std::optional<double> value) {
  return value.has_value() ? Number(*value) : Json(nullptr);
}

Json PhasesJson(const v1::StepPhases& phases) {
  return Json{{"forward", Number(phases.forward())},
              {"loss", Number(phases.loss())},
              {"backward", Number(phases.backward())},
              {"comm", Number(phases.comm())},
              {"optimizer", Number(phases.optimizer())}};
}

Json PlanJson(const v1::Plan& plan) {
  // The memory techniques the planner chose (null: the spec's), in the spec's words.
  Json method = nullptr, optimizer = nullptr;
  if (absl::StatusOr<Plan> typed = PlanFromProto(plan, "plan"); typed.ok()) {
    if (typed->method) method = std::string(MethodName(*typed->method));
    if (typed->optimizer) optimizer = std::string(OptimizerKindName(*typed->optimizer));
  }
  return Json{{"ranks", plan.ranks()},
              {"device", DeviceWord(plan.device())},
              {"zero_stage", plan.strategy().zero_stage()},
              {"offload_optimizer", plan.strategy().offload_optimizer()},
              {"offload_params", plan.strategy().offload_params()},
              {"activation_checkpointing", plan.strategy().activation_checkpointing()},
              {"chunked_loss", plan.strategy().chunked_loss()},
              {"fused_kernels", plan.strategy().fused_kernels()},
              {"micro_batch", plan.strategy().micro_batch()},
              {"gradient_accumulation", plan.gradient_accumulation()},
              {"total_steps", plan.total_steps()},
              {"precision", PrecisionWord(plan.precision())},
              {"predicted_memory", MemoryJson(plan.predicted_memory())},
              {"memory_correction", EffectiveCorrection(plan.memory_correction())},
              {"calibration_key", plan.calibration_key()},
              {"method", std::move(method)},
              {"optimizer", std::move(optimizer)},
              {"explanation", plan.explanation()}};
}

}  // namespace

Json ProfileJson(const v1::ProfileCapture& capture) {
  Json files = Json::array();
  for (const v1::ProfileFile& f : capture.files()) {
    files.push_back(Json{{"rank", f.rank()}, {"name", f.name()}, {"size", f.size()}});
  }
  Json results = Json::array();
  for (const v1::ProfileRankResult& r : capture.results()) {
    results.push_back(Json{{"rank", r.rank()},
                           {"first_step", r.first_step()},
                           {"last_step", r.last_step()},
                           {"error", r.error()}});
  }
  return Json{{"capture_id", capture.capture_id()},
              {"state", EnumWord(v1::ProfileState_Name(capture.state()), "PROFILE_STATE_")},
              {"ranks", Json(std::vector<int64_t>(capture.ranks().begin(), capture.ranks().end()))},
              {"steps", capture.steps()},
              {"memory", capture.memory()},
              {"error", capture.error()},
              {"requested_unix_ms", capture.requested_unix_ms()},
              {"ended_unix_ms", capture.ended_unix_ms()},
              {"requested_by", capture.requested_by()},
              {"results", std::move(results)},
              {"files", std::move(files)}};
}

namespace {

Json AttemptJson(const v1::Attempt& attempt) {
  Json profiles = Json::array();
  for (const v1::ProfileCapture& capture : attempt.profiles()) {
    profiles.push_back(ProfileJson(capture));
  }
  Json placements = Json::array();
  for (const v1::RankPlacement& p : attempt.placements()) {
    placements.push_back(
        Json{{"rank", p.rank()}, {"worker_id", p.worker_id()}, {"slot", p.slot()}});
  }
  return Json{{"generation", attempt.generation()},
              {"state", EnumWord(v1::AttemptState_Name(attempt.state()), "ATTEMPT_STATE_")},
              {"placements", std::move(placements)},
              {"started_unix_ms", attempt.started_unix_ms()},
              {"ended_unix_ms", attempt.ended_unix_ms()},
              {"error", attempt.error()},
              {"progress", ProgressJson(attempt.progress())},
              {"predicted_memory", MemoryJson(attempt.predicted_memory())},
              {"peak_memory", MemoryJson(attempt.peak_memory())},
              {"failure", attempt.failure() == v1::FAILURE_KIND_UNSPECIFIED
                              ? ""
                              : EnumWord(v1::FailureKind_Name(attempt.failure()), "FAILURE_KIND_")},
              {"resumed_from_step", attempt.resumed_from_step()},
              {"profiles", std::move(profiles)}};
}

// The spec in its own schema, or null when the proto does not convert to a valid spec.
Json SpecJson(const v1::JobSpec& spec) {
  absl::StatusOr<JobSpec> parsed = JobSpecFromProto(spec, "spec");
  if (!parsed.ok()) return nullptr;
  Json json = Json::parse(JobSpecToJson(*parsed), /*cb=*/nullptr, /*allow_exceptions=*/false);
  return json.is_discarded() ? Json(nullptr) : json;
}

}  // namespace

Json MemoryJson(const v1::MemoryBreakdown& memory) {
  Json json = Json::object();
  for (MemoryComponent c : kMemoryComponents) {
    json[std::string(MemoryComponentName(c))] = ComponentBytes(memory, c);
  }
  json["total"] = memory.total();
  return json;
}

Json ProgressJson(const v1::Progress& progress) {
  return Json{
      {"step", progress.step()},
      {"total_steps", progress.total_steps()},
      {"loss", progress.has_loss() ? Number(progress.loss()) : Json(nullptr)},
      {"eval_loss", progress.has_eval_loss() ? Number(progress.eval_loss()) : Json(nullptr)},
      {"lr", Number(progress.lr())},
      {"grad_norm", Number(progress.grad_norm())},
      {"tokens_per_second", Number(progress.tokens_per_second())},
      {"mfu", Number(progress.mfu())},
      {"products", progress.products()},
      {"skipped_steps", progress.skipped_steps()},
      {"loss_scale", Number(progress.loss_scale())},
      {"step_seconds", Number(progress.step_seconds())},
      {"phases", PhasesJson(progress.phases())},
      {"memory", MemoryJson(progress.memory())},
      {"updated_unix_ms", progress.updated_unix_ms()}};
}

Json JobJson(const v1::JobStatus& status) {
  Json attempts = Json::array();
  for (const v1::Attempt& attempt : status.attempts()) attempts.push_back(AttemptJson(attempt));
  Json history = Json::array();
  for (const v1::StateChange& change : status.history()) {
    history.push_back(Json{{"state", EnumWord(v1::JobState_Name(change.state()), "JOB_STATE_")},
                           {"unix_ms", change.unix_ms()},
                           {"by", change.by()},
                           {"reason", change.reason()}});
  }
  const v1::Progress* latest = LatestProgress(status);
  return Json{{"job_id", status.job_id()},
              {"name", status.spec().name()},
              {"state", EnumWord(v1::JobState_Name(status.state()), "JOB_STATE_")},
              {"reason", status.reason()},
              {"owner", status.owner()},
              {"history", std::move(history)},
              {"submitted_unix_ms", status.submitted_unix_ms()},
              {"updated_unix_ms", status.updated_unix_ms()},
              {"restarts", status.restarts()},
              {"restart_after_unix_ms", status.restart_after_unix_ms()},
              {"spec", SpecJson(status.spec())},
              {"plan", PlanJson(status.plan())},
              {"attempts", std::move(attempts)},
              {"progress", latest != nullptr ? ProgressJson(*latest) : Json(nullptr)},
              {"eta_seconds", Number(EtaSeconds(status))},
              {"final_loss", status.has_final_loss() ? Number(status.final_loss()) : Json(nullptr)},
              {"adapter_path", status.adapter_path()},
              {"model_path", status.model_path()}};
}

Json WorkerJson(const v1::WorkerStatus& worker) {
  Json devices = Json::array();
  for (const v1::DeviceInfo& d : worker.devices()) {
    devices.push_back(
        Json{{"index", d.index()}, {"name", d.name()}, {"memory_bytes", d.memory_bytes()}});
  }
  Json running = Json::array();
  for (const v1::SlotStatus& slot : worker.running()) {
    running.push_back(Json{{"slot", slot.slot()},
                           {"job_id", slot.job_id()},
                           {"generation", slot.generation()},
                           {"rank", slot.rank()}});
  }
  return Json{{"worker_id", worker.worker_id()},
              {"state", EnumWord(v1::WorkerState_Name(worker.state()), "WORKER_STATE_")},
              {"address", worker.address()},
              {"device", DeviceWord(worker.device())},
              {"slots", worker.slots()},
              {"busy_slots", worker.busy_slots()},
              {"devices", std::move(devices)},
              {"last_heartbeat_unix_ms", worker.last_heartbeat_unix_ms()},
              {"running", std::move(running)}};
}

std::string JsonLine(const Json& json) {
  return json.dump(/*indent=*/-1, /*indent_char=*/' ', /*ensure_ascii=*/false,
                   Json::error_handler_t::replace);
}

nlohmann::ordered_json PlanResponseJson(const v1::PlanJobResponse& response) {
  Json candidates = Json::array();
  for (const v1::PlanCandidate& c : response.candidates()) {
    const v1::Strategy& s = c.strategy();
    candidates.push_back(Json{{"zero_stage", s.zero_stage()},
                              {"offload_optimizer", s.offload_optimizer()},
                              {"offload_params", s.offload_params()},
                              {"activation_checkpointing", s.activation_checkpointing()},
                              {"chunked_loss", s.chunked_loss()},
                              {"micro_batch", s.micro_batch()},
                              {"memory", MemoryJson(c.memory())},
                              {"host_memory", c.host_memory()},
                              {"step_seconds", Number(c.step_seconds())},
                              {"fits", c.fits()},
                              {"verdict", c.verdict()},
                              {"memory_correction", EffectiveCorrection(c.memory_correction())}});
  }
  return Json{{"plan", PlanJson(response.plan())},
              {"tokens_per_second", Number(response.tokens_per_second())},
              {"memory_per_rank", response.memory_per_rank()},
              {"warnings",
               std::vector<std::string>(response.warnings().begin(), response.warnings().end())},
              {"candidates", std::move(candidates)}};
}

nlohmann::ordered_json PlanHistoryJson(const v1::GetPlanHistoryResponse& history) {
  Json attempts = Json::array();
  for (const v1::PlanHistoryEntry& e : history.attempts()) {
    attempts.push_back(Json{{"job_id", e.job_id()},
                            {"generation", e.generation()},
                            {"state", EnumWord(v1::AttemptState_Name(e.state()), "ATTEMPT_STATE_")},
                            {"ended_unix_ms", e.ended_unix_ms()},
                            {"calibration_key", e.calibration_key()},
                            {"predicted", MemoryJson(e.predicted())},
                            {"memory_correction", EffectiveCorrection(e.memory_correction())},
                            {"measured", MemoryJson(e.measured())}});
  }
  Json corrections = Json::array();
  for (const v1::MemoryCorrection& c : history.corrections()) {
    corrections.push_back(Json{{"calibration_key", c.calibration_key()},
                               {"factor", Number(c.factor())},
                               {"attempts", c.attempts()}});
  }
  return Json{{"attempts", std::move(attempts)}, {"corrections", std::move(corrections)}};
}

}  // namespace lathe
