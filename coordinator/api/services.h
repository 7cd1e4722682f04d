// The coordinator's gRPC services: thin adapters from the generated service classes to the
// domain (JobManager, Scheduler). Each handler converts its request, calls
// one domain method and converts the absl::Status to a grpc::Status; no logic lives here.
//
// Thread-safety: thread-safe (the domain classes are).
#ifndef LATHE_COORDINATOR_API_SERVICES_H_
#define LATHE_COORDINATOR_API_SERVICES_H_

#include "coordinator/scheduler/job_manager.h"
#include "coordinator/scheduler/scheduler.h"
#include "grpcpp/grpcpp.h"
#include "lathe/v1/coordinator.grpc.pb.h"

namespace lathe {

class JobServiceImpl final : public v1::JobService::Service {
 public:
  JobServiceImpl(JobManager* jobs, Scheduler* scheduler) : jobs_(jobs), scheduler_(scheduler) {}

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
};

class WorkerServiceImpl final : public v1::WorkerService::Service {
 public:
  explicit WorkerServiceImpl(Scheduler* scheduler) : scheduler_(scheduler) {}

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

 private:
  Scheduler* const scheduler_;
};

}  // namespace lathe

#endif  // LATHE_COORDINATOR_API_SERVICES_H_
