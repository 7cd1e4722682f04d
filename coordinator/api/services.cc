#include "coordinator/api/services.h"

#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/proto/job_state.h"
#include "common/rpc/grpc_status.h"
#include "coordinator/api/write_queue.h"

namespace lathe {
namespace {

// A unary call: checks the caller's role at once, then runs `work(caller)` (returning the
// call's status, its result written into the response) on `pool`.
template <typename Work>
grpc::ServerUnaryReactor* Serve(grpc::CallbackServerContext* context, const Authenticator* auth,
                                std::initializer_list<Role> roles, const char* method,
                                WorkPool* pool, RpcObserver* observer, Work work) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  const absl::Time start = absl::Now();
  Caller caller;
  grpc::Status denied = auth->Check(*context, roles, method, &caller);
  if (!denied.ok()) {
    if (observer != nullptr) observer->ObserveRpc(method, denied.error_code(), absl::Now() - start);
    reactor->Finish(denied);
    return reactor;
  }
  auto run = [reactor, method, observer, start, caller = std::move(caller),
              work = std::move(work)]() mutable {
    grpc::Status status = work(caller);
    if (observer != nullptr) observer->ObserveRpc(method, status.error_code(), absl::Now() - start);
    reactor->Finish(status);
  };
  if (!pool->Schedule(std::move(run))) {
    reactor->Finish(grpc::Status(
        grpc::StatusCode::UNAVAILABLE,
        absl::StrCat("the coordinator has too many calls waiting; retry ", method, " later")));
  }
  return reactor;
}

// Moves a successful result into the response; the status either way.
template <typename T>
grpc::Status Respond(absl::StatusOr<T> result, T* response) {
  if (result.ok()) *response = *std::move(result);
  return ToGrpcStatus(result.status());
}

// What the domain knows of a client: whose jobs it sees, and who it is in their history.
Requester RequesterOf(const Caller& caller) {
  return {caller.name, caller.SeesEveryJob(), caller.Describe()};
}

// PERMISSION_DENIED unless the caller's token may act for `worker_id` (issue #27: a worker
// token made calls for another worker's ranks).
grpc::Status ActingFor(const Caller& caller, const std::string& worker_id) {
  if (caller.MayActFor(worker_id)) return grpc::Status::OK;
  return grpc::Status(
      grpc::StatusCode::PERMISSION_DENIED,
      absl::StrCat(caller.Describe(), " may not act for worker \"", worker_id.substr(0, 64),
                   "\" (its token names ", absl::StrJoin(caller.worker_ids, ", "), ")"));
}

}  // namespace

// --- JobService -----------------------------------------------------------------------

grpc::ServerUnaryReactor* JobServiceImpl::SubmitJob(grpc::CallbackServerContext* context,
                                                    const v1::SubmitJobRequest* request,
                                                    v1::SubmitJobResponse* response) {
  return Serve(context, auth_, kClientCall, "SubmitJob", &pool_, options_.rpc_observer,
               [=](const Caller& caller) {
                 return Respond(jobs_->Submit(*request, RequesterOf(caller)), response);
               });
}

grpc::ServerUnaryReactor* JobServiceImpl::PlanJob(grpc::CallbackServerContext* context,
                                                  const v1::PlanJobRequest* request,
                                                  v1::PlanJobResponse* response) {
  return Serve(context, auth_, kClientCall, "PlanJob", &pool_, options_.rpc_observer,
               [=](const Caller&) { return Respond(jobs_->Plan(*request), response); });
}

grpc::ServerUnaryReactor* JobServiceImpl::GetPlanHistory(grpc::CallbackServerContext* context,
                                                         const v1::GetPlanHistoryRequest* request,
                                                         v1::GetPlanHistoryResponse* response) {
  return Serve(context, auth_, kClientCall, "GetPlanHistory", &pool_, options_.rpc_observer,
               [=](const Caller& caller) {
                 return Respond(jobs_->PlanHistory(*request, RequesterOf(caller)), response);
               });
}

grpc::ServerUnaryReactor* JobServiceImpl::GetJob(grpc::CallbackServerContext* context,
                                                 const v1::GetJobRequest* request,
                                                 v1::JobStatus* response) {
  return Serve(context, auth_, kClientCall, "GetJob", &pool_, options_.rpc_observer,
               [=](const Caller& caller) {
                 return Respond(scheduler_->GetJob(request->job_id(), RequesterOf(caller)),
                                response);
               });
}

