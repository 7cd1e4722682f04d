// The coordinator's gRPC services: thin adapters from the generated service classes to the
// domain (JobManager, Scheduler). Each handler checks the caller's role (common/rpc/auth.h:
// JobService and ListWorkers are clients' calls, DrainWorker and RemoveWorker admins', the
// rest of WorkerService workers'),
// converts its request, calls one domain method and converts the absl::Status to a
// grpc::Status; no other logic lives here.
//
// Thread-safety: thread-safe (the domain classes are).
#ifndef LATHE_COORDINATOR_API_SERVICES_H_
#define LATHE_COORDINATOR_API_SERVICES_H_

#include <map>
#include <string>

#include "absl/synchronization/mutex.h"
#include "common/rpc/auth.h"
#include "coordinator/scheduler/job_manager.h"
#include "coordinator/scheduler/scheduler.h"
#include "grpcpp/grpcpp.h"
#include "lathe/v1/coordinator.grpc.pb.h"

namespace lathe {

// Each WatchJob stream holds a server thread for as long as the job runs: bounded in all and
// per caller (the peer's host), RESOURCE_EXHAUSTED beyond.
struct JobServiceOptions {
  int max_watches = 256;
  int max_watches_per_host = 32;
};

class JobServiceImpl final : public v1::JobService::Service {
 public:
  // REQUIRES: the arguments outlive the service.
  JobServiceImpl(JobManager* jobs, Scheduler* scheduler, const Authenticator* auth,
                 JobServiceOptions options = {})
      : jobs_(jobs), scheduler_(scheduler), auth_(auth), options_(options) {}

  grpc::Status SubmitJob(grpc::ServerContext* context, const v1::SubmitJobRequest* request,
                         v1::SubmitJobResponse* response) override;
  grpc::Status PlanJob(grpc::ServerContext* context, const v1::PlanJobRequest* request,
                       v1::PlanJobResponse* response) override;
  grpc::Status GetPlanHistory(grpc::ServerContext* context,
                              const v1::GetPlanHistoryRequest* request,
                              v1::GetPlanHistoryResponse* response) override;
  grpc::Status GetJob(grpc::ServerContext* context, const v1::GetJobRequest* request,
                      v1::JobStatus* response) override;
  grpc::Status ListJobs(grpc::ServerContext* context, const v1::ListJobsRequest* request,
                        v1::ListJobsResponse* response) override;
  grpc::Status CancelJob(grpc::ServerContext* context, const v1::CancelJobRequest* request,
                         v1::JobStatus* response) override;
  grpc::Status WatchJob(grpc::ServerContext* context, const v1::WatchJobRequest* request,
                        grpc::ServerWriter<v1::JobStatus>* writer) override;

 private:
  JobManager* const jobs_;
  Scheduler* const scheduler_;
  const Authenticator* const auth_;
  const JobServiceOptions options_;
  absl::Mutex watches_mu_;
  int watches_ ABSL_GUARDED_BY(watches_mu_) = 0;
  std::map<std::string, int> watches_by_host_ ABSL_GUARDED_BY(watches_mu_);
};

class WorkerServiceImpl final : public v1::WorkerService::Service {
 public:
  WorkerServiceImpl(Scheduler* scheduler, const Authenticator* auth)
      : scheduler_(scheduler), auth_(auth) {}

  grpc::Status RegisterWorker(grpc::ServerContext* context,
                              const v1::RegisterWorkerRequest* request,
                              v1::RegisterWorkerResponse* response) override;
  grpc::Status Heartbeat(
      grpc::ServerContext* context,
      grpc::ServerReaderWriter<v1::HeartbeatResponse, v1::HeartbeatRequest>* stream) override;
  grpc::Status ReportProgress(grpc::ServerContext* context,
                              const v1::ReportProgressRequest* request,
                              v1::ReportProgressResponse* response) override;
  grpc::Status ListWorkers(grpc::ServerContext* context, const v1::ListWorkersRequest* request,
                           v1::ListWorkersResponse* response) override;
  grpc::Status DrainWorker(grpc::ServerContext* context, const v1::DrainWorkerRequest* request,
                           v1::WorkerStatus* response) override;
  grpc::Status RemoveWorker(grpc::ServerContext* context, const v1::RemoveWorkerRequest* request,
                            v1::RemoveWorkerResponse* response) override;

 private:
  Scheduler* const scheduler_;
  const Authenticator* const auth_;
};

}  // namespace lathe

#endif  // LATHE_COORDINATOR_API_SERVICES_H_
