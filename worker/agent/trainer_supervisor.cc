#include "worker/agent/trainer_supervisor.h"

#include <signal.h>

#include <algorithm>
#include <filesystem>
#include <system_error>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/file_util.h"
#include "common/proto/trainer_io.h"
#include "common/status_macros.h"
#include "google/protobuf/util/json_util.h"
#include "spdlog/spdlog.h"

namespace lathe {
namespace {

// Lines longer than this are cut in the log tail (trainer.log keeps them whole).
constexpr size_t kMaxTailLineBytes = 1000;

// Job ids become directory names: no separators, no "..".
bool IsSafeFileName(absl::string_view name) {
  if (name.empty() || name == "." || name == "..") return false;
  for (char c : name) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_' && c != '.') {
      return false;
    }
  }
  return true;
}

// "was killed by signal 9 (SIGKILL)", "exited with code 3".
std::string Ended(const ExitStatus& status) {
  return status.signaled ? absl::StrCat("was ", status.ToString()) : status.ToString();
}

// A trainer's error code (absl's name) as a failure kind: what the job's spec, data, model
// or numerics caused fails again on any machine; everything else may not.
v1::FailureKind FailureOf(absl::string_view code) {
  for (absl::string_view user :
       {"INVALID_ARGUMENT", "NOT_FOUND", "ALREADY_EXISTS", "PERMISSION_DENIED",
        "FAILED_PRECONDITION", "OUT_OF_RANGE", "UNIMPLEMENTED", "DATA_LOSS"}) {
    if (code == user) return v1::FAILURE_KIND_USER;
  }
  return v1::FAILURE_KIND_INFRASTRUCTURE;
}

bool IsTerminal(v1::RankEvent kind) {
  return kind == v1::RANK_EVENT_SUCCEEDED || kind == v1::RANK_EVENT_FAILED ||
         kind == v1::RANK_EVENT_CANCELLED;
}

}  // namespace

TrainerSupervisor::TrainerSupervisor(v1::Assignment assignment, TrainerSupervisorOptions options,
                                     ProcessLauncher* launcher, const Clock* clock,
                                     EventCallback on_event)
    : assignment_(std::move(assignment)),
      options_(std::move(options)),
      launcher_(launcher),
      clock_(clock),
      on_event_(std::move(on_event)),
      run_dir_(absl::StrCat(options_.work_dir, "/", assignment_.job_id(), "-g",
                            assignment_.generation(), "-r", assignment_.rank())) {}

TrainerSupervisor::~TrainerSupervisor() {
  ChildProcess* child;
  bool exited;
  {
    absl::MutexLock lock(&mu_);
    child = child_.get();
    exited = exited_;
    if (!cancel_requested_) {
      cancel_requested_ = true;
      cancel_reason_ = "its supervisor was destroyed";
    }
  }
  if (child != nullptr) {
    if (!exited) child->Kill(SIGKILL).IgnoreError();
    child->Wait();
  }
  std::thread killer;
  {
    absl::MutexLock lock(&mu_);
    killer = std::move(killer_);
  }
  if (killer.joinable()) killer.join();
  absl::MutexLock lock(&mu_);
  child_.reset();
}

absl::Status TrainerSupervisor::Start() {
  absl::Status status = Launch();
  if (!status.ok()) {
    absl::MutexLock lock(&mu_);
    finished_ = true;
  }
  return status;
}

