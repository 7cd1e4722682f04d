#include "coordinator/server/coordinator_server.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "spdlog/spdlog.h"

namespace lathe {

absl::StatusOr<std::unique_ptr<CoordinatorServer>> CoordinatorServer::Start(
    const CoordinatorConfig& config) {
  std::unique_ptr<CoordinatorServer> server(new CoordinatorServer());
  if (config.insecure_no_auth) {
    server->auth_ = std::make_unique<Authenticator>(Authenticator::AllowAll());
    spdlog::warn(
        "AUTHENTICATION IS OFF (--insecure-no-auth): anyone who reaches {} may submit, cancel, "
        "register workers and report progress",
        config.listen);
  } else if (config.auth_tokens_path.empty()) {
    return absl::InvalidArgumentError(
        "--auth-tokens FILE is required (docs/services.md, \"Authentication\"), or "
        "--insecure-no-auth to let anyone who reaches the port do anything");
  } else {
    absl::StatusOr<Authenticator> auth = Authenticator::FromFile(config.auth_tokens_path);
    if (!auth.ok()) return Annotate(auth.status(), "--auth-tokens");
    server->auth_ = std::make_unique<Authenticator>(*std::move(auth));
  }
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
      MakeServerCredentials(config.tls);
  if (!credentials.ok()) return credentials.status();
  if (!config.tls.client_ca.empty()) server->auth_->RequireWorkerCertificates();
  if (config.db_path == ":memory:") {
    server->store_ = NewMemoryStore();
  } else {
    LATHE_ASSIGN_OR_RETURN(server->store_, OpenSqliteStore(config.db_path));
  }
  SchedulerOptions options{config.heartbeat_interval, config.heartbeat_timeout};
  LATHE_ASSIGN_OR_RETURN(server->scheduler_,
                         Scheduler::Create(server->store_.get(), &server->clock_, options));
  Scheduler* scheduler = server->scheduler_.get();
  server->jobs_ = std::make_unique<JobManager>(
      scheduler, JobManagerOptions{config.allowed_roots, config.pools});
  server->rendezvous_ =
      std::make_unique<RendezvousStore>([scheduler](absl::string_view job, int64_t generation) {
        return scheduler->IsActiveAttempt(job, generation);
      });
  const Authenticator* auth = server->auth_.get();
  server->job_service_ = std::make_unique<JobServiceImpl>(server->jobs_.get(), scheduler, auth);
  server->worker_service_ = std::make_unique<WorkerServiceImpl>(scheduler, auth);
  server->rendezvous_service_ =
      std::make_unique<RendezvousServiceImpl>(server->rendezvous_.get(), auth);

  grpc::ServerBuilder builder;
  builder.AddListeningPort(config.listen, *credentials, &server->port_);
  // Bounds on what one caller can make the server hold: a message, the streams of one
  // connection (WatchJob's are bounded per host by the service).
  builder.SetMaxReceiveMessageSize(4 << 20);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, 64);
  builder.RegisterService(server->job_service_.get());
  builder.RegisterService(server->worker_service_.get());
  builder.RegisterService(server->rendezvous_service_.get());
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr || server->port_ == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", config.listen));
  }
  server->heartbeat_checker_ =
      std::thread([s = server.get(), period = config.heartbeat_timeout / 4] {
        while (!s->stop_.WaitForNotificationWithTimeout(period)) s->scheduler_->CheckHeartbeats();
      });
  return server;
}

CoordinatorServer::~CoordinatorServer() { Shutdown(); }

void CoordinatorServer::Wait() { stop_.WaitForNotification(); }

void CoordinatorServer::Shutdown() {
  absl::MutexLock lock(&shutdown_mu_);
  if (!stop_.HasBeenNotified()) stop_.Notify();
  if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  if (heartbeat_checker_.joinable()) heartbeat_checker_.join();
}

}  // namespace lathe