grpc::ServerUnaryReactor* JobServiceImpl::ListJobs(grpc::CallbackServerContext* context,
                                                   const v1::ListJobsRequest* request,
                                                   v1::ListJobsResponse* response) {
  return Serve(context, auth_, kClientCall, "ListJobs", &pool_, options_.rpc_observer,
               [=](const Caller& caller) {
                 return Respond(jobs_->List(*request, RequesterOf(caller)), response);
               });
}

grpc::ServerUnaryReactor* JobServiceImpl::CancelJob(grpc::CallbackServerContext* context,
                                                    const v1::CancelJobRequest* request,
                                                    v1::JobStatus* response) {
  return Serve(context, auth_, kClientCall, "CancelJob", &pool_, options_.rpc_observer,
               [=](const Caller& caller) {
                 return Respond(scheduler_->CancelJob(request->job_id(), request->reason(),
                                                      RequesterOf(caller)),
                                response);
               });
}

bool JobServiceImpl::AdmitWatch(const std::string& host) {
  absl::MutexLock lock(&watches_mu_);
  if (watches_ >= options_.max_watches || watches_by_host_[host] >= options_.max_watches_per_host) {
    if (watches_by_host_[host] == 0) watches_by_host_.erase(host);
    return false;
  }
  ++watches_;
  ++watches_by_host_[host];
  return true;
}

void JobServiceImpl::ReleaseWatch(const std::string& host) {
  absl::MutexLock lock(&watches_mu_);
  --watches_;
  if (--watches_by_host_[host] == 0) watches_by_host_.erase(host);
}

// One WatchJob stream: the scheduler calls OnChange (under its lock) with every new status;
// the newest one not yet written waits in the queue, so a slow reader sees the latest state
// and never a backlog. The stream ends after a final state is written.
class WatchReactor final : public grpc::ServerWriteReactor<v1::JobStatus> {
 public:
  // A status shared with the scheduler and every other watcher of the job.
  using JobView = std::shared_ptr<const v1::JobStatus>;

  WatchReactor(JobServiceImpl* service, std::string host)
      : service_(service),
        host_(std::move(host)),
        queue_(WriteQueue<JobView>::Keep::kNewest,
               grpc::Status(grpc::StatusCode::CANCELLED, "the watcher went away")) {}

  // REQUIRES: called once, right after construction.
  void Start(const std::string& job_id, const Requester& requester) {
    absl::StatusOr<uint64_t> watch = service_->scheduler_->Watch(
        job_id, [this](JobView status) { OnChange(std::move(status)); }, requester);
    if (!watch.ok()) {
      End(ToGrpcStatus(watch.status()));
      return;
    }
    absl::MutexLock lock(&mu_);
    watch_id_ = *watch;
  }

  void OnWriteDone(bool ok) override {
    const WriteQueue<JobView>::Next next = queue_.WriteDone(ok);
    if (next.write) StartWrite(queue_.Current().get());
    if (next.finish) Finish(*next.finish);
  }