absl::Status TrainerSupervisor::Launch() {
  {
    absl::MutexLock lock(&mu_);
    if (started_) return absl::FailedPreconditionError("the trainer was already started");
    if (cancel_requested_) return absl::FailedPreconditionError("the rank was cancelled");
    started_ = true;
  }
  if (!IsSafeFileName(assignment_.job_id())) {
    return absl::InvalidArgumentError(
        absl::StrCat("job_id: \"", assignment_.job_id(),
                     "\" is not a file name (letters, digits, '-', '_', '.')"));
  }
  std::error_code error;
  std::filesystem::create_directories(run_dir_, error);
  if (error) {
    return absl::InternalError(absl::StrCat("creating ", run_dir_, ": ", error.message()));
  }
  v1::TrainerTask task;
  task.set_job_id(assignment_.job_id());
  task.set_generation(assignment_.generation());
  task.set_rank(assignment_.rank());
  task.set_world_size(assignment_.world_size());
  *task.mutable_spec() = assignment_.spec();
  *task.mutable_plan() = assignment_.plan();
  *task.mutable_allowed_roots() = assignment_.allowed_roots();
  task.set_rendezvous_address(options_.coordinator_address);
  task.set_peak_flops(options_.peak_flops);
  task.set_collective_timeout_seconds(absl::ToDoubleSeconds(options_.collective_timeout));
  const std::string task_path = run_dir_ + "/task.json";
  LATHE_RETURN_IF_ERROR(WriteTrainerTask(task_path, task));
  log_file_.open(run_dir_ + "/trainer.log", std::ios::out | std::ios::trunc);
  events_file_.open(run_dir_ + "/events.jsonl", std::ios::out | std::ios::trunc);
  if (!log_file_ || !events_file_) {
    return absl::InternalError(absl::StrCat("creating trainer.log and events.jsonl in ", run_dir_));
  }

  LaunchOptions launch;
  launch.argv = {options_.trainer_binary, "train", "--task", task_path, "--output", "json"};
  if (options_.trainer_threads > 0) {
    launch.argv.push_back("--threads");
    launch.argv.push_back(absl::StrCat(options_.trainer_threads));
  }
  launch.environment = options_.environment;
  launch.on_stdout_line = [this](absl::string_view line) { OnStdoutLine(line); };
  launch.on_stderr_line = [this](absl::string_view line) { OnStderrLine(line); };
  launch.on_exit = [this](const ExitStatus& status) { OnExit(status); };

  bool cancelled;
  {
    absl::MutexLock emit(&emit_mu_);
    absl::StatusOr<std::unique_ptr<ChildProcess>> child = launcher_->Launch(std::move(launch));
    if (!child.ok()) {
      log_file_.close();
      events_file_.close();
      return Annotate(child.status(), "starting the trainer");
    }
    int pid = (*child)->pid();
    {
      absl::MutexLock lock(&mu_);
      child_ = *std::move(child);
      cancelled = cancel_requested_;
    }
    spdlog::info("job={} attempt={} rank={} trainer started: pid {}, {}", assignment_.job_id(),
                 assignment_.generation(), assignment_.rank(), pid, run_dir_);
    RankReport started;
    started.kind = v1::RANK_EVENT_STARTED;
    on_event_(started);
  }
  if (cancelled) SignalCancel();
  return absl::OkStatus();
}

absl::Status TrainerSupervisor::RequestProfile(const v1::ProfileRequest& request) {
  const std::string& id = request.capture_id();
  const bool plain =
      !id.empty() && id.size() <= 64 && std::all_of(id.begin(), id.end(), [](char c) {
        return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-';
      });
  if (!plain) {
    return absl::InvalidArgumentError(
        absl::StrCat("capture_id: \"", id.substr(0, 64), "\" is not [A-Za-z0-9_-]{1,64}"));
  }
  {
    absl::MutexLock lock(&mu_);
    if (child_ == nullptr || exited_) {
      return absl::FailedPreconditionError(
          absl::StrCat("rank ", assignment_.rank(), " of job ", assignment_.job_id(), " attempt ",
                       assignment_.generation(), ": the trainer is not running"));
    }
  }
  const std::string dir = run_dir_ + "/profile";
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  if (error) return absl::InternalError(absl::StrCat("creating ", dir, ": ", error.message()));
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = true;
  std::string json;
  if (!google::protobuf::util::MessageToJsonString(request, &json, options).ok()) {
    return absl::InternalError("the profile request cannot be written as JSON");
  }
  return WriteFileAtomically(dir + "/request.json", json);
}

