#include "client/status_text.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/memory_components.h"
#include "common/proto/memory_breakdown.h"

namespace lathe {
namespace {

using Row = std::vector<std::string>;

// Columns separated by two spaces; the last column is not padded.
std::string RenderTable(const std::vector<Row>& rows) {
  std::vector<size_t> widths;
  for (const Row& row : rows) {
    if (widths.size() < row.size()) widths.resize(row.size(), 0);
    for (size_t i = 0; i < row.size(); ++i) widths[i] = std::max(widths[i], row[i].size());
  }
  std::string out;
  for (const Row& row : rows) {
    std::string line;
    for (size_t i = 0; i < row.size(); ++i) {
      line += row[i];
      if (i + 1 < row.size()) line.append(widths[i] - row[i].size() + 2, ' ');
    }
    absl::StrAppend(&out, absl::StripTrailingAsciiWhitespace(line), "\n");
  }
  return out;
}

std::string EnumSuffix(const std::string& name, absl::string_view prefix) {
  if (name.empty()) return "UNKNOWN";
  return std::string(absl::StripPrefix(name, prefix));
}

std::string PrecisionText(v1::Precision precision) {
  switch (precision) {
    case v1::PRECISION_BF16:
      return "bf16";
    case v1::PRECISION_FP16:
      return "fp16";
    default:
      return "fp32";
  }
}

std::string LossText(double loss) { return absl::StrFormat("%.4f", loss); }

std::string Ago(int64_t unix_ms, absl::Time now) {
  if (unix_ms <= 0) return "-";
  return absl::StrCat(ShortDuration(now - absl::FromUnixMillis(unix_ms)), " ago");
}

std::vector<std::pair<std::string, uint64_t>> MemoryComponents(const v1::MemoryBreakdown& m) {
  std::vector<std::pair<std::string, uint64_t>> components;
  for (MemoryComponent c : kMemoryComponents) {
    components.emplace_back(MemoryComponentName(c), ComponentBytes(m, c));
  }
  components.emplace_back("total", m.total());
  return components;
}

// "label        value" with the value's further lines indented to the value column.
constexpr size_t kLabelWidth = 13;

void AppendField(std::string* out, absl::string_view label, absl::string_view value) {
  std::string padded(label);
  padded.resize(std::max(kLabelWidth, padded.size() + 1), ' ');
  std::vector<absl::string_view> lines =
      absl::StrSplit(absl::StripTrailingAsciiWhitespace(value), '\n');
  for (size_t i = 0; i < lines.size(); ++i) {
    absl::StrAppend(out, i == 0 ? padded : std::string(padded.size(), ' '),
                    absl::StripTrailingAsciiWhitespace(lines[i]), "\n");
  }
}

std::string PlanText(const v1::Plan& plan) {
  const v1::Strategy& s = plan.strategy();
  // micro_batch 0: a job stored before the plan carried the micro-batch.
  std::string batching =
      s.micro_batch() > 0
          ? absl::StrCat("micro-batch ", s.micro_batch(), " x ",
                         std::max<int64_t>(plan.gradient_accumulation(), 1), " accumulation")
          : "micro-batch auto";
  std::string text =
      absl::StrCat(plan.ranks(), plan.ranks() == 1 ? " rank" : " ranks", " on ",
                   DeviceName(plan.device()), ", ZeRO-", s.zero_stage(), ", ", batching, ", ",
                   plan.total_steps(), " steps, ", PrecisionText(plan.precision()));
  std::vector<std::string> options;
  // What the planner may have chosen for the user (memory techniques); the spec's own
  // method shows in the spec.
  if (plan.method() == v1::METHOD_QLORA) options.push_back("QLoRA (NF4 frozen projections)");
  if (s.offload_optimizer()) options.push_back("offload optimizer");
  if (s.offload_params()) options.push_back("offload params");
  if (s.activation_checkpointing()) options.push_back("activation checkpointing");
  if (s.chunked_loss()) options.push_back("chunked loss");
  if (s.fused_kernels()) options.push_back("fused kernels");
  if (!options.empty()) absl::StrAppend(&text, "\n", absl::StrJoin(options, ", "));
  if (!plan.explanation().empty()) absl::StrAppend(&text, "\n", plan.explanation());
  return text;
}

std::string PlacementsText(const v1::Attempt& attempt) {
  std::vector<std::string> parts;
  for (const v1::RankPlacement& p : attempt.placements()) {
    parts.push_back(absl::StrCat("rank ", p.rank(), " on ", p.worker_id(), " slot ", p.slot()));
  }
  return parts.empty() ? "not placed" : absl::StrJoin(parts, ", ");
}

std::string ProgressText(const v1::JobStatus& status, const v1::Progress& p, absl::Time now) {
  std::vector<std::string> parts = {absl::StrCat("step ", StepText(status))};
  if (p.has_loss()) parts.push_back(absl::StrCat("loss ", LossText(p.loss())));
  if (p.has_eval_loss()) parts.push_back(absl::StrCat("eval loss ", LossText(p.eval_loss())));
  if (p.lr() != 0) parts.push_back(absl::StrFormat("lr %.3g", p.lr()));
  if (p.grad_norm() != 0) parts.push_back(absl::StrFormat("grad norm %.3g", p.grad_norm()));
  if (p.tokens_per_second() > 0) {
    parts.push_back(absl::StrFormat("tokens/s %.0f", p.tokens_per_second()));
  }
  if (p.mfu() > 0) parts.push_back(absl::StrFormat("MFU %.1f%%", 100 * p.mfu()));
  if (!p.products().empty()) parts.push_back(absl::StrCat("products ", p.products()));
  std::string text = absl::StrJoin(parts, "  ");
  if (p.updated_unix_ms() > 0)
    absl::StrAppend(&text, "  (updated ", Ago(p.updated_unix_ms(), now), ")");
  return text;
}

// The row that says what the plan multiplied the memory model's total by, when it did.
std::optional<Row> CorrectionRow(const v1::MemoryBreakdown& predicted, double correction) {
  if (correction <= 0 || correction == 1 || predicted.total() == 0) return std::nullopt;
  return Row{absl::StrFormat("planned (x%.3f)", correction),
             FormatBytes(CorrectedTotal(predicted, correction))};
}

std::string MemoryText(const v1::MemoryBreakdown& predicted, double correction,
                       const v1::MemoryBreakdown& measured) {
  auto p = MemoryComponents(predicted);
  auto m = MemoryComponents(measured);
  std::vector<Row> rows = {{"", "predicted", "measured"}};
  for (size_t i = 0; i < p.size(); ++i) {
    if (p[i].second == 0 && m[i].second == 0) continue;
    rows.push_back({p[i].first, p[i].second ? FormatBytes(p[i].second) : "-",
                    m[i].second ? FormatBytes(m[i].second) : "-"});
  }
  if (rows.size() == 1) return "";
  if (std::optional<Row> row = CorrectionRow(predicted, correction)) {
    row->push_back("");
    rows.push_back(*std::move(row));
  }
  return RenderTable(rows);
}

std::string PercentText(double fraction) { return absl::StrFormat("%+.1f%%", 100 * fraction); }

}  // namespace

std::string ProfileStateName(v1::ProfileState state) {
  return EnumSuffix(v1::ProfileState_Name(state), "PROFILE_STATE_");
}

std::string ProfileText(const v1::ProfileCapture& capture, const v1::Attempt& attempt) {
  std::string text =
      absl::StrCat(capture.capture_id(), " ", ProfileStateName(capture.state()), "  attempt #",
                   attempt.generation(), "  rank", capture.ranks_size() == 1 ? " " : "s ",
                   absl::StrJoin(capture.ranks(), ","), "  ", capture.steps(),
                   capture.steps() == 1 ? " step" : " steps", capture.memory() ? " + memory" : "");
  int64_t first = 0, last = 0;
  for (const v1::ProfileRankResult& r : capture.results()) {
    if (r.first_step() > 0 && (first == 0 || r.first_step() < first)) first = r.first_step();
    last = std::max(last, r.last_step());
  }
  if (first > 0) absl::StrAppend(&text, " (", first, "-", last, ")");
  if (capture.requested_unix_ms() > 0) {
    absl::StrAppend(&text, "  asked ", FormatTimestamp(capture.requested_unix_ms()));
  }
  absl::StrAppend(&text, "\n");
  for (const v1::ProfileFile& f : capture.files()) {
    absl::StrAppend(&text, "  rank ", f.rank(), "  ", f.name(), "  ", FormatBytes(f.size()), "\n");
  }
  if (!capture.error().empty()) {
    absl::StrAppend(&text, "  error: ", Truncate(capture.error(), 300), "\n");
  }
  return text;
}

std::string JobStateName(v1::JobState state) {
  return EnumSuffix(v1::JobState_Name(state), "JOB_STATE_");
}

std::string AttemptStateName(v1::AttemptState state) {
  return EnumSuffix(v1::AttemptState_Name(state), "ATTEMPT_STATE_");
}

absl::StatusOr<v1::JobState> ParseJobState(absl::string_view text) {
  std::string name = absl::AsciiStrToUpper(absl::StripAsciiWhitespace(text));
  if (!absl::StartsWith(name, "JOB_STATE_")) name = absl::StrCat("JOB_STATE_", name);
  v1::JobState state;
  if (!v1::JobState_Parse(name, &state) || state == v1::JOB_STATE_UNSPECIFIED) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown job state \"", text,
                     "\"; expected queued, running, succeeded, failed or cancelled"));
  }
  return state;
}

