#include "client/job_client.h"

#include <grpcpp/client_context.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/sync_stream.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "common/rpc/auth.h"
#include "common/rpc/grpc_status.h"

namespace lathe {
namespace {

// gRPC's connection errors can span lines (a list of addresses tried); a CLI prints one.
std::string OneLine(absl::string_view text) {
  std::string line = absl::StrReplaceAll(absl::StripAsciiWhitespace(text), {{"\r", ""}});
  return absl::StrReplaceAll(line, {{"\n", "; "}});
}

}  // namespace

JobClient::JobClient(std::string address, JobClientOptions options)
    : JobClient(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()), address,
                options) {}

JobClient::JobClient(std::shared_ptr<grpc::Channel> channel, std::string address,
                     JobClientOptions options)
    : address_(std::move(address)),
      options_(options),
      channel_(std::move(channel)),
      jobs_(v1::JobService::NewStub(channel_)),
      workers_(v1::WorkerService::NewStub(channel_)) {}

absl::Status JobClient::Describe(const absl::Status& status) const {
  if (status.ok()) return status;
  const absl::StatusCode code = status.code();
  std::string message = OneLine(status.message());
  if (code == absl::StatusCode::kUnavailable || code == absl::StatusCode::kDeadlineExceeded) {
    if (message.empty()) {
      message = code == absl::StatusCode::kUnavailable ? "unavailable" : "deadline exceeded";
    }
    return absl::Status(code,
                        absl::StrCat("cannot reach the coordinator at ", address_, ": ", message));
  }
  // gRPC answers a method the server does not have with UNIMPLEMENTED and no message; the
  // coordinator's own UNIMPLEMENTED (a feature this build lacks) always says what is missing.
  if (code == absl::StatusCode::kUnimplemented && message.empty()) {
    return absl::Status(code, absl::StrCat("the server at ", address_,
                                           " does not serve this call (is it a Lathe "
                                           "coordinator of this version?)"));
  }
  return absl::Status(code, message);
}

absl::Status JobClient::Call(const std::function<grpc::Status(grpc::ClientContext*)>& rpc,
                             bool idempotent) const {
  const absl::Time deadline = absl::Now() + options_.call_timeout;
  RetryOptions retry = options_.retry;
  if (!idempotent) retry.max_attempts = 1;
  return Describe(RetryCall(retry, deadline, [&] {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(deadline));
    AttachToken(&context, options_.token);
    return FromGrpcStatus(rpc(&context));
  }));
}

absl::StatusOr<v1::SubmitJobResponse> JobClient::SubmitJob(const v1::JobSpec& spec,
                                                           absl::string_view request_id) const {
  v1::SubmitJobRequest request;
  *request.mutable_spec() = spec;
  request.set_request_id(std::string(request_id));
  v1::SubmitJobResponse response;
  // Without a request id a repeated submission would be a second job: tried once.
  absl::Status status =
      Call([&](grpc::ClientContext* c) { return jobs_->SubmitJob(c, request, &response); },
           /*idempotent=*/!request_id.empty());
  if (!status.ok()) return status;
  return response;
}

absl::StatusOr<v1::PlanJobResponse> JobClient::PlanJob(const v1::JobSpec& spec) const {
  v1::PlanJobRequest request;
  *request.mutable_spec() = spec;
  v1::PlanJobResponse response;
  absl::Status status =
      Call([&](grpc::ClientContext* c) { return jobs_->PlanJob(c, request, &response); });
  if (!status.ok()) return status;
  return response;
}

absl::StatusOr<v1::GetPlanHistoryResponse> JobClient::GetPlanHistory(int32_t limit) const {
  v1::GetPlanHistoryRequest request;
  request.set_limit(limit);
  v1::GetPlanHistoryResponse response;
  absl::Status status =
      Call([&](grpc::ClientContext* c) { return jobs_->GetPlanHistory(c, request, &response); });
  if (!status.ok()) return status;
  return response;
}

absl::StatusOr<v1::JobStatus> JobClient::GetJob(absl::string_view job_id) const {
  v1::GetJobRequest request;
  request.set_job_id(std::string(job_id));
  v1::JobStatus response;
  absl::Status status =
      Call([&](grpc::ClientContext* c) { return jobs_->GetJob(c, request, &response); });
  if (!status.ok()) return status;
  return response;
}

absl::StatusOr<v1::ListJobsResponse> JobClient::ListJobs(const JobFilter& filter,
                                                         absl::string_view page_token) const {
  v1::ListJobsRequest request;
  for (v1::JobState state : filter.states) request.add_states(state);
  request.set_name(filter.name);
  request.set_since_unix_ms(filter.since_unix_ms);
  request.set_page_size(options_.list_page_size);
  request.set_page_token(std::string(page_token));
  v1::ListJobsResponse response;
  absl::Status status =
      Call([&](grpc::ClientContext* c) { return jobs_->ListJobs(c, request, &response); });
  if (!status.ok()) return status;
  return response;
}