  void OnCancel() override { End(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled")); }

  void OnDone() override {
    uint64_t watch = 0;
    {
      absl::MutexLock lock(&mu_);
      watch = watch_id_;
    }
    if (watch != 0) service_->scheduler_->Unwatch(watch);
    service_->ReleaseWatch(host_);
    delete this;
  }

 private:
  void OnChange(JobView status) {
    const bool last = IsFinalState(status->state());
    if (!queue_.Offer(std::move(status), last)) return;
    // Called under the scheduler's lock, once per watcher of the job: the write (which
    // serializes the status) runs on the pool. The queue holds the write as in flight, so
    // the stream cannot finish before the task has started it.
    if (!service_->pool_.Schedule([this] { StartWrite(queue_.Current().get()); })) {
      StartWrite(queue_.Current().get());
    }
  }

  // Finishes with `status` once no write is in flight.
  void End(grpc::Status status) {
    if (std::optional<grpc::Status> finish = queue_.End(std::move(status))) Finish(*finish);
  }

  JobServiceImpl* const service_;
  const std::string host_;
  WriteQueue<JobView> queue_;
  absl::Mutex mu_;
  uint64_t watch_id_ ABSL_GUARDED_BY(mu_) = 0;
};

grpc::ServerWriteReactor<v1::JobStatus>* JobServiceImpl::WatchJob(
    grpc::CallbackServerContext* context, const v1::WatchJobRequest* request) {
  // "ipv4:127.0.0.1:50000" -> "ipv4:127.0.0.1": one host's connections count together.
  const std::string peer = context->peer();
  const std::string host = peer.substr(0, peer.rfind(':'));
  Caller caller;
  grpc::Status refused = auth_->Check(*context, kClientCall, "WatchJob", &caller);
  if (refused.ok() && !AdmitWatch(host)) {
    refused = grpc::Status(
        grpc::StatusCode::RESOURCE_EXHAUSTED,
        absl::StrCat("too many WatchJob streams (at most ", options_.max_watches, " in all and ",
                     options_.max_watches_per_host, " from one host); end one or poll GetJob"));
  }
  if (!refused.ok()) {
    class Refused : public grpc::ServerWriteReactor<v1::JobStatus> {
     public:
      explicit Refused(const grpc::Status& status) { Finish(status); }
      void OnDone() override { delete this; }
    };
    return new Refused(refused);
  }
  auto* reactor = new WatchReactor(this, host);
  reactor->Start(request->job_id(), RequesterOf(caller));
  return reactor;
}

namespace {

constexpr int64_t kMaxLogChunk = 1 << 20;
constexpr int64_t kMaxLogOffset = int64_t{1} << 50;

}  // namespace

grpc::ServerUnaryReactor* JobServiceImpl::GetLogs(grpc::CallbackServerContext* context,
                                                  const v1::GetLogsRequest* request,
                                                  v1::GetLogsResponse* response) {
  return Serve(
      context, auth_, kClientCall, "GetLogs", &pool_, options_.rpc_observer,
      [=](const Caller& caller) {
        if (options_.logs == nullptr) {
          return grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "this coordinator keeps no logs");
        }
        if (request->offset() < 0 || request->max_bytes() < 0) {
          return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                              "offset and max_bytes: must be >= 0");
        }
        absl::StatusOr<std::pair<int64_t, bool>> attempt = scheduler_->LogAttempt(
            request->job_id(), request->attempt(), request->rank(), RequesterOf(caller));
        if (!attempt.ok()) return ToGrpcStatus(attempt.status());
        const int64_t max = request->max_bytes() == 0
                                ? kMaxLogChunk
                                : std::min<int64_t>(request->max_bytes(), kMaxLogChunk);
        absl::StatusOr<LogStore::Chunk> chunk = options_.logs->Read(
            {request->job_id(), attempt->first, request->rank()}, request->offset(), max);
        if (!chunk.ok()) return ToGrpcStatus(chunk.status());
        response->set_next_offset(request->offset() + static_cast<int64_t>(chunk->data.size()));
        response->set_data(std::move(chunk->data));
        response->set_attempt(attempt->first);
        response->set_attempt_active(attempt->second);
        response->set_size(chunk->size);
        return grpc::Status::OK;
      });
}

grpc::ServerUnaryReactor* JobServiceImpl::ProfileJob(grpc::CallbackServerContext* context,
                                                     const v1::ProfileJobRequest* request,
                                                     v1::ProfileJobResponse* response) {
  return Serve(context, auth_, kClientCall, "ProfileJob", &pool_, options_.rpc_observer,
               [=](const Caller& caller) {
                 if (options_.profiles == nullptr) {
                   return grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                                       "this coordinator keeps no profiles");
                 }
                 return Respond(scheduler_->ProfileJob(*request, RequesterOf(caller)), response);
               });
}

