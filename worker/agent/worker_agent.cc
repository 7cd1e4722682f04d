#include "worker/agent/worker_agent.h"

#include <algorithm>
#include <filesystem>
#include <system_error>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/rpc/auth.h"
#include "common/rpc/grpc_status.h"
#include "common/rpc/retry_policy.h"
#include "common/status_macros.h"
#include "spdlog/spdlog.h"

namespace lathe {
namespace {

bool SameRank(const v1::Assignment& a, const v1::Assignment& b) {
  return a.job_id() == b.job_id() && a.generation() == b.generation() && a.rank() == b.rank();
}

bool IsTerminal(v1::RankEvent event) {
  return event == v1::RANK_EVENT_SUCCEEDED || event == v1::RANK_EVENT_FAILED ||
         event == v1::RANK_EVENT_CANCELLED;
}

// The assignment without its spec and plan: what event callbacks need to name the rank.
v1::Assignment RankOf(const v1::Assignment& assignment) {
  v1::Assignment rank;
  rank.set_job_id(assignment.job_id());
  rank.set_generation(assignment.generation());
  rank.set_rank(assignment.rank());
  rank.set_world_size(assignment.world_size());
  rank.set_slot(assignment.slot());
  return rank;
}

ProgressReporterOptions ReporterOptions(const WorkerAgentOptions& options) {
  ProgressReporterOptions reporter = options.reporter;
  reporter.token = options.token;
  return reporter;
}

ProfileUploaderOptions UploaderOptions(const WorkerAgentOptions& options) {
  ProfileUploaderOptions uploader = options.profiles;
  uploader.token = options.token;
  return uploader;
}

LogShipperOptions ShipperOptions(const WorkerAgentOptions& options) {
  LogShipperOptions shipper;
  shipper.token = options.token;
  return shipper;
}

}  // namespace

WorkerAgent::WorkerAgent(WorkerAgentOptions options, v1::WorkerService::StubInterface* stub,
                         ProcessLauncher* launcher, const Clock* clock)
    : options_(std::move(options)),
      stub_(stub),
      launcher_(launcher),
      clock_(clock),
      reporter_(stub, ReporterOptions(options_)),
      shipper_(stub, ShipperOptions(options_)),
      uploader_(stub, UploaderOptions(options_)),
      pruner_(options_.trainer.work_dir, options_.keep_attempt_dirs, clock) {
  absl::MutexLock lock(&mu_);
  worker_id_ = options_.worker_id;
  slots_.resize(static_cast<size_t>(std::max<int64_t>(0, options_.slots)));
}

WorkerAgent::~WorkerAgent() {
  {
    absl::MutexLock lock(&mu_);
    shutdown_ = true;
  }
  StopTrainers();
}

absl::Status WorkerAgent::ValidateOptions() const {
  if (options_.worker_id.empty()) return absl::InvalidArgumentError("worker_id: must be set");
  if (options_.slots < 1) {
    return absl::InvalidArgumentError(absl::StrCat("slots: must be >= 1, got ", options_.slots));
  }
  if (options_.trainer.work_dir.empty()) {
    return absl::InvalidArgumentError("work_dir: must be set");
  }
  if (options_.trainer.trainer_binary.empty()) {
    return absl::InvalidArgumentError("trainer_binary: must be set");
  }
  if (options_.keep_attempt_dirs < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "keep_attempt_dirs: must be >= 0, got ", absl::FormatDuration(options_.keep_attempt_dirs)));
  }
  return absl::OkStatus();
}

namespace {
// How long a first registration refused for a duplicate worker id is retried: the default
// heartbeat timeout and then some, time for a predecessor's session to end.
constexpr absl::Duration kDuplicateIdGrace = absl::Seconds(30);
}  // namespace