std::string ShortDuration(absl::Duration duration) {
  const int64_t s = std::max<int64_t>(0, absl::ToInt64Seconds(duration));
  if (s < 60) return absl::StrCat(s, "s");
  if (s < 3600) return absl::StrFormat("%dm%02ds", s / 60, s % 60);
  if (s < 86400) return absl::StrFormat("%dh%02dm", s / 3600, s % 3600 / 60);
  return absl::StrFormat("%dd%02dh", s / 86400, s % 86400 / 3600);
}

std::string FormatTimestamp(int64_t unix_ms) {
  if (unix_ms == 0) return "-";
  return absl::FormatTime("%Y-%m-%dT%H:%M:%SZ", absl::FromUnixMillis(unix_ms), absl::UTCTimeZone());
}

const v1::Progress* LatestProgress(const v1::JobStatus& status) {
  if (status.attempts().empty()) return nullptr;
  const v1::Attempt& attempt = *status.attempts().rbegin();
  if (!attempt.has_progress()) return nullptr;
  const v1::Progress& p = attempt.progress();
  if (p.step() == 0 && p.updated_unix_ms() == 0 && !p.has_loss()) return nullptr;
  return &p;
}

int64_t TotalSteps(const v1::JobStatus& status) {
  const v1::Progress* p = LatestProgress(status);
  if (p != nullptr && p->total_steps() > 0) return p->total_steps();
  return status.plan().total_steps();
}