void TrainerSupervisor::Cancel(absl::string_view reason) {
  {
    absl::MutexLock lock(&mu_);
    if (cancel_requested_ || exited_) return;
    cancel_requested_ = true;
    cancel_reason_ = std::string(reason);
    if (child_ == nullptr) return;  // Start signals once the child exists
  }
  SignalCancel();
}

void TrainerSupervisor::SignalCancel() {
  ChildProcess* child;
  {
    absl::MutexLock lock(&mu_);
    child = child_.get();
    spdlog::info("job={} attempt={} rank={} cancelling the trainer: {}", assignment_.job_id(),
                 assignment_.generation(), assignment_.rank(), cancel_reason_);
  }
  absl::Status status = child->Kill(SIGTERM);
  if (!status.ok()) spdlog::warn("job={} {}", assignment_.job_id(), status.ToString());
  absl::MutexLock lock(&mu_);
  killer_ = std::thread([this, child] {
    {
      absl::MutexLock wait(&mu_);
      if (mu_.AwaitWithTimeout(absl::Condition(&exited_), options_.cancel_grace)) return;
    }
    spdlog::warn("job={} attempt={} rank={} trainer still running {} after SIGTERM: SIGKILL",
                 assignment_.job_id(), assignment_.generation(), assignment_.rank(),
                 absl::FormatDuration(options_.cancel_grace));
    absl::Status killed = child->Kill(SIGKILL);
    if (!killed.ok()) spdlog::warn("job={} {}", assignment_.job_id(), killed.ToString());
  });
}

bool TrainerSupervisor::finished() const {
  absl::MutexLock lock(&mu_);
  return finished_;
}

void TrainerSupervisor::Wait() const {
  absl::MutexLock lock(&mu_);
  auto done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return finished_ || !started_; };
  mu_.Await(absl::Condition(&done));
}

void TrainerSupervisor::OnStdoutLine(absl::string_view line) {
  absl::StatusOr<v1::TrainerEvent> event = ParseTrainerEventLine(line);
  if (!event.ok()) {
    if (options_.on_output_line) options_.on_output_line(line);
    absl::MutexLock lock(&mu_);
    AddToTail(line);
    return;
  }
  events_file_ << line << '\n';
  events_file_.flush();
  if (event->event_case() == v1::TrainerEvent::kProfile) {
    RankReport answer;
    answer.profile = event->profile();
    answer.profile_dir = absl::StrCat(run_dir_, "/profile/", event->profile().capture_id());
    Emit(answer);
    return;
  }
  RankReport progress;
  progress.kind = v1::RANK_EVENT_PROGRESS;
  v1::Progress& p = progress.progress;
  const int64_t now_ms = absl::ToUnixMillis(clock_->Now());
  {
    absl::MutexLock lock(&mu_);
    switch (event->event_case()) {
      case v1::TrainerEvent::kStart:
        p.set_step(event->start().resumed_from_step());
        p.set_total_steps(event->start().total_steps());
        progress.resumed_from_step = event->start().resumed_from_step();
        break;
      case v1::TrainerEvent::kStep:
        p = event->step().progress();
        break;
      case v1::TrainerEvent::kDone: {
        const v1::TrainerDone& done_event = event->done();
        RankReport done;
        done.kind = v1::RANK_EVENT_SUCCEEDED;
        v1::Progress& d = done.progress;
        d = last_progress_;
        d.set_step(done_event.steps());
        d.set_total_steps(done_event.steps());
        d.clear_loss();
        if (done_event.has_final_loss()) d.set_loss(done_event.final_loss());
        d.clear_eval_loss();
        if (done_event.has_eval_loss()) d.set_eval_loss(done_event.eval_loss());
        d.set_skipped_steps(done_event.skipped_steps());
        d.set_tokens_per_second(done_event.tokens_per_second());
        d.set_updated_unix_ms(now_ms);
        done.adapter_path = done_event.adapter_path();
        done.model_path = done_event.model_path();
        done_ = std::move(done);
        return;
      }
      case v1::TrainerEvent::kError:
        trainer_error_ = event->error().message();
        trainer_error_code_ = event->error().code();
        return;
      default:
        return;  // a checkpoint: kept in events.jsonl, nothing for the coordinator
    }
    p.set_updated_unix_ms(now_ms);
    last_progress_ = p;
  }
  Emit(progress);
}