absl::Status WorkerAgent::Run() {
  LATHE_RETURN_IF_ERROR(ValidateOptions());
  std::error_code error;
  std::filesystem::create_directories(options_.trainer.work_dir, error);
  if (error) {
    return absl::InternalError(
        absl::StrCat("creating work directory ", options_.trainer.work_dir, ": ", error.message()));
  }
  pruner_.SweepLeftovers([this](const std::string& name) { return HoldsAttemptDir(name); });
  Backoff backoff(options_.reconnect);
  bool registered_once = false;
  const absl::Time started = clock_->Now();
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (shutdown_) break;
    }
    DestroyRetired();
    PruneAttemptDirs();
    // The first registration fails fast, so that a misconfiguration shows at once.
    absl::StatusOr<v1::RegisterWorkerResponse> registration = Register(registered_once);
    if (!registration.ok()) {
      {
        absl::MutexLock lock(&mu_);
        if (shutdown_) break;
      }
      // Before the first registration a code the retry policy refuses (a bad worker id, a
      // refused credential) is a misconfiguration: fail now, visibly. Later the agent keeps
      // trying whatever the code, since its running trainers must not be orphaned.
      // ALREADY_EXISTS: another live agent holds this worker id. It may be this agent's
      // predecessor whose stream the coordinator has not seen close yet, so it is retried
      // for one heartbeat timeout's worth (kDuplicateIdGrace) before it is a
      // misconfiguration too.
      const absl::StatusCode code = registration.status().code();
      const bool duplicate_id =
          code == absl::StatusCode::kAlreadyExists && clock_->Now() - started < kDuplicateIdGrace;
      if (!registered_once && !IsRetryable(code) && !duplicate_id) {
        StopTrainers();
        return Annotate(registration.status(), "registering with the coordinator");
      }
      const absl::Duration delay = backoff.Next();
      spdlog::warn("worker={} registering with the coordinator failed: {}; retrying in {}",
                   options_.worker_id, registration.status().ToString(),
                   absl::FormatDuration(delay));
      SleepUnlessShutdown(delay);
      continue;
    }
    registered_once = true;
    spdlog::info("worker={} registered: session {}, heartbeat every {} ms", worker_id(),
                 registration->session_id(), registration->heartbeat_interval_ms());
    bool answered = false;
    grpc::Status ended = RunSession(*registration, &answered);
    {
      absl::MutexLock lock(&mu_);
      if (shutdown_) break;
    }
    if (answered) backoff.Reset();
    const absl::Duration delay = backoff.Next();
    spdlog::warn("worker={} heartbeat stream ended: {}; registering again in {}", worker_id(),
                 FromGrpcStatus(ended).ToString(), absl::FormatDuration(delay));
    SleepUnlessShutdown(delay);
  }
  StopTrainers();
  spdlog::info("worker={} stopped", worker_id());
  return absl::OkStatus();
}

void WorkerAgent::Shutdown() {
  absl::MutexLock lock(&mu_);
  shutdown_ = true;
  if (call_context_ != nullptr) call_context_->TryCancel();
}

absl::StatusOr<v1::RegisterWorkerResponse> WorkerAgent::Register(bool wait_for_ready) {
  v1::RegisterWorkerRequest request;
  request.set_worker_id(options_.worker_id);
  request.set_address(options_.address);
  request.set_device(options_.device);
  request.set_slots(options_.slots);
  for (const v1::DeviceInfo& device : options_.devices) *request.add_devices() = device;
  request.set_host_memory_bytes(options_.host_memory_bytes);
  request.set_version(options_.version);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + options_.rpc_timeout));
  context.set_wait_for_ready(wait_for_ready);
  AttachToken(&context, options_.token);
  {
    absl::MutexLock lock(&mu_);
    if (shutdown_) return absl::CancelledError("shutting down");
    call_context_ = &context;
  }
  v1::RegisterWorkerResponse response;
  grpc::Status status = stub_->RegisterWorker(&context, request, &response);
  {
    absl::MutexLock lock(&mu_);
    call_context_ = nullptr;
  }
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