grpc::ServerUnaryReactor* JobServiceImpl::GetProfileFile(grpc::CallbackServerContext* context,
                                                         const v1::GetProfileFileRequest* request,
                                                         v1::GetProfileFileResponse* response) {
  return Serve(
      context, auth_, kClientCall, "GetProfileFile", &pool_, options_.rpc_observer,
      [=](const Caller& caller) {
        if (options_.profiles == nullptr) {
          return grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                              "this coordinator keeps no profiles");
        }
        if (request->offset() < 0 || request->max_bytes() < 0) {
          return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                              "offset and max_bytes: must be >= 0");
        }
        absl::StatusOr<std::pair<int64_t, v1::ProfileCapture>> capture =
            scheduler_->FindProfile(request->job_id(), request->capture_id(), RequesterOf(caller));
        if (!capture.ok()) return ToGrpcStatus(capture.status());
        // Only a file the capture lists: a name never reaches the file system unchecked.
        bool listed = false;
        for (const v1::ProfileFile& file : capture->second.files()) {
          listed = listed || (file.rank() == request->rank() && file.name() == request->name());
        }
        if (!listed) {
          return grpc::Status(
              grpc::StatusCode::NOT_FOUND,
              absl::StrCat("capture ", request->capture_id(), " has no file \"",
                           request->name().substr(0, 128), "\" of rank ", request->rank()));
        }
        const int64_t max = request->max_bytes() == 0
                                ? kMaxLogChunk
                                : std::min<int64_t>(request->max_bytes(), kMaxLogChunk);
        absl::StatusOr<ProfileStore::Chunk> chunk =
            options_.profiles->Read({request->job_id(), capture->first, request->capture_id(),
                                     request->rank(), request->name()},
                                    request->offset(), max);
        if (!chunk.ok()) return ToGrpcStatus(chunk.status());
        response->set_data(std::move(chunk->data));
        response->set_size(chunk->size);
        return grpc::Status::OK;
      });
}

// --- WorkerService --------------------------------------------------------------------

grpc::ServerUnaryReactor* WorkerServiceImpl::RegisterWorker(
    grpc::CallbackServerContext* context, const v1::RegisterWorkerRequest* request,
    v1::RegisterWorkerResponse* response) {
  return Serve(context, auth_, kWorkerCall, "RegisterWorker", &pool_, observer_,
               [=](const Caller& caller) {
                 if (grpc::Status denied = ActingFor(caller, request->worker_id()); !denied.ok()) {
                   return denied;
                 }
                 return Respond(scheduler_->RegisterWorker(*request), response);
               });
}

namespace {

// One worker's heartbeat stream: each heartbeat is answered at once from the worker's
// mailbox (no scheduling lock, no store), and assignments placed in between are pushed.
class HeartbeatReactor final
    : public grpc::ServerBidiReactor<v1::HeartbeatRequest, v1::HeartbeatResponse> {
 public:
  HeartbeatReactor(Scheduler* scheduler, const grpc::Status& denied, Caller caller)
      : scheduler_(scheduler),
        caller_(std::move(caller)),
        mail_(std::make_shared<Mail>(this)),
        queue_(WriteQueue<v1::HeartbeatResponse>::Keep::kEvery,
               grpc::Status(grpc::StatusCode::CANCELLED, "write failed")) {
    if (!denied.ok()) {
      End(denied);
      return;
    }
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the worker closed its side, or the call ended
      End(grpc::Status::OK);
      return;
    }
    if (grpc::Status denied = ActingFor(caller_, request_.worker_id()); !denied.ok()) {
      End(denied);
      return;
    }
    absl::StatusOr<v1::HeartbeatResponse> response = scheduler_->Heartbeat(request_, mail_);
    if (!response.ok()) {
      End(ToGrpcStatus(response.status()));
      return;
    }
    {
      absl::MutexLock lock(&mu_);
      worker_id_ = request_.worker_id();
      session_id_ = request_.session_id();
    }
    Send(*std::move(response));
    StartRead(&request_);
  }

  void OnWriteDone(bool ok) override {
    const WriteQueue<v1::HeartbeatResponse>::Next next = queue_.WriteDone(ok);
    if (next.write) StartWrite(&queue_.Current());
    if (next.finish) Finish(*next.finish);
  }

  void OnDone() override {
    mail_->Detach();
    delete this;
  }

 private:
  // The scheduler's handle on the stream; outlives the reactor when the scheduler holds it.
  class Mail final : public MailListener {
   public:
    explicit Mail(HeartbeatReactor* reactor) : reactor_(reactor) {}
    void OnMail() override {
      absl::MutexLock lock(&mu_);
      if (reactor_ != nullptr) reactor_->Push();
    }
    void Detach() {
      absl::MutexLock lock(&mu_);
      reactor_ = nullptr;
    }

   private:
    absl::Mutex mu_;
    HeartbeatReactor* reactor_ ABSL_GUARDED_BY(mu_);
  };

