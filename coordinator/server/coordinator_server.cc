#include "coordinator/server/coordinator_server.h"

#include <stdlib.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "common/file_util.h"
#include "common/status_macros.h"
#include "spdlog/spdlog.h"

namespace lathe {
namespace {

// How often the scheduling loop logs what its passes took.
constexpr absl::Duration kStatsPeriod = absl::Seconds(10);

// What the coordinator holds open besides gRPC connections and the HTTP port's: stdio, the
// database with its lock, write-ahead log and shared memory, gRPC's epoll and wake-up
// descriptors, a rank's log file while it is written or read, the files read to admit a
// job. Generous: running out of them fails calls in confusing ways.
constexpr int kOwnFds = 64;
// Room for gRPC connections (each agent holds one, each of its running trainers one, each
// CLI one) below which the start line warns.
constexpr int kWantedConnections = 1024;

FdBudget PlanFdBudget(uint64_t limit, bool http) {
  const int full = kOwnFds + (http ? HttpEndpoints::kMaxConnections : 0);
  FdBudget budget;
  budget.limit = limit;
  // At a low limit the HTTP port cannot have all it may use: half of the limit still goes
  // to gRPC connections.
  budget.reserved = static_cast<int>(std::min<uint64_t>(full, limit / 2));
  budget.wanted = full + kWantedConnections;
  return budget;
}

}  // namespace

absl::StatusOr<std::unique_ptr<CoordinatorServer>> CoordinatorServer::Start(
    const CoordinatorConfig& config) {
  return Start(config, nullptr);
}

absl::StatusOr<std::unique_ptr<CoordinatorServer>> CoordinatorServer::Start(
    const CoordinatorConfig& config, std::unique_ptr<Store> store) {
  std::unique_ptr<CoordinatorServer> server(new CoordinatorServer());
  server->shutdown_grace_ = config.shutdown_grace;
  rlimit fd_limit{};
  getrlimit(RLIMIT_NOFILE, &fd_limit);
  if (fd_limit.rlim_cur < static_cast<rlim_t>(kMinFdLimit)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "open files: the limit ", fd_limit.rlim_cur, " is below the ", kMinFdLimit,
        " the coordinator needs (raise it: ulimit -n, systemd's LimitNOFILE, docker's --ulimit "
        "nofile)"));
  }
  server->fd_budget_ = PlanFdBudget(fd_limit.rlim_cur, !config.metrics_listen.empty());
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
  if (store != nullptr) {
    server->store_ = std::move(store);
  } else if (config.db_path == ":memory:") {
    server->store_ = NewMemoryStore();
  } else {
    LATHE_ASSIGN_OR_RETURN(server->db_lock_,
                           DatabaseLock::Acquire(config.db_path, &server->new_database_));
    LATHE_ASSIGN_OR_RETURN(server->store_, OpenSqliteStore(config.db_path));
  }
  SchedulerOptions options;
  options.heartbeat_interval = config.heartbeat_interval;
  options.heartbeat_timeout = config.heartbeat_timeout;
  options.allowed_roots = config.allowed_roots;
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
  RpcObserver* observer = nullptr;
  if (!config.metrics_listen.empty()) {
    server->metrics_ = std::make_unique<CoordinatorMetrics>(scheduler);
    observer = server->metrics_.get();
    CoordinatorServer* s = server.get();
    LATHE_ASSIGN_OR_RETURN(
        server->http_,
        HttpEndpoints::Start({config.metrics_listen, server->metrics_->Collectables(),
                              [s] {
                                if (!s->ready_.load()) {
                                  return absl::UnavailableError("starting or shutting down");
                                }
                                return s->probe_->Check();
                              }},
                             "--metrics-listen"));
  }
  std::string log_dir = config.log_dir;
  if (log_dir.empty() && config.db_path != ":memory:") log_dir = config.db_path + ".logs";
  if (log_dir.empty()) {
    char pattern[] = "/tmp/lathe-logs-XXXXXX";
    if (mkdtemp(pattern) == nullptr) {
      return absl::InternalError("cannot create a temporary directory for the logs in /tmp");
    }
    log_dir = server->temporary_log_dir_ = pattern;
  }
  LATHE_ASSIGN_OR_RETURN(server->logs_, LogStore::Open(log_dir));
  LATHE_ASSIGN_OR_RETURN(server->profiles_, ProfileStore::Open(log_dir));
  JobServiceOptions job_options;
  job_options.rpc_observer = observer;
  job_options.logs = server->logs_.get();
  job_options.profiles = server->profiles_.get();
  WorkerServiceOptions worker_options;
  worker_options.rpc_observer = observer;
  worker_options.logs = server->logs_.get();
  worker_options.profiles = server->profiles_.get();
  server->job_service_ =
      std::make_unique<JobServiceImpl>(server->jobs_.get(), scheduler, auth, job_options);
  server->worker_service_ = std::make_unique<WorkerServiceImpl>(scheduler, auth, worker_options);
  server->rendezvous_service_ = std::make_unique<RendezvousServiceImpl>(
      server->rendezvous_.get(), auth, [scheduler](absl::string_view job, int64_t generation) {
        return scheduler->AttemptWorkers(job, generation);
      });

  // The standard grpc.health.v1 service (unauthenticated, for probes and load balancers):
  // SERVING from here until Shutdown.
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  // The port is the listener's, not gRPC's own (grpc_listener.h says why). It has no
  // SO_REUSEPORT (which gRPC's sets by default): a second coordinator on a taken port would
  // start and take half the connections; without it, binding a taken port fails and so does
  // Start.
  LATHE_ASSIGN_OR_RETURN(server->listener_,
                         GrpcListener::Bind(config.listen, server->fd_budget_.reserved));
  server->acceptor_ = builder.experimental().AddExternalConnectionAcceptor(
      grpc::ServerBuilder::experimental_type::ExternalConnectionType::FROM_FD, *credentials);
  // Bounds on what one caller can make the server hold: a message, the streams of one
  // connection (WatchJob's are bounded per host by the service), a connection that does not
  // finish its TLS and HTTP/2 handshake (10 s; gRPC's default is 120 s), one without a call
  // (closed after a minute; its client connects again when it next calls).
  builder.SetMaxReceiveMessageSize(4 << 20);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, 64);
  builder.AddChannelArgument(GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS, 10'000);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS, 60'000);
  builder.RegisterService(server->job_service_.get());
  builder.RegisterService(server->worker_service_.get());
  builder.RegisterService(server->rendezvous_service_.get());
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr) {
    return absl::UnavailableError(absl::StrCat("cannot serve gRPC on ", config.listen));
  }
  GrpcListener* listener = server->listener_.get();
  listener->Start(server->acceptor_.get());
  server->port_ = listener->port();
  std::string tls_roots;
  if (!config.tls.cert.empty()) {
    LATHE_ASSIGN_OR_RETURN(tls_roots, ReadFile(config.tls.cert));
  }
  server->probe_ = std::make_unique<PortProbe>(PortProbeOptions{
      listener->local_target(), tls_roots, absl::Seconds(1), absl::Seconds(2), [listener] {
        if (absl::Now() - listener->last_refused() > absl::Seconds(10)) return std::string();
        return absl::StrCat("it refuses connections: the process is near its limit of ",
                            listener->fd_limit(), " open files (", listener->refused(),
                            " refused since the start)");
      }});
  server->ready_ = true;
  // The heartbeat check, every timeout / 4. A gap between two ticks of over half the timeout
  // on the monotonic clock (which runs on while the process is stopped) means the coordinator
  // itself stood still, and could not receive heartbeats: the workers get a fresh window
  // rather than being charged for its stall (issue #27).
  server->heartbeat_checker_ = std::thread([s = server.get(), timeout = config.heartbeat_timeout] {
    auto last_tick = std::chrono::steady_clock::now();
    while (!s->stop_.WaitForNotificationWithTimeout(timeout / 4)) {
      const auto tick = std::chrono::steady_clock::now();
      const absl::Duration gap = absl::FromChrono(tick - last_tick);
      last_tick = tick;
      if (gap > timeout / 4 + timeout / 2) s->scheduler_->RenewHeartbeatWindows(gap - timeout / 4);
      s->scheduler_->CheckHeartbeats();
      s->rendezvous_->DropEnded();  // the keys of attempts that ended since
    }
  });
  // The scheduling loop: one pass for everything that changed since the last (a burst of
  // registrations is one pass), the heartbeats' reports, and the writes behind them. It
  // wakes at least every 100 ms to write progress behind.
  server->scheduling_loop_ = std::thread([s = server.get()] {
    absl::Time next_stats = absl::Now() + kStatsPeriod;
    while (!s->stop_.HasBeenNotified()) {
      s->scheduler_->WaitForWork(absl::Milliseconds(100));
      s->scheduler_->Settle();
      if (absl::Now() >= next_stats) {
        next_stats = absl::Now() + kStatsPeriod;
        const PassStats stats = s->scheduler_->TakePassStats();
        if (stats.passes > 0) {
          spdlog::info(
              "scheduler: {} passes in {}, longest {:.3f} ms, mean {:.3f} ms, {} jobs placed, {} "
              "heartbeat reports",
              stats.passes, absl::FormatDuration(kStatsPeriod),
              absl::ToDoubleMilliseconds(stats.longest),
              absl::ToDoubleMilliseconds(stats.total) / stats.passes, stats.placed,
              stats.heartbeat_reports);
        }
      }
    }
    s->scheduler_->Settle();  // what the last calls changed
  });
  return server;
}

CoordinatorServer::~CoordinatorServer() {
  Shutdown();
  http_.reset();  // its /readyz may be asking probe_
  if (!temporary_log_dir_.empty()) {
    std::error_code ignored;
    std::filesystem::remove_all(temporary_log_dir_, ignored);
  }
}

void CoordinatorServer::Wait() { stop_.WaitForNotification(); }

void CoordinatorServer::Shutdown() {
  absl::MutexLock lock(&shutdown_mu_);
  ready_ = false;
  if (server_ && server_->GetHealthCheckService() != nullptr) {
    server_->GetHealthCheckService()->Shutdown();  // NOT_SERVING from now on
  }
  if (!stop_.HasBeenNotified()) stop_.Notify();
  // Stop accepting connections and calls; those in flight get the grace period (their
  // writes are durable before they answer); then the scheduling loop writes what is left and
  // stops.
  if (listener_) listener_->Stop();
  if (server_) server_->Shutdown(absl::ToChronoTime(absl::Now() + shutdown_grace_));
  if (heartbeat_checker_.joinable()) heartbeat_checker_.join();
  if (scheduling_loop_.joinable()) scheduling_loop_.join();
}

}  // namespace lathe