std::string StepText(const v1::JobStatus& status) {
  const v1::Progress* p = LatestProgress(status);
  if (p == nullptr) return "-";
  const int64_t total = TotalSteps(status);
  return absl::StrCat(p->step(), "/", total > 0 ? absl::StrCat(total) : "?");
}

std::optional<double> EtaSeconds(const v1::JobStatus& status) {
  if (status.state() != v1::JOB_STATE_RUNNING) return std::nullopt;
  const v1::Progress* p = LatestProgress(status);
  if (p == nullptr || !(p->step_seconds() > 0) || !std::isfinite(p->step_seconds())) {
    return std::nullopt;
  }
  const int64_t total = TotalSteps(status);
  if (total <= 0) return std::nullopt;
  const int64_t remaining = std::max<int64_t>(0, total - p->step());
  return static_cast<double>(remaining) * p->step_seconds();
}

std::string Truncate(absl::string_view text, size_t max_chars) {
  std::string flat = absl::StrReplaceAll(text, {{"\r\n", " "}, {"\n", " "}, {"\r", " "}});
  if (flat.size() <= max_chars) return flat;
  if (max_chars <= 3) return flat.substr(0, max_chars);
  return absl::StrCat(flat.substr(0, max_chars - 3), "...");
}

std::string JobTable(const std::vector<v1::JobStatus>& jobs, absl::Time now) {
  std::vector<Row> rows = {{"ID", "NAME", "STATE", "STEP", "LOSS", "AGE", "REASON"}};
  for (const v1::JobStatus& job : jobs) {
    const v1::Progress* p = LatestProgress(job);
    std::string loss = "-";
    if (job.has_final_loss()) {
      loss = LossText(job.final_loss());
    } else if (p != nullptr && p->has_loss()) {
      loss = LossText(p->loss());
    }
    std::string age = job.submitted_unix_ms() > 0
                          ? ShortDuration(now - absl::FromUnixMillis(job.submitted_unix_ms()))
                          : "-";
    rows.push_back({job.job_id(), job.spec().name(), JobStateName(job.state()), StepText(job), loss,
                    age, Truncate(job.reason(), 60)});
  }
  return RenderTable(rows);
}