  // New mail between heartbeats: sent unprompted (in_reply_to 0).
  void Push() {
    std::string worker, session;
    {
      absl::MutexLock lock(&mu_);
      worker = worker_id_;
      session = session_id_;
    }
    v1::HeartbeatResponse mail = scheduler_->TakeMail(worker, session);
    if (mail.assignments_size() > 0 || mail.cancellations_size() > 0 || mail.profiles_size() > 0) {
      Send(std::move(mail));
    }
  }

  // Answers and pushes go out one at a time, in order.
  void Send(v1::HeartbeatResponse response) {
    if (queue_.Offer(std::move(response))) StartWrite(&queue_.Current());
  }

  // Finishes with `status` once no write is in flight.
  void End(const grpc::Status& status) {
    if (std::optional<grpc::Status> finish = queue_.End(status)) Finish(*finish);
  }

  Scheduler* const scheduler_;
  const Caller caller_;
  const std::shared_ptr<Mail> mail_;
  v1::HeartbeatRequest request_;  // the read in flight (one at a time)
  WriteQueue<v1::HeartbeatResponse> queue_;
  absl::Mutex mu_;
  std::string worker_id_ ABSL_GUARDED_BY(mu_);
  std::string session_id_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

grpc::ServerBidiReactor<v1::HeartbeatRequest, v1::HeartbeatResponse>* WorkerServiceImpl::Heartbeat(
    grpc::CallbackServerContext* context) {
  Caller caller;
  const grpc::Status denied = auth_->Check(*context, kWorkerCall, "Heartbeat", &caller);
  return new HeartbeatReactor(scheduler_, denied, std::move(caller));
}

grpc::ServerUnaryReactor* WorkerServiceImpl::ReportProgress(
    grpc::CallbackServerContext* context, const v1::ReportProgressRequest* request,
    v1::ReportProgressResponse*) {
  return Serve(context, auth_, kWorkerCall, "ReportProgress", &pool_, observer_,
               [=](const Caller& caller) {
                 if (grpc::Status denied = ActingFor(caller, request->worker_id()); !denied.ok()) {
                   return denied;
                 }
                 return ToGrpcStatus(scheduler_->ReportProgress(*request));
               });
}

grpc::ServerUnaryReactor* WorkerServiceImpl::ListWorkers(grpc::CallbackServerContext* context,
                                                         const v1::ListWorkersRequest*,
                                                         v1::ListWorkersResponse* response) {
  return Serve(context, auth_, kClientCall, "ListWorkers", &pool_, observer_, [=](const Caller&) {
    for (v1::WorkerStatus& worker : scheduler_->ListWorkers()) {
      *response->add_workers() = std::move(worker);
    }
    return grpc::Status::OK;
  });
}

grpc::ServerUnaryReactor* WorkerServiceImpl::DrainWorker(grpc::CallbackServerContext* context,
                                                         const v1::DrainWorkerRequest* request,
                                                         v1::WorkerStatus* response) {
  return Serve(context, auth_, kAdminCall, "DrainWorker", &pool_, observer_,
               [=](const Caller& caller) {
                 return Respond(scheduler_->DrainWorker(request->worker_id(), RequesterOf(caller)),
                                response);
               });
}

grpc::ServerUnaryReactor* WorkerServiceImpl::AppendLogs(grpc::CallbackServerContext* context,
                                                        const v1::AppendLogsRequest* request,
                                                        v1::AppendLogsResponse* response) {
  return Serve(
      context, auth_, kWorkerCall, "AppendLogs", &pool_, observer_, [=](const Caller& caller) {
        if (grpc::Status denied = ActingFor(caller, request->worker_id()); !denied.ok())
          return denied;
        if (logs_ == nullptr) {
          return grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "this coordinator keeps no logs");
        }
        if (request->offset() < 0 || request->offset() >= kMaxLogOffset || request->lost() < 0 ||
            request->lost() > request->offset() ||
            static_cast<int64_t>(request->data().size()) > kMaxLogChunk) {
          return grpc::Status(
              grpc::StatusCode::INVALID_ARGUMENT,
              "offset: must be in [0, 2^50); lost: in [0, offset]; data: at most 1 MiB");
        }
        absl::Status allowed = scheduler_->CheckLogWriter(request->job_id(), request->generation(),
                                                          request->rank(), request->worker_id());
        if (!allowed.ok()) return ToGrpcStatus(allowed);
        absl::StatusOr<int64_t> size =
            logs_->Append({request->job_id(), request->generation(), request->rank()},
                          request->offset(), request->data(), request->lost());
        if (!size.ok()) return ToGrpcStatus(size.status());
        response->set_size(*size);
        return grpc::Status::OK;
      });
}