grpc::Status WorkerAgent::RunSession(const v1::RegisterWorkerResponse& registration,
                                     bool* answered) {
  const absl::Duration interval = registration.heartbeat_interval_ms() > 0
                                      ? absl::Milliseconds(registration.heartbeat_interval_ms())
                                      : options_.default_heartbeat_interval;
  // The coordinator answers every heartbeat; one that stays silent this long is hung (or the
  // connection is), and would soon consider this worker lost anyway.
  const absl::Duration silence_limit = registration.heartbeat_timeout_ms() > 0
                                           ? absl::Milliseconds(registration.heartbeat_timeout_ms())
                                           : absl::InfiniteDuration();
  grpc::ClientContext context;
  AttachToken(&context, options_.token);
  {
    absl::MutexLock lock(&mu_);
    if (shutdown_) return grpc::Status(grpc::StatusCode::CANCELLED, "shutting down");
    worker_id_ = registration.worker_id().empty() ? options_.worker_id : registration.worker_id();
    session_id_ = registration.session_id();
    call_context_ = &context;
    stream_ended_ = false;
    answered_ = false;
    last_answer_ = clock_->Now();
  }
  std::unique_ptr<grpc::ClientReaderWriterInterface<v1::HeartbeatRequest, v1::HeartbeatResponse>>
      stream = stub_->Heartbeat(&context);
  std::thread reader([this, &stream] {
    v1::HeartbeatResponse response;
    while (stream->Read(&response)) {
      {
        absl::MutexLock lock(&mu_);
        answered_ = true;
        last_answer_ = clock_->Now();
      }
      HandleResponse(response);
      response.Clear();
    }
    absl::MutexLock lock(&mu_);
    stream_ended_ = true;
  });
  bool silent = false;
  while (true) {
    DestroyRetired();
    PruneAttemptDirs();
    if (!stream->Write(BuildHeartbeat())) break;
    absl::MutexLock lock(&mu_);
    auto stop = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return shutdown_ || stream_ended_; };
    if (mu_.AwaitWithTimeout(absl::Condition(&stop), interval)) break;
    if (clock_->Now() - last_answer_ > silence_limit) {
      silent = true;
      context.TryCancel();
      break;
    }
  }
  reader.join();
  grpc::Status status = stream->Finish();
  if (silent) {
    status = grpc::Status(
        grpc::StatusCode::UNAVAILABLE,
        absl::StrCat("no answer to heartbeats for ", absl::FormatDuration(silence_limit)));
  }
  absl::MutexLock lock(&mu_);
  call_context_ = nullptr;
  *answered = answered_;
  return status;
}

v1::HeartbeatRequest WorkerAgent::BuildHeartbeat() {
  absl::MutexLock lock(&mu_);
  v1::HeartbeatRequest request;
  request.set_worker_id(worker_id_);
  request.set_session_id(session_id_);
  request.set_sequence(++heartbeats_sent_);
  for (size_t i = 0; i < slots_.size(); ++i) {
    v1::SlotStatus* slot = request.add_slots();
    slot->set_slot(static_cast<int64_t>(i));
    if (slots_[i].trainer != nullptr) {
      const v1::Assignment& assignment = slots_[i].trainer->assignment();
      slot->set_job_id(assignment.job_id());
      slot->set_generation(assignment.generation());
      slot->set_rank(assignment.rank());
    }
  }
  return request;
}

void WorkerAgent::HandleResponse(const v1::HeartbeatResponse& response) {
  // Cancellations first: an assignment in the same answer may reuse a slot they free.
  for (const v1::Cancellation& cancellation : response.cancellations()) {
    HandleCancellation(cancellation);
  }
  for (const v1::Assignment& assignment : response.assignments()) HandleAssignment(assignment);
  for (const v1::ProfileOrder& order : response.profiles()) HandleProfileOrder(order);
}