std::string JobDetails(const v1::JobStatus& status, absl::Time now) {
  std::string out;
  AppendField(&out, "job",
              status.spec().name().empty()
                  ? status.job_id()
                  : absl::StrCat(status.job_id(), " (", status.spec().name(), ")"));
  AppendField(&out, "state", JobStateName(status.state()));
  if (!status.reason().empty()) AppendField(&out, "reason", status.reason());
  if (!status.owner().empty()) AppendField(&out, "owner", status.owner());
  if (status.submitted_unix_ms() > 0) {
    AppendField(&out, "submitted",
                absl::StrCat(FormatTimestamp(status.submitted_unix_ms()), " (",
                             Ago(status.submitted_unix_ms(), now), ")"));
  }
  if (!status.history().empty()) {
    std::string history;
    for (const v1::StateChange& change : status.history()) {
      absl::StrAppend(&history, FormatTimestamp(change.unix_ms()), "  ",
                      JobStateName(change.state()), " by ", change.by(), "\n");
    }
    AppendField(&out, "history", history);
  }
  AppendField(&out, "plan", status.plan().ranks() > 0 ? PlanText(status.plan()) : "-");
  if (status.attempts().empty()) {
    AppendField(&out, "attempts", "none yet");
  } else {
    std::string attempts;
    for (const v1::Attempt& a : status.attempts()) {
      absl::StrAppend(&attempts, "#", a.generation(), " ", AttemptStateName(a.state()), "  ",
                      PlacementsText(a));
      if (a.started_unix_ms() > 0) {
        absl::StrAppend(&attempts, "  started ", FormatTimestamp(a.started_unix_ms()));
      }
      if (a.ended_unix_ms() > 0) {
        absl::StrAppend(&attempts, "  ended ", FormatTimestamp(a.ended_unix_ms()));
      }
      if (a.resumed_from_step() > 0) {
        absl::StrAppend(&attempts, "  resumed from step ", a.resumed_from_step());
      }
      absl::StrAppend(&attempts, "\n");
      if (!a.error().empty()) {
        const std::string label = a.failure() == v1::FAILURE_KIND_USER ? "  user error: "
                                  : a.failure() == v1::FAILURE_KIND_INFRASTRUCTURE
                                      ? "  infrastructure: "
                                      : "  error: ";
        const absl::string_view error = absl::StripTrailingAsciiWhitespace(a.error());
        // The job's reason often is (or quotes) its latest attempt's error: say it once.
        if (&a == &*status.attempts().rbegin() && absl::StrContains(status.reason(), error)) {
          absl::StrAppend(&attempts, label, "(the reason above)\n");
          continue;
        }
        std::vector<absl::string_view> lines = absl::StrSplit(error, '\n');
        for (size_t i = 0; i < lines.size(); ++i) {
          absl::StrAppend(&attempts, i == 0 ? label : std::string(label.size(), ' '), lines[i],
                          "\n");
        }
      }
    }
    AppendField(&out, "attempts", attempts);
  }
  std::string profiles;
  for (const v1::Attempt& a : status.attempts()) {
    for (const v1::ProfileCapture& c : a.profiles()) absl::StrAppend(&profiles, ProfileText(c, a));
  }
  if (!profiles.empty()) AppendField(&out, "profiles", profiles);
  const v1::Progress* p = LatestProgress(status);
  if (p != nullptr) AppendField(&out, "progress", ProgressText(status, *p, now));
  // Measured: the latest attempt's largest peak over its ranks, else rank 0's progress.
  const v1::MemoryBreakdown* measured =
      p != nullptr ? &p->memory() : &v1::MemoryBreakdown::default_instance();
  if (!status.attempts().empty() && status.attempts().rbegin()->peak_memory().total() > 0) {
    measured = &status.attempts().rbegin()->peak_memory();
  }
  std::string memory =
      MemoryText(status.plan().predicted_memory(), status.plan().memory_correction(), *measured);
  if (!memory.empty()) AppendField(&out, "memory/rank", memory);
  if (status.has_final_loss()) AppendField(&out, "final loss", LossText(status.final_loss()));
  if (!status.adapter_path().empty()) AppendField(&out, "adapter", status.adapter_path());
  if (!status.model_path().empty()) AppendField(&out, "model", status.model_path());
  if (status.restarts() > 0) {
    AppendField(&out, "restarts",
                absl::StrCat(status.restarts(), " of ", status.spec().max_restarts()));
  }
  return out;
}