grpc::ServerUnaryReactor* WorkerServiceImpl::UploadProfile(grpc::CallbackServerContext* context,
                                                           const v1::UploadProfileRequest* request,
                                                           v1::UploadProfileResponse* response) {
  return Serve(
      context, auth_, kWorkerCall, "UploadProfile", &pool_, observer_, [=](const Caller& caller) {
        if (grpc::Status denied = ActingFor(caller, request->worker_id()); !denied.ok())
          return denied;
        if (profiles_ == nullptr) {
          return grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                              "this coordinator keeps no profiles");
        }
        if (request->offset() < 0 || static_cast<int64_t>(request->data().size()) > kMaxLogChunk) {
          return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                              "offset: must be >= 0; data: at most 1 MiB");
        }
        if (absl::Status bad = CheckCaptureId(request->capture_id()); !bad.ok()) {
          return ToGrpcStatus(bad);
        }
        if (absl::Status bad = CheckProfileFileName(request->name()); !bad.ok()) {
          return ToGrpcStatus(bad);
        }
        absl::Status allowed = scheduler_->CheckProfileWriter(
            request->job_id(), request->generation(), request->rank(), request->capture_id(),
            request->worker_id());
        if (!allowed.ok()) return ToGrpcStatus(allowed);
        absl::StatusOr<int64_t> size =
            profiles_->Append({request->job_id(), request->generation(), request->capture_id(),
                               request->rank(), request->name()},
                              request->offset(), request->data());
        if (!size.ok()) return ToGrpcStatus(size.status());
        response->set_size(*size);
        return grpc::Status::OK;
      });
}

grpc::ServerUnaryReactor* WorkerServiceImpl::ReportProfile(grpc::CallbackServerContext* context,
                                                           const v1::ReportProfileRequest* request,
                                                           v1::ReportProfileResponse*) {
  return Serve(context, auth_, kWorkerCall, "ReportProfile", &pool_, observer_,
               [=](const Caller& caller) {
                 if (grpc::Status denied = ActingFor(caller, request->worker_id()); !denied.ok())
                   return denied;
                 if (profiles_ == nullptr) {
                   return grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                                       "this coordinator keeps no profiles");
                 }
                 constexpr int kMaxFiles = 64;
                 if (request->files_size() > kMaxFiles) {
                   return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                       absl::StrCat("files: at most ", kMaxFiles));
                 }
                 if (absl::Status bad = CheckCaptureId(request->capture_id()); !bad.ok()) {
                   return ToGrpcStatus(bad);
                 }
                 v1::ReportProfileRequest checked = *request;
                 std::string missing;
                 for (int i = 0; i < checked.files_size(); ++i) {
                   v1::ProfileFile* file = checked.mutable_files(i);
                   if (absl::Status bad =
                           CheckProfileFileName(file->name(), absl::StrCat("files[", i, "].name"));
                       !bad.ok()) {
                     return ToGrpcStatus(bad);
                   }
                   absl::StatusOr<int64_t> stored =
                       profiles_->Size({checked.job_id(), checked.generation(),
                                        checked.capture_id(), checked.rank(), file->name()});
                   const int64_t held = stored.ok() ? *stored : 0;
                   if (held != static_cast<int64_t>(file->size()) && missing.empty()) {
                     missing = absl::StrCat("file ", file->name(), ": the coordinator holds ", held,
                                            " of its ", file->size(), " bytes");
                   }
                   file->set_size(static_cast<uint64_t>(held));
                 }
                 if (!missing.empty() && checked.error().empty()) checked.set_error(missing);
                 return ToGrpcStatus(scheduler_->ReportProfile(checked));
               });
}

grpc::ServerUnaryReactor* WorkerServiceImpl::RemoveWorker(grpc::CallbackServerContext* context,
                                                          const v1::RemoveWorkerRequest* request,
                                                          v1::RemoveWorkerResponse*) {
  return Serve(context, auth_, kAdminCall, "RemoveWorker", &pool_, observer_, [=](const Caller&) {
    return ToGrpcStatus(scheduler_->RemoveWorker(request->worker_id()));
  });
}

}  // namespace lathe