void WorkerAgent::HandleProfileOrder(const v1::ProfileOrder& order) {
  std::shared_ptr<TrainerSupervisor> trainer;
  {
    absl::MutexLock lock(&mu_);
    for (const Slot& slot : slots_) {
      if (slot.trainer != nullptr && slot.trainer->assignment().job_id() == order.job_id() &&
          slot.trainer->assignment().generation() == order.generation() &&
          slot.trainer->assignment().rank() == order.rank()) {
        trainer = slot.trainer;
      }
    }
  }
  ProfileAnswer failed;
  failed.worker_id = worker_id();
  failed.job_id = order.job_id();
  failed.generation = order.generation();
  failed.rank = order.rank();
  failed.capture_id = order.capture_id();
  failed.profile.set_capture_id(order.capture_id());
  if (trainer == nullptr) {
    failed.profile.set_error(absl::StrCat("rank ", order.rank(), " of attempt ", order.generation(),
                                          " does not run on worker ", worker_id()));
    uploader_.Submit(std::move(failed));
    return;
  }
  v1::ProfileRequest request;
  request.set_capture_id(order.capture_id());
  request.set_steps(order.steps());
  request.set_memory(order.memory());
  absl::Status asked = trainer->RequestProfile(request);
  spdlog::info("worker={} job={} attempt={} rank={} capture {} of {} step(s) asked: {}",
               worker_id(), order.job_id(), order.generation(), order.rank(), order.capture_id(),
               order.steps(), asked.ToString());
  if (!asked.ok()) {
    failed.profile.set_error(std::string(asked.message()));
    uploader_.Submit(std::move(failed));
  }
}

void WorkerAgent::HandleAssignment(const v1::Assignment& assignment) {
  spdlog::info("worker={} job={} attempt={} rank={} assigned to slot {}", worker_id(),
               assignment.job_id(), assignment.generation(), assignment.rank(), assignment.slot());
  if (assignment.slot() < 0 || assignment.slot() >= options_.slots) {
    ReportNotStarted(assignment,
                     absl::StrCat("slot ", assignment.slot(), " does not exist on worker ",
                                  worker_id(), " (it has ", options_.slots, ")"));
    return;
  }
  std::shared_ptr<TrainerSupervisor> to_start;
  std::shared_ptr<TrainerSupervisor> to_cancel;
  {
    absl::MutexLock lock(&mu_);
    if (shutdown_) return;
    for (const Slot& slot : slots_) {
      if ((slot.trainer != nullptr && SameRank(slot.trainer->assignment(), assignment)) ||
          (slot.next && SameRank(*slot.next, assignment))) {
        return;  // a repeated assignment
      }
    }
    Slot& slot = slots_[static_cast<size_t>(assignment.slot())];
    if (slot.trainer == nullptr) {
      slot.trainer = MakeSupervisor(assignment);
      to_start = slot.trainer;
    } else {
      if (slot.next) {
        spdlog::warn("worker={} job={} attempt={} rank={} dropped: slot {} was assigned again",
                     worker_id_, slot.next->job_id(), slot.next->generation(), slot.next->rank(),
                     assignment.slot());
      }
      slot.next = assignment;
      to_cancel = slot.trainer;
    }
  }
  if (to_cancel != nullptr) {
    to_cancel->Cancel(absl::StrCat("slot ", assignment.slot(), " was assigned to job ",
                                   assignment.job_id(), " attempt ", assignment.generation()));
  }
  if (to_start != nullptr) StartTrainer(to_start);
}

void WorkerAgent::HandleCancellation(const v1::Cancellation& cancellation) {
  auto matches = [&](const v1::Assignment& assignment) {
    return assignment.job_id() == cancellation.job_id() &&
           (cancellation.generation() == 0 || assignment.generation() == cancellation.generation());
  };
  std::vector<std::shared_ptr<TrainerSupervisor>> targets;
  {
    absl::MutexLock lock(&mu_);
    for (Slot& slot : slots_) {
      if (slot.trainer != nullptr && matches(slot.trainer->assignment())) {
        targets.push_back(slot.trainer);
      }
      if (slot.next && matches(*slot.next)) slot.next.reset();
    }
  }
  const std::string reason =
      cancellation.reason().empty() ? "cancelled by the coordinator" : cancellation.reason();
  for (const auto& trainer : targets) trainer->Cancel(reason);
}