std::string WorkerTable(const std::vector<v1::WorkerStatus>& workers, absl::Time now) {
  std::vector<Row> rows = {{"ID", "STATE", "DEVICE", "SLOTS", "LAST HEARTBEAT", "RUNNING"}};
  for (const v1::WorkerStatus& w : workers) {
    std::string device = DeviceName(w.device());
    if (!w.devices().empty() && w.devices(0).name() != device && !w.devices(0).name().empty()) {
      absl::StrAppend(&device, " (", w.devices(0).name(), ")");
    }
    std::vector<std::string> running;
    for (const v1::SlotStatus& slot : w.running()) {
      if (!slot.job_id().empty()) running.push_back(absl::StrCat(slot.job_id(), " r", slot.rank()));
    }
    rows.push_back({w.worker_id(), EnumSuffix(v1::WorkerState_Name(w.state()), "WORKER_STATE_"),
                    device, absl::StrCat(w.busy_slots(), "/", w.slots()),
                    Ago(w.last_heartbeat_unix_ms(), now),
                    running.empty() ? "-" : absl::StrJoin(running, ", ")});
  }
  return RenderTable(rows);
}

std::string PlanReportText(const v1::PlanJobResponse& response, size_t max_candidates) {
  std::string out;
  AppendField(&out, "plan", PlanText(response.plan()));
  // The peak the plan predicts, then the budget it was fitted to (issue #32: the budget
  // alone read as the prediction).
  AppendField(&out, "predicted",
              absl::StrFormat("%.0f tokens/s; peak %s per rank of %s", response.tokens_per_second(),
                              FormatBytes(CorrectedTotal(response.plan().predicted_memory(),
                                                         response.plan().memory_correction())),
                              FormatBytes(response.memory_per_rank())));
  std::vector<Row> memory = {{"component", "bytes/rank (at the step's peak)"}};
  for (const auto& [name, bytes] : MemoryComponents(response.plan().predicted_memory())) {
    if (bytes > 0) memory.push_back({name, FormatBytes(bytes)});
  }
  if (std::optional<Row> row =
          CorrectionRow(response.plan().predicted_memory(), response.plan().memory_correction())) {
    memory.push_back(*std::move(row));
  }
  AppendField(&out, "memory/rank", RenderTable(memory));
  for (const std::string& warning : response.warnings()) AppendField(&out, "warning", warning);
  std::vector<Row> rows = {
      {"ZERO", "OFFLOAD", "CKPT", "LOSS", "MICRO", "PEAK/RANK", "STEP", "VERDICT"}};
  size_t shown = 0;
  for (const v1::PlanCandidate& c : response.candidates()) {
    if (shown++ == max_candidates) break;
    const v1::Strategy& s = c.strategy();
    std::string offload = s.offload_optimizer() && s.offload_params() ? "opt+params"
                          : s.offload_optimizer()                     ? "optimizer"
                          : s.offload_params()                        ? "params"
                                                                      : "-";
    rows.push_back({absl::StrCat(s.zero_stage()), offload,
                    s.activation_checkpointing() ? "on" : "off",
                    s.chunked_loss() ? "chunked" : "logits", absl::StrCat(s.micro_batch()),
                    FormatBytes(CorrectedTotal(c.memory(), c.memory_correction())),
                    absl::StrFormat("%.3g s", c.step_seconds()), c.verdict()});
  }
  std::string table = RenderTable(rows);
  if (static_cast<size_t>(response.candidates_size()) > max_candidates) {
    absl::StrAppend(&table, "(", response.candidates_size() - max_candidates,
                    " more; --output json lists them all)\n");
  }
  AppendField(&out, "considered", table);
  return out;
}

