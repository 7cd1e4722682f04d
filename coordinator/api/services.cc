#include "coordinator/api/services.h"

#include <string>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "common/proto/job_state.h"
#include "common/rpc/grpc_status.h"

namespace lathe {
namespace {

// Moves a successful result into the response; the status either way.
template <typename T>
grpc::Status Respond(absl::StatusOr<T> result, T* response) {
  if (result.ok()) *response = *std::move(result);
  return ToGrpcStatus(result.status());
}

}  // namespace

grpc::Status JobServiceImpl::SubmitJob(grpc::ServerContext* context,
                                       const v1::SubmitJobRequest* request,
                                       v1::SubmitJobResponse* response) {
  if (grpc::Status denied = auth_->Check(*context, kClientCall, "SubmitJob"); !denied.ok()) {
    return denied;
  }
  return Respond(jobs_->Submit(*request), response);
}

grpc::Status JobServiceImpl::PlanJob(grpc::ServerContext* context,
                                     const v1::PlanJobRequest* request,
                                     v1::PlanJobResponse* response) {
  if (grpc::Status denied = auth_->Check(*context, kClientCall, "PlanJob"); !denied.ok()) {
    return denied;
  }
  return Respond(jobs_->Plan(*request), response);
}

grpc::Status JobServiceImpl::GetPlanHistory(grpc::ServerContext* context,
                                            const v1::GetPlanHistoryRequest* request,
                                            v1::GetPlanHistoryResponse* response) {
  if (grpc::Status denied = auth_->Check(*context, kClientCall, "GetPlanHistory"); !denied.ok()) {
    return denied;
  }
  return Respond(jobs_->PlanHistory(*request), response);
}

grpc::Status JobServiceImpl::GetJob(grpc::ServerContext* context, const v1::GetJobRequest* request,
                                    v1::JobStatus* response) {
  if (grpc::Status denied = auth_->Check(*context, kClientCall, "GetJob"); !denied.ok()) {
    return denied;
  }
  return Respond(scheduler_->GetJob(request->job_id()), response);
}

grpc::Status JobServiceImpl::ListJobs(grpc::ServerContext* context,
                                      const v1::ListJobsRequest* request,
                                      v1::ListJobsResponse* response) {
  if (grpc::Status denied = auth_->Check(*context, kClientCall, "ListJobs"); !denied.ok()) {
    return denied;
  }
  return Respond(jobs_->List(*request), response);
}

grpc::Status JobServiceImpl::CancelJob(grpc::ServerContext* context,
                                       const v1::CancelJobRequest* request,
                                       v1::JobStatus* response) {
  if (grpc::Status denied = auth_->Check(*context, kClientCall, "CancelJob"); !denied.ok()) {
    return denied;
  }
  return Respond(scheduler_->CancelJob(request->job_id(), request->reason()), response);
}

grpc::Status JobServiceImpl::WatchJob(grpc::ServerContext* context,
                                      const v1::WatchJobRequest* request,
                                      grpc::ServerWriter<v1::JobStatus>* writer) {
  if (grpc::Status denied = auth_->Check(*context, kClientCall, "WatchJob"); !denied.ok()) {
    return denied;
  }
  // "ipv4:127.0.0.1:50000" -> "ipv4:127.0.0.1": one host's connections count together.
  const std::string peer = context->peer();
  const std::string host = peer.substr(0, peer.rfind(':'));
  {
    absl::MutexLock lock(&watches_mu_);
    if (watches_ >= options_.max_watches ||
        watches_by_host_[host] >= options_.max_watches_per_host) {
      return grpc::Status(
          grpc::StatusCode::RESOURCE_EXHAUSTED,
          absl::StrCat("too many WatchJob streams (at most ", options_.max_watches, " in all and ",
                       options_.max_watches_per_host, " from one host); end one or poll GetJob"));
    }
    ++watches_;
    ++watches_by_host_[host];
  }
  absl::Cleanup release = [this, &host] {
    absl::MutexLock lock(&watches_mu_);
    --watches_;
    if (--watches_by_host_[host] == 0) watches_by_host_.erase(host);
  };
  uint64_t version = 0;  // jobs start at version 1: the first wait returns at once
  while (!context->IsCancelled()) {
    const uint64_t seen = version;
    // Wake up every second to notice a client that went away.
    absl::StatusOr<v1::JobStatus> status =
        scheduler_->WaitForJobChange(request->job_id(), &version, absl::Now() + absl::Seconds(1));
    if (!status.ok()) return ToGrpcStatus(status.status());
    if (version == seen) continue;
    if (!writer->Write(*status) || IsFinalState(status->state())) break;
  }
  return grpc::Status::OK;
}

grpc::Status WorkerServiceImpl::RegisterWorker(grpc::ServerContext* context,
                                               const v1::RegisterWorkerRequest* request,
                                               v1::RegisterWorkerResponse* response) {
  if (grpc::Status denied = auth_->Check(*context, kWorkerCall, "RegisterWorker"); !denied.ok()) {
    return denied;
  }
  return Respond(scheduler_->RegisterWorker(*request), response);
}

grpc::Status WorkerServiceImpl::Heartbeat(
    grpc::ServerContext* context,
    grpc::ServerReaderWriter<v1::HeartbeatResponse, v1::HeartbeatRequest>* stream) {
  if (grpc::Status denied = auth_->Check(*context, kWorkerCall, "Heartbeat"); !denied.ok()) {
    return denied;
  }
  v1::HeartbeatRequest request;
  while (stream->Read(&request)) {
    absl::StatusOr<v1::HeartbeatResponse> response = scheduler_->Heartbeat(request);
    if (!response.ok()) return ToGrpcStatus(response.status());
    if (!stream->Write(*response)) break;
  }
  return grpc::Status::OK;
}

grpc::Status WorkerServiceImpl::ReportProgress(grpc::ServerContext* context,
                                               const v1::ReportProgressRequest* request,
                                               v1::ReportProgressResponse*) {
  if (grpc::Status denied = auth_->Check(*context, kWorkerCall, "ReportProgress"); !denied.ok()) {
    return denied;
  }
  return ToGrpcStatus(scheduler_->ReportProgress(*request));
}

grpc::Status WorkerServiceImpl::ListWorkers(grpc::ServerContext* context,
                                            const v1::ListWorkersRequest*,
                                            v1::ListWorkersResponse* response) {
  if (grpc::Status denied = auth_->Check(*context, kClientCall, "ListWorkers"); !denied.ok()) {
    return denied;
  }
  for (v1::WorkerStatus& worker : scheduler_->ListWorkers()) {
    *response->add_workers() = std::move(worker);
  }
  return grpc::Status::OK;
}

grpc::Status WorkerServiceImpl::DrainWorker(grpc::ServerContext* context,
                                            const v1::DrainWorkerRequest* request,
                                            v1::WorkerStatus* response) {
  if (grpc::Status denied = auth_->Check(*context, kAdminCall, "DrainWorker"); !denied.ok()) {
    return denied;
  }
  return Respond(scheduler_->DrainWorker(request->worker_id()), response);
}

grpc::Status WorkerServiceImpl::RemoveWorker(grpc::ServerContext* context,
                                             const v1::RemoveWorkerRequest* request,
                                             v1::RemoveWorkerResponse*) {
  if (grpc::Status denied = auth_->Check(*context, kAdminCall, "RemoveWorker"); !denied.ok()) {
    return denied;
  }
  return ToGrpcStatus(scheduler_->RemoveWorker(request->worker_id()));
}

}  // namespace lathe
