#include "worker/agent/trainer_supervisor.h"

#include <signal.h>

#include <algorithm>
#include <filesystem>
#include <system_error>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/file_util.h"
#include "common/proto/job_spec_proto.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
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

std::optional<double> OptionalNumber(const nlohmann::json& object, const char* key) {
  auto it = object.find(key);
  if (it == object.end() || !it->is_number()) return std::nullopt;
  return it->get<double>();
}

double NumberOr(const nlohmann::json& object, const char* key, double fallback) {
  return OptionalNumber(object, key).value_or(fallback);
}

int64_t IntegerOr(const nlohmann::json& object, const char* key, int64_t fallback) {
  auto it = object.find(key);
  if (it == object.end() || !it->is_number()) return fallback;
  return it->is_number_integer() ? it->get<int64_t>() : static_cast<int64_t>(it->get<double>());
}

std::string StringOr(const nlohmann::json& object, const char* key) {
  auto it = object.find(key);
  if (it == object.end() || !it->is_string()) return "";
  return it->get<std::string>();
}

// The optional "memory" object of a step line: the MemoryBreakdown components, in bytes.
void ParseMemory(const nlohmann::json& object, v1::MemoryBreakdown* memory) {
  auto it = object.find("memory");
  if (it == object.end() || !it->is_object()) return;
  auto bytes = [&](const char* key) {
    return static_cast<uint64_t>(std::max<int64_t>(0, IntegerOr(*it, key, 0)));
  };
  memory->set_weights(bytes("weights"));
  memory->set_trainable(bytes("trainable"));
  memory->set_gradients(bytes("gradients"));
  memory->set_optimizer(bytes("optimizer"));
  memory->set_activations(bytes("activations"));
  memory->set_logits(bytes("logits"));
  memory->set_comm_buffers(bytes("comm_buffers"));
  memory->set_overhead(bytes("overhead"));
  memory->set_total(bytes("total"));
}

// "was killed by signal 9 (SIGKILL)", "exited with code 3".
std::string Ended(const ExitStatus& status) {
  return status.signaled ? absl::StrCat("was ", status.ToString()) : status.ToString();
}

bool IsTerminal(v1::RankEvent kind) {
  return kind == v1::RANK_EVENT_SUCCEEDED || kind == v1::RANK_EVENT_FAILED ||
         kind == v1::RANK_EVENT_CANCELLED;
}

}  // namespace