std::string PlanHistoryText(const v1::GetPlanHistoryResponse& history) {
  std::string out;
  if (history.attempts().empty()) {
    out = "no measured attempts yet (an attempt counts once it has run a step)\n";
  } else {
    std::vector<Row> rows = {
        {"JOB", "ATTEMPT", "STATE", "PREDICTED", "PLANNED", "MEASURED", "MODEL ERR", "PLAN ERR"}};
    std::vector<double> model_errors, plan_errors;
    for (const v1::PlanHistoryEntry& e : history.attempts()) {
      const double measured = static_cast<double>(e.measured().total());
      const uint64_t planned = CorrectedTotal(e.predicted(), e.memory_correction());
      model_errors.push_back(static_cast<double>(e.predicted().total()) / measured - 1);
      plan_errors.push_back(static_cast<double>(planned) / measured - 1);
      rows.push_back({e.job_id(), absl::StrCat("#", e.generation()), AttemptStateName(e.state()),
                      FormatBytes(e.predicted().total()), FormatBytes(planned),
                      FormatBytes(e.measured().total()), PercentText(model_errors.back()),
                      PercentText(plan_errors.back())});
    }
    out = RenderTable(rows);
    auto summary = [](std::vector<double> errors) {
      std::vector<double> sizes;
      double worst = 0;
      for (double e : errors) {
        sizes.push_back(std::abs(e));
        if (std::abs(e) > std::abs(worst)) worst = e;
      }
      std::sort(sizes.begin(), sizes.end());
      const size_t n = sizes.size();
      const double median = n % 2 ? sizes[n / 2] : (sizes[n / 2 - 1] + sizes[n / 2]) / 2;
      return absl::StrFormat("median |error| %.1f%%, worst %s", 100 * median, PercentText(worst));
    };
    absl::StrAppend(
        &out, "\n", model_errors.size(), model_errors.size() == 1 ? " attempt" : " attempts",
        "; memory model: ", summary(model_errors), "; as planned: ", summary(plan_errors),
        " (error: predicted / measured - 1; below 0 is an underestimate)\n");
  }
  if (!history.corrections().empty()) {
    std::vector<Row> rows = {{"FACTOR", "ATTEMPTS", "KEY"}};
    for (const v1::MemoryCorrection& c : history.corrections()) {
      rows.push_back(
          {absl::StrFormat("%.3f", c.factor()), absl::StrCat(c.attempts()), c.calibration_key()});
    }
    absl::StrAppend(&out, "\ncorrections later plans apply:\n", RenderTable(rows));
  }
  return out;
}

}  // namespace lathe