absl::StatusOr<std::vector<v1::JobStatus>> JobClient::ListNewestJobs(const JobFilter& filter,
                                                                     size_t limit,
                                                                     bool* more) const {
  std::vector<v1::JobStatus> jobs;
  std::string token;
  if (more != nullptr) *more = false;
  do {
    absl::StatusOr<v1::ListJobsResponse> page = ListJobs(filter, token);
    if (!page.ok()) return page.status();
    for (v1::JobStatus& job : *page->mutable_jobs()) {
      if (limit > 0 && jobs.size() == limit) {
        if (more != nullptr) *more = true;
        return jobs;
      }
      jobs.push_back(std::move(job));
    }
    if (!page->next_page_token().empty() && page->next_page_token() == token) {
      // A coordinator that hands back the token it was given would loop forever.
      return absl::InternalError(
          absl::StrCat("the coordinator at ", address_, " repeated page token \"", token, "\""));
    }
    token = page->next_page_token();
    if (limit > 0 && jobs.size() == limit && !token.empty()) {
      if (more != nullptr) *more = true;
      return jobs;
    }
  } while (!token.empty());
  return jobs;
}

absl::StatusOr<v1::JobStatus> JobClient::CancelJob(absl::string_view job_id,
                                                   absl::string_view reason) const {
  v1::CancelJobRequest request;
  request.set_job_id(std::string(job_id));
  request.set_reason(std::string(reason));
  v1::JobStatus response;
  absl::Status status =
      Call([&](grpc::ClientContext* c) { return jobs_->CancelJob(c, request, &response); });
  if (!status.ok()) return status;
  return response;
}

absl::StatusOr<v1::GetLogsResponse> JobClient::GetLogs(absl::string_view job_id, int64_t attempt,
                                                       int64_t rank, int64_t offset) const {
  v1::GetLogsRequest request;
  request.set_job_id(std::string(job_id));
  request.set_attempt(attempt);
  request.set_rank(rank);
  request.set_offset(offset);
  v1::GetLogsResponse response;
  absl::Status status =
      Call([&](grpc::ClientContext* c) { return jobs_->GetLogs(c, request, &response); });
  if (!status.ok()) return status;
  return response;
}

absl::StatusOr<v1::ProfileJobResponse> JobClient::ProfileJob(
    const v1::ProfileJobRequest& request) const {
  v1::ProfileJobResponse response;
  absl::Status status =
      Call([&](grpc::ClientContext* c) { return jobs_->ProfileJob(c, request, &response); },
           /*idempotent=*/false);
  if (!status.ok()) return status;
  return response;
}

absl::StatusOr<v1::GetProfileFileResponse> JobClient::GetProfileFile(absl::string_view job_id,
                                                                     absl::string_view capture_id,
                                                                     int64_t rank,
                                                                     absl::string_view name,
                                                                     int64_t offset) const {
  v1::GetProfileFileRequest request;
  request.set_job_id(std::string(job_id));
  request.set_capture_id(std::string(capture_id));
  request.set_rank(rank);
  request.set_name(std::string(name));
  request.set_offset(offset);
  v1::GetProfileFileResponse response;
  absl::Status status =
      Call([&](grpc::ClientContext* c) { return jobs_->GetProfileFile(c, request, &response); });
  if (!status.ok()) return status;
  return response;
}

absl::Status JobClient::WatchJob(absl::string_view job_id,
                                 const std::function<bool(const v1::JobStatus&)>& on_update) const {
  v1::WatchJobRequest request;
  request.set_job_id(std::string(job_id));
  grpc::ClientContext context;
  AttachToken(&context, options_.token);
  std::unique_ptr<grpc::ClientReader<v1::JobStatus>> reader = jobs_->WatchJob(&context, request);
  v1::JobStatus update;
  while (reader->Read(&update)) {
    if (!on_update(update)) {
      context.TryCancel();
      // Drain so that Finish does not block on messages already in flight.
      while (reader->Read(&update)) {
      }
      (void)reader->Finish();
      return absl::OkStatus();
    }
  }
  return Describe(FromGrpcStatus(reader->Finish()));
}

absl::StatusOr<std::vector<v1::WorkerStatus>> JobClient::ListWorkers() const {
  v1::ListWorkersRequest request;
  v1::ListWorkersResponse response;
  absl::Status status =
      Call([&](grpc::ClientContext* c) { return workers_->ListWorkers(c, request, &response); });
  if (!status.ok()) return status;
  return std::vector<v1::WorkerStatus>(response.workers().begin(), response.workers().end());
}

absl::StatusOr<v1::WorkerStatus> JobClient::DrainWorker(absl::string_view worker_id) const {
  v1::DrainWorkerRequest request;
  request.set_worker_id(std::string(worker_id));
  v1::WorkerStatus response;
  absl::Status status =
      Call([&](grpc::ClientContext* c) { return workers_->DrainWorker(c, request, &response); });
  if (!status.ok()) return status;
  return response;
}

absl::Status JobClient::RemoveWorker(absl::string_view worker_id) const {
  v1::RemoveWorkerRequest request;
  request.set_worker_id(std::string(worker_id));
  v1::RemoveWorkerResponse response;
  return Call(
      [&](grpc::ClientContext* c) { return workers_->RemoveWorker(c, request, &response); });
}

}  // namespace lathe