TrainerSupervisor::TrainerSupervisor(v1::Assignment assignment, TrainerSupervisorOptions options,
                                     ProcessLauncher* launcher, EventCallback on_event)
    : assignment_(std::move(assignment)),
      options_(std::move(options)),
      launcher_(launcher),
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
  // The plan's micro-batch is what the planner fitted in memory; the trainer must not pick
  // another one on its own.
  v1::JobSpec spec = assignment_.spec();
  if (assignment_.plan().micro_batch() > 0 && spec.train().micro_batch() == 0) {
    spec.mutable_train()->set_micro_batch(assignment_.plan().micro_batch());
  }
  const std::string spec_path = run_dir_ + "/job.json";
  LATHE_RETURN_IF_ERROR(WriteFileAtomically(spec_path, JobSpecProtoToJson(spec)));
  log_file_.open(run_dir_ + "/trainer.log", std::ios::out | std::ios::trunc);
  if (!log_file_) {
    return absl::InternalError(absl::StrCat("creating ", run_dir_, "/trainer.log"));
  }

  LaunchOptions launch;
  launch.argv = {options_.trainer_binary,
                 "train",
                 "--spec",
                 spec_path,
                 "--output",
                 "json",
                 "--rank",
                 absl::StrCat(assignment_.rank()),
                 "--world-size",
                 absl::StrCat(assignment_.world_size()),
                 "--job-id",
                 assignment_.job_id(),
                 "--generation",
                 absl::StrCat(assignment_.generation()),
                 "--coordinator",
                 options_.coordinator_address};
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
    TrainerEvent started;
    started.kind = v1::RANK_EVENT_STARTED;
    on_event_(started);
  }
  if (cancelled) SignalCancel();
  return absl::OkStatus();
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
  nlohmann::json object = nlohmann::json::parse(line.begin(), line.end(), nullptr,
                                                /*allow_exceptions=*/false);
  auto event_it = object.is_object() ? object.find("event") : object.end();
  if (!object.is_object() || event_it == object.end() || !event_it->is_string()) {
    absl::MutexLock lock(&mu_);
    AddToTail(line);
    return;
  }
  const std::string event = event_it->get<std::string>();
  TrainerEvent progress;
  progress.kind = v1::RANK_EVENT_PROGRESS;
  v1::Progress& p = progress.progress;
  {
    absl::MutexLock lock(&mu_);
    if (event == "start") {
      total_steps_ = IntegerOr(object, "steps", 0);
      p.set_step(0);
      p.set_total_steps(total_steps_);
    } else if (event == "step") {
      p.set_step(IntegerOr(object, "step", 0));
      p.set_total_steps(IntegerOr(object, "steps", total_steps_));
      if (std::optional<double> loss = OptionalNumber(object, "loss")) p.set_loss(*loss);
      p.set_lr(NumberOr(object, "lr", 0.0));
      p.set_grad_norm(NumberOr(object, "grad_norm", 0.0));
      p.set_tokens_per_second(NumberOr(object, "tokens_per_s", 0.0));
      p.set_mfu(NumberOr(object, "mfu", 0.0));
      if (std::optional<double> eval = OptionalNumber(object, "eval_loss")) p.set_eval_loss(*eval);
      ParseMemory(object, p.mutable_memory());
    } else if (event == "done") {
      TrainerEvent done;
      done.kind = v1::RANK_EVENT_SUCCEEDED;
      v1::Progress& d = done.progress;
      d = last_progress_;
      d.set_step(IntegerOr(object, "steps", d.step()));
      d.set_total_steps(IntegerOr(object, "steps", total_steps_));
      d.clear_loss();
      if (std::optional<double> loss = OptionalNumber(object, "final_loss")) d.set_loss(*loss);
      d.clear_eval_loss();
      if (std::optional<double> eval = OptionalNumber(object, "eval_loss")) d.set_eval_loss(*eval);
      d.set_tokens_per_second(NumberOr(object, "tokens_per_s", d.tokens_per_second()));
      d.set_updated_unix_ms(absl::ToUnixMillis(absl::Now()));
      done.adapter_path = StringOr(object, "adapter");
      done.model_path = StringOr(object, "model");
      done_ = std::move(done);
      return;
    } else {
      return;  // an event this agent does not know yet
    }
    p.set_updated_unix_ms(absl::ToUnixMillis(absl::Now()));
    last_progress_ = p;
  }
  Emit(progress);
}

void TrainerSupervisor::OnStderrLine(absl::string_view line) {
  if (log_file_.is_open()) {
    log_file_ << line << '\n';
    log_file_.flush();
  }
  absl::MutexLock lock(&mu_);
  AddToTail(line);
}

void TrainerSupervisor::OnExit(const ExitStatus& status) {
  log_file_.close();
  TrainerEvent event;
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
      if (status.success()) {
        event.error = "the trainer exited with code 0 without reporting \"done\"";
      } else {
        event.error = absl::StrCat("the trainer ", Ended(status));
        if (status.signaled && status.signal == SIGKILL) {
          event.error += " (not by the agent; the kernel's out-of-memory killer is a common cause)";
        }
      }
      event.error += TailText();
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

std::string TrainerSupervisor::TailText() const {
  if (tail_.empty()) return "; no log output";
  return absl::StrCat("; last ", tail_.size() == 1 ? "line" : absl::StrCat(tail_.size(), " lines"),
                      " of its output (stderr in ", run_dir_, "/trainer.log):\n",
                      absl::StrJoin(tail_, "\n"));
}

void TrainerSupervisor::Emit(const TrainerEvent& event) {
  absl::MutexLock emit(&emit_mu_);
  on_event_(event);
  if (IsTerminal(event.kind)) {
    absl::MutexLock lock(&mu_);
    finished_ = true;
  }
}

}  // namespace lathe
