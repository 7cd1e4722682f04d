// A typed client for the coordinator's JobService and WorkerService (the `lathe` CLI's
// transport). Each method is one RPC (ListNewestJobs follows pagination), returns the
// coordinator's answer or its error as an absl::Status with the gRPC code kept, and never
// throws.
//
// Errors: the code and message of the coordinator's status (common/rpc/grpc_status.h);
// UNAVAILABLE and DEADLINE_EXCEEDED (the coordinator cannot be reached, or did not answer in
// time) keep their code and read "cannot reach the coordinator at <address>: <reason>" on
// one line; gRPC's own UNIMPLEMENTED (no such method: something else, or another version,
// listens there) says so, while the coordinator's UNIMPLEMENTED (a feature this build of
// Lathe lacks) keeps its message. Unary calls are retried under the retry policy
// (common/rpc/retry_policy.h), all tries within call_timeout.
//
// Thread-safety: a JobClient is immutable after construction; every method may be called
// from several threads at once (gRPC channels and stubs are thread-safe).
#ifndef LATHE_CLIENT_JOB_CLIENT_H_
#define LATHE_CLIENT_JOB_CLIENT_H_

#include <grpcpp/channel.h>
#include <grpcpp/support/status.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/rpc/retry_policy.h"
#include "lathe/v1/coordinator.grpc.pb.h"
#include "lathe/v1/coordinator.pb.h"
#include "lathe/v1/job.pb.h"

namespace lathe {

struct JobClientOptions {
  // Deadline of each unary RPC, its retries included. WatchJob has none: a job may run for
  // days.
  absl::Duration call_timeout = absl::Seconds(10);
  // Sent with every call as a bearer token (common/rpc/auth.h); none when empty.
  std::string token;
  // A person waits on the CLI: a few quick tries, then the error.
  RetryOptions retry = QuickRetries();

  static RetryOptions QuickRetries() {
    RetryOptions quick;
    quick.initial_backoff = absl::Milliseconds(100);
    quick.max_backoff = absl::Seconds(1);
    quick.max_attempts = 3;
    return quick;
  }
  // Jobs asked for per ListJobs page.
  int32_t list_page_size = 100;
};

// What ListJobs selects (docs/services.md): every field empty or 0 selects all jobs.
struct JobFilter {
  std::vector<v1::JobState> states;
  std::string name;           // the spec's name exactly
  int64_t since_unix_ms = 0;  // submitted at or after
};

class JobClient {
 public:
  // A client over an insecure channel to `address` (host:port). Connects lazily: an
  // unreachable coordinator shows up as UNAVAILABLE from the first call.
  explicit JobClient(std::string address, JobClientOptions options = {});
  // A client over an existing channel; `address` only names it in messages.
  JobClient(std::shared_ptr<grpc::Channel> channel, std::string address,
            JobClientOptions options = {});

  JobClient(const JobClient&) = delete;
  JobClient& operator=(const JobClient&) = delete;

  const std::string& address() const { return address_; }

  // JobService.SubmitJob. INVALID_ARGUMENT naming the field for a spec the coordinator
  // refuses, UNIMPLEMENTED for one the engine cannot run. A repeated `request_id` returns the
  // first submission (response.existing()); without one the call is not retried.
  absl::StatusOr<v1::SubmitJobResponse> SubmitJob(const v1::JobSpec& spec,
                                                  absl::string_view request_id) const;

  // JobService.PlanJob: the plan the coordinator would make, nothing stored.
  absl::StatusOr<v1::PlanJobResponse> PlanJob(const v1::JobSpec& spec) const;

  // JobService.GetPlanHistory: the latest `limit` measured attempts and the corrections.
  absl::StatusOr<v1::GetPlanHistoryResponse> GetPlanHistory(int32_t limit) const;

  // JobService.GetJob. NOT_FOUND for an unknown id.
  absl::StatusOr<v1::JobStatus> GetJob(absl::string_view job_id) const;

  // JobService.ListJobs, one page of the jobs `filter` selects.
  absl::StatusOr<v1::ListJobsResponse> ListJobs(const JobFilter& filter,
                                                absl::string_view page_token) const;

  // The newest `limit` jobs `filter` selects (0: all of them), newest first, following
  // next_page_token; `*more` (may be null) says whether older ones were left out.
  absl::StatusOr<std::vector<v1::JobStatus>> ListNewestJobs(const JobFilter& filter, size_t limit,
                                                            bool* more = nullptr) const;

  // JobService.CancelJob: the job's status afterwards (unchanged for a finished job).
  // NOT_FOUND for an unknown id.
  absl::StatusOr<v1::JobStatus> CancelJob(absl::string_view job_id, absl::string_view reason) const;

  // JobService.GetLogs: a rank's log from `offset` (attempt 0: the latest).
  absl::StatusOr<v1::GetLogsResponse> GetLogs(absl::string_view job_id, int64_t attempt,
                                              int64_t rank, int64_t offset) const;

  // JobService.ProfileJob: a capture of the job's next steps (not retried: a second try
  // would find the first capture pending).
  absl::StatusOr<v1::ProfileJobResponse> ProfileJob(const v1::ProfileJobRequest& request) const;

  // JobService.GetProfileFile: a capture's file from `offset`, at most 1 MiB of it.
  absl::StatusOr<v1::GetProfileFileResponse> GetProfileFile(absl::string_view job_id,
                                                            absl::string_view capture_id,
                                                            int64_t rank, absl::string_view name,
                                                            int64_t offset) const;

  // JobService.WatchJob: calls `on_update` with the current status and then once per change,
  // on the calling thread, until the coordinator ends the stream (the job ended) or
  // `on_update` returns false. OK then; otherwise the stream's error (NOT_FOUND for an
  // unknown id). No deadline.
  absl::Status WatchJob(absl::string_view job_id,
                        const std::function<bool(const v1::JobStatus&)>& on_update) const;

  // WorkerService.ListWorkers.
  absl::StatusOr<std::vector<v1::WorkerStatus>> ListWorkers() const;

  // WorkerService.DrainWorker and RemoveWorker (admin tokens). NOT_FOUND for an unknown id.
  absl::StatusOr<v1::WorkerStatus> DrainWorker(absl::string_view worker_id) const;
  absl::Status RemoveWorker(absl::string_view worker_id) const;

 private:
  // Runs `rpc` (one call on a fresh context) under the retry policy (once only when the
  // call is not `idempotent`) and the call deadline, and describes a failure for a person
  // (see the file comment).
  absl::Status Call(const std::function<grpc::Status(grpc::ClientContext*)>& rpc,
                    bool idempotent = true) const;
  // `status` with the coordinator's address where that helps, on one line.
  absl::Status Describe(const absl::Status& status) const;

  std::string address_;
  JobClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::JobService::Stub> jobs_;
  std::unique_ptr<v1::WorkerService::Stub> workers_;
};

}  // namespace lathe

#endif  // LATHE_CLIENT_JOB_CLIENT_H_