std::shared_ptr<TrainerSupervisor> WorkerAgent::MakeSupervisor(const v1::Assignment& assignment) {
  TrainerSupervisorOptions trainer = options_.trainer;
  size_t slot = static_cast<size_t>(assignment.slot());
  if (slot < options_.slot_environment.size()) {
    for (const auto& variable : options_.slot_environment[slot]) {
      trainer.environment.push_back(variable);
    }
  }
  v1::Assignment rank = RankOf(assignment);
  trainer.on_output_line = [this, rank](absl::string_view line) {
    shipper_.AppendLine(worker_id(), rank.job_id(), rank.generation(), rank.rank(), line);
  };
  return std::make_shared<TrainerSupervisor>(
      assignment, std::move(trainer), launcher_, clock_,
      [this, rank](const RankReport& event) { OnTrainerEvent(rank, event); });
}

void WorkerAgent::StartTrainer(const std::shared_ptr<TrainerSupervisor>& trainer) {
  absl::Status status = trainer->Start();
  if (!status.ok()) {
    ReportNotStarted(trainer->assignment(),
                     absl::StrCat("could not start the trainer: ", status.ToString()));
  }
}

bool WorkerAgent::Connected() const {
  absl::MutexLock lock(&mu_);
  return call_context_ != nullptr && answered_ && !stream_ended_;
}

void WorkerAgent::OnTrainerEvent(const v1::Assignment& assignment, const RankReport& event) {
  if (event.profile) {
    ProfileAnswer answer;
    answer.worker_id = worker_id();
    answer.job_id = assignment.job_id();
    answer.generation = assignment.generation();
    answer.rank = assignment.rank();
    answer.capture_id = event.profile->capture_id();
    answer.capture_dir = event.profile_dir;
    answer.profile = *event.profile;
    uploader_.Submit(std::move(answer));
    return;
  }
  if (options_.on_event) options_.on_event(assignment, event);
  // The rank's captures go first: its end may end the attempt, and with it any capture the
  // coordinator has not been answered.
  if (IsTerminal(event.kind)) {
    uploader_.WaitFor(assignment.job_id(), assignment.generation(), assignment.rank());
  }
  v1::ReportProgressRequest request;
  request.set_worker_id(worker_id());
  request.set_job_id(assignment.job_id());
  request.set_generation(assignment.generation());
  request.set_rank(assignment.rank());
  request.set_event(event.kind);
  if (event.kind == v1::RANK_EVENT_PROGRESS || event.kind == v1::RANK_EVENT_SUCCEEDED) {
    *request.mutable_progress() = event.progress;
  }
  request.set_adapter_path(event.adapter_path);
  request.set_model_path(event.model_path);
  request.set_error(event.error);
  request.set_failure(event.failure);
  request.set_resumed_from_step(event.resumed_from_step);
  if (IsTerminal(event.kind)) {
    shipper_.Finished(assignment.job_id(), assignment.generation(), assignment.rank());
    reporter_.Report(std::move(request), [this, assignment] { ReleaseSlot(assignment); });
  } else {
    reporter_.Report(std::move(request));
  }
}

void WorkerAgent::ReportNotStarted(const v1::Assignment& assignment, const std::string& error) {
  spdlog::error("worker={} job={} attempt={} rank={} {}", worker_id(), assignment.job_id(),
                assignment.generation(), assignment.rank(), error);
  v1::ReportProgressRequest request;
  request.set_worker_id(worker_id());
  request.set_job_id(assignment.job_id());
  request.set_generation(assignment.generation());
  request.set_rank(assignment.rank());
  request.set_event(v1::RANK_EVENT_FAILED);
  request.set_error(error);
  request.set_failure(v1::FAILURE_KIND_INFRASTRUCTURE);  // this worker could not start it
  if (options_.on_event) {
    RankReport failed;
    failed.kind = v1::RANK_EVENT_FAILED;
    failed.error = error;
    failed.failure = v1::FAILURE_KIND_INFRASTRUCTURE;
    options_.on_event(assignment, failed);
  }
  v1::Assignment rank = RankOf(assignment);
  reporter_.Report(std::move(request), [this, rank] { ReleaseSlot(rank); });
}

