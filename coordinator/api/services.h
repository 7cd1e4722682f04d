// The coordinator's gRPC services: thin adapters from the generated callback service
// classes to the domain (JobManager, Scheduler). Each handler checks the caller's role
// (common/rpc/auth.h: JobService, ProfileJob included, and ListWorkers are clients' calls,
// DrainWorker and RemoveWorker admins', the rest of WorkerService workers'), checks that a worker's
// call names a worker id its token acts for, hands a client's identity to the domain (which shows
// it only its own jobs), converts its request, calls one domain method and converts the
// absl::Status to a grpc::Status; no other logic lives here.
//
// Thread-safety: thread-safe (the domain classes are).
#ifndef LATHE_COORDINATOR_API_SERVICES_H_
#define LATHE_COORDINATOR_API_SERVICES_H_

#include <map>
#include <string>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/rpc/auth.h"
#include "coordinator/api/work_pool.h"
#include "coordinator/logs/log_store.h"
#include "coordinator/logs/profile_store.h"
#include "coordinator/scheduler/job_manager.h"
#include "coordinator/scheduler/scheduler.h"
#include "grpcpp/grpcpp.h"
#include "lathe/v1/coordinator.grpc.pb.h"

namespace lathe {

// Told how long each unary call took and how it ended (the coordinator's metrics).
class RpcObserver {
 public:
  virtual ~RpcObserver() = default;
  // `method`: "SubmitJob", ...; called from the service's pool threads.
  virtual void ObserveRpc(const char* method, grpc::StatusCode code, absl::Duration took) = 0;
};

// Every method is a callback (reactor) method: streams hold no thread, and unary calls run
// on the service's WorkPool. WatchJob streams are bounded in all and per caller (the peer's
// host), RESOURCE_EXHAUSTED beyond; heartbeat streams by gRPC's per-connection stream limit.
struct JobServiceOptions {
  int max_watches = 4096;
  int max_watches_per_host = 1024;
  int threads = 4;
  size_t max_queued = 4096;             // calls waiting for a thread; UNAVAILABLE beyond
  RpcObserver* rpc_observer = nullptr;  // may be null; outlives the service
  LogStore* logs = nullptr;             // the ranks' logs; null: GetLogs is UNIMPLEMENTED
  // Profile captures' files; null: GetProfileFile is UNIMPLEMENTED.
  ProfileStore* profiles = nullptr;
};

class JobServiceImpl final : public v1::JobService::CallbackService {
 public:
  // REQUIRES: the arguments outlive the service.
  JobServiceImpl(JobManager* jobs, Scheduler* scheduler, const Authenticator* auth,
                 JobServiceOptions options = {})
      : jobs_(jobs),
        scheduler_(scheduler),
        auth_(auth),
        options_(options),
        pool_(options.threads, options.max_queued) {}

  grpc::ServerUnaryReactor* SubmitJob(grpc::CallbackServerContext* context,
                                      const v1::SubmitJobRequest* request,
                                      v1::SubmitJobResponse* response) override;
  grpc::ServerUnaryReactor* PlanJob(grpc::CallbackServerContext* context,
                                    const v1::PlanJobRequest* request,
                                    v1::PlanJobResponse* response) override;
  grpc::ServerUnaryReactor* GetPlanHistory(grpc::CallbackServerContext* context,
                                           const v1::GetPlanHistoryRequest* request,
                                           v1::GetPlanHistoryResponse* response) override;
  grpc::ServerUnaryReactor* GetJob(grpc::CallbackServerContext* context,
                                   const v1::GetJobRequest* request,
                                   v1::JobStatus* response) override;
  grpc::ServerUnaryReactor* ListJobs(grpc::CallbackServerContext* context,
                                     const v1::ListJobsRequest* request,
                                     v1::ListJobsResponse* response) override;
  grpc::ServerUnaryReactor* CancelJob(grpc::CallbackServerContext* context,
                                      const v1::CancelJobRequest* request,
                                      v1::JobStatus* response) override;
  grpc::ServerWriteReactor<v1::JobStatus>* WatchJob(grpc::CallbackServerContext* context,
                                                    const v1::WatchJobRequest* request) override;
  grpc::ServerUnaryReactor* GetLogs(grpc::CallbackServerContext* context,
                                    const v1::GetLogsRequest* request,
                                    v1::GetLogsResponse* response) override;
  grpc::ServerUnaryReactor* ProfileJob(grpc::CallbackServerContext* context,
                                       const v1::ProfileJobRequest* request,
                                       v1::ProfileJobResponse* response) override;
  grpc::ServerUnaryReactor* GetProfileFile(grpc::CallbackServerContext* context,
                                           const v1::GetProfileFileRequest* request,
                                           v1::GetProfileFileResponse* response) override;