void TrainerSupervisor::OnStderrLine(absl::string_view line) {
  if (options_.on_output_line) options_.on_output_line(line);
  if (log_file_.is_open()) {
    log_file_ << line << '\n';
    log_file_.flush();
  }
  absl::MutexLock lock(&mu_);
  AddToTail(line);
}

void TrainerSupervisor::OnExit(const ExitStatus& status) {
  log_file_.close();
  events_file_.close();
  RankReport event;
  {
    absl::MutexLock lock(&mu_);
    exited_ = true;
    if (cancel_requested_) {
      event.kind = v1::RANK_EVENT_CANCELLED;
      event.error = absl::StrCat("cancelled (", cancel_reason_, "); the trainer ", Ended(status));
    } else if (status.success() && done_) {
      event = *done_;
    } else {
      event.kind = v1::RANK_EVENT_FAILED;
      event.failure =
          trainer_error_.empty() ? v1::FAILURE_KIND_INFRASTRUCTURE : FailureOf(trainer_error_code_);
      if (!trainer_error_.empty()) {
        event.error = absl::StrCat(trainer_error_, " (the trainer ", Ended(status), ")");
      } else if (status.success()) {
        event.error = "the trainer exited with code 0 without reporting \"done\"";
      } else {
        event.error = absl::StrCat("the trainer ", Ended(status));
        if (status.signaled && status.signal == SIGKILL) {
          event.error += " (not by the agent; the kernel's out-of-memory killer is a common cause)";
        }
      }
      event.error += TailText(trainer_error_);
    }
  }
  if (event.kind == v1::RANK_EVENT_SUCCEEDED) {
    spdlog::info("job={} attempt={} rank={} trainer succeeded", assignment_.job_id(),
                 assignment_.generation(), assignment_.rank());
  } else {
    spdlog::warn("job={} attempt={} rank={} {}: {}", assignment_.job_id(), assignment_.generation(),
                 assignment_.rank(), v1::RankEvent_Name(event.kind), event.error);
  }
  Emit(event);
}

void TrainerSupervisor::AddToTail(absl::string_view line) {
  if (options_.log_tail_lines <= 0) return;
  std::string kept(line.substr(0, kMaxTailLineBytes));
  if (line.size() > kMaxTailLineBytes) kept += "...";
  tail_.push_back(std::move(kept));
  while (tail_.size() > static_cast<size_t>(options_.log_tail_lines)) tail_.pop_front();
}

std::string TrainerSupervisor::TailText(absl::string_view error) const {
  if (tail_.empty()) return "; no log output";
  std::vector<absl::string_view> lines;
  for (const std::string& line : tail_) {
    if (error.empty() || !absl::EndsWith(line, error)) lines.push_back(line);
  }
  const std::string logs = absl::StrCat("lathe logs ", assignment_.job_id(), " --attempt ",
                                        assignment_.generation(), " --rank ", assignment_.rank());
  if (lines.empty()) return absl::StrCat("; its output: ", logs);
  return absl::StrCat("; last ", lines.size() == 1 ? "line" : absl::StrCat(lines.size(), " lines"),
                      " of its output (all of it: ", logs, "):\n", absl::StrJoin(lines, "\n"));
}

void TrainerSupervisor::Emit(const RankReport& event) {
  absl::MutexLock emit(&emit_mu_);
  on_event_(event);
  if (IsTerminal(event.kind)) {
    absl::MutexLock lock(&mu_);
    finished_ = true;
  }
}

}  // namespace lathe