void WorkerAgent::ReleaseSlot(const v1::Assignment& assignment) {
  std::shared_ptr<TrainerSupervisor> to_start;
  {
    absl::MutexLock lock(&mu_);
    if (assignment.slot() < 0 || assignment.slot() >= static_cast<int64_t>(slots_.size())) return;
    Slot& slot = slots_[static_cast<size_t>(assignment.slot())];
    if (slot.trainer == nullptr || !SameRank(slot.trainer->assignment(), assignment)) return;
    retired_.push_back(std::move(slot.trainer));
    slot.trainer = nullptr;
    if (slot.next) {
      if (!shutdown_) {
        slot.trainer = MakeSupervisor(*slot.next);
        to_start = slot.trainer;
      }
      slot.next.reset();
    }
  }
  if (to_start != nullptr) StartTrainer(to_start);
}

void WorkerAgent::StopTrainers() {
  // Promptly: captures still on the way are dropped (the coordinator fails them with their
  // attempt), and no rank's end waits for one.
  uploader_.Stop();
  std::vector<std::shared_ptr<TrainerSupervisor>> running;
  {
    absl::MutexLock lock(&mu_);
    for (Slot& slot : slots_) {
      if (slot.trainer != nullptr) running.push_back(slot.trainer);
      slot.next.reset();
    }
  }
  for (const auto& trainer : running) trainer->Cancel("the worker agent is shutting down");
  for (const auto& trainer : running) trainer->Wait();
  running.clear();
  // Reports their ends (one try each); releasing the slots retires the trainers.
  reporter_.Stop();
  std::vector<std::shared_ptr<TrainerSupervisor>> left;
  {
    absl::MutexLock lock(&mu_);
    for (Slot& slot : slots_) {
      if (slot.trainer != nullptr) left.push_back(std::move(slot.trainer));
      slot.trainer = nullptr;
    }
  }
  left.clear();
  DestroyRetired();
}

void WorkerAgent::DestroyRetired() {
  std::vector<std::shared_ptr<TrainerSupervisor>> retired;
  {
    absl::MutexLock lock(&mu_);
    retired.swap(retired_);
  }
  std::vector<v1::Assignment> ended;
  for (const auto& trainer : retired) ended.push_back(RankOf(trainer->assignment()));
  // Destroyed here, outside the lock (a destructor joins the trainer's reader thread).
  retired.clear();
  for (const v1::Assignment& rank : ended) {
    // Its trainer has ended; the folder holds the local copy of the log until it is shipped.
    pruner_.Ended(
        AttemptDirPruner::DirName(rank.job_id(), rank.generation(), rank.rank()),
        [this, rank] { return shipper_.Shipped(rank.job_id(), rank.generation(), rank.rank()); });
  }
}

void WorkerAgent::PruneAttemptDirs() {
  pruner_.Prune([this](const std::string& name) { return HoldsAttemptDir(name); });
}

bool WorkerAgent::HoldsAttemptDir(const std::string& name) const {
  auto is = [&name](const v1::Assignment& a) {
    return AttemptDirPruner::DirName(a.job_id(), a.generation(), a.rank()) == name;
  };
  absl::MutexLock lock(&mu_);
  for (const Slot& slot : slots_) {
    if (slot.trainer != nullptr && is(slot.trainer->assignment())) return true;
    if (slot.next && is(*slot.next)) return true;
  }
  for (const auto& trainer : retired_) {
    if (is(trainer->assignment())) return true;
  }
  return false;
}

void WorkerAgent::SleepUnlessShutdown(absl::Duration duration) {
  absl::MutexLock lock(&mu_);
  mu_.AwaitWithTimeout(absl::Condition(&shutdown_), duration);
}

std::string WorkerAgent::worker_id() const {
  absl::MutexLock lock(&mu_);
  return worker_id_;
}

}  // namespace lathe