 private:
  friend class WatchReactor;
  // Counts a watch of `host`; false when a limit is reached.
  bool AdmitWatch(const std::string& host);
  void ReleaseWatch(const std::string& host);

  JobManager* const jobs_;
  Scheduler* const scheduler_;
  const Authenticator* const auth_;
  const JobServiceOptions options_;
  WorkPool pool_;
  absl::Mutex watches_mu_;
  int watches_ ABSL_GUARDED_BY(watches_mu_) = 0;
  std::map<std::string, int> watches_by_host_ ABSL_GUARDED_BY(watches_mu_);
};

struct WorkerServiceOptions {
  int threads = 4;
  size_t max_queued = 16384;  // a registration burst of thousands waits here, not in threads
  RpcObserver* rpc_observer = nullptr;  // may be null; outlives the service
  LogStore* logs = nullptr;             // the ranks' logs; null: AppendLogs is UNIMPLEMENTED
  // Profile captures' files; null: UploadProfile and ReportProfile are UNIMPLEMENTED.
  ProfileStore* profiles = nullptr;
};

class WorkerServiceImpl final : public v1::WorkerService::CallbackService {
 public:
  WorkerServiceImpl(Scheduler* scheduler, const Authenticator* auth,
                    WorkerServiceOptions options = {})
      : scheduler_(scheduler),
        auth_(auth),
        observer_(options.rpc_observer),
        logs_(options.logs),
        profiles_(options.profiles),
        pool_(options.threads, options.max_queued) {}

  grpc::ServerUnaryReactor* RegisterWorker(grpc::CallbackServerContext* context,
                                           const v1::RegisterWorkerRequest* request,
                                           v1::RegisterWorkerResponse* response) override;
  // The stream's reads and writes run on gRPC's callback threads and take only the worker
  // registry's lock (Scheduler::Heartbeat, coordinator/scheduler/worker_registry.h); new
  // assignments are pushed on it. Its writes, like WatchJob's, go through a WriteQueue
  // (write_queue.h).
  grpc::ServerBidiReactor<v1::HeartbeatRequest, v1::HeartbeatResponse>* Heartbeat(
      grpc::CallbackServerContext* context) override;
  grpc::ServerUnaryReactor* ReportProgress(grpc::CallbackServerContext* context,
                                           const v1::ReportProgressRequest* request,
                                           v1::ReportProgressResponse* response) override;
  grpc::ServerUnaryReactor* ListWorkers(grpc::CallbackServerContext* context,
                                        const v1::ListWorkersRequest* request,
                                        v1::ListWorkersResponse* response) override;
  grpc::ServerUnaryReactor* DrainWorker(grpc::CallbackServerContext* context,
                                        const v1::DrainWorkerRequest* request,
                                        v1::WorkerStatus* response) override;
  grpc::ServerUnaryReactor* RemoveWorker(grpc::CallbackServerContext* context,
                                         const v1::RemoveWorkerRequest* request,
                                         v1::RemoveWorkerResponse* response) override;
  grpc::ServerUnaryReactor* AppendLogs(grpc::CallbackServerContext* context,
                                       const v1::AppendLogsRequest* request,
                                       v1::AppendLogsResponse* response) override;
  grpc::ServerUnaryReactor* UploadProfile(grpc::CallbackServerContext* context,
                                          const v1::UploadProfileRequest* request,
                                          v1::UploadProfileResponse* response) override;
  // The sizes the request lists are checked against the files stored: a file missing or
  // short turns the answer into an error naming it.
  grpc::ServerUnaryReactor* ReportProfile(grpc::CallbackServerContext* context,
                                          const v1::ReportProfileRequest* request,
                                          v1::ReportProfileResponse* response) override;

 private:
  Scheduler* const scheduler_;
  const Authenticator* const auth_;
  RpcObserver* const observer_;
  LogStore* const logs_;
  ProfileStore* const profiles_;
  WorkPool pool_;
};

}  // namespace lathe

#endif  // LATHE_COORDINATOR_API_SERVICES_H_
