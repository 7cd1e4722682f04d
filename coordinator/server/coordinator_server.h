// Builds the coordinator once, in dependency order (store, clock, scheduler, job manager,
// rendezvous store, gRPC services, server), and runs the heartbeat checker and the
// scheduling loop.
//
// Thread-safety: Start, port and Shutdown may be called from different threads.
#ifndef LATHE_COORDINATOR_SERVER_COORDINATOR_SERVER_H_
#define LATHE_COORDINATOR_SERVER_COORDINATOR_SERVER_H_

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/http/http_endpoints.h"
#include "common/rpc/tls.h"
#include "coordinator/api/services.h"
#include "coordinator/logs/log_store.h"
#include "coordinator/logs/profile_store.h"
#include "coordinator/metrics/coordinator_metrics.h"
#include "coordinator/rendezvous/rendezvous_service.h"
#include "coordinator/rendezvous/rendezvous_store.h"
#include "coordinator/scheduler/job_manager.h"
#include "coordinator/scheduler/scheduler.h"
#include "coordinator/server/grpc_listener.h"
#include "coordinator/server/port_probe.h"
#include "coordinator/store/database_lock.h"
#include "coordinator/store/store.h"
#include "grpcpp/grpcpp.h"
#include "planner/device_pools.h"

namespace lathe {

struct CoordinatorConfig {
  std::string listen = "127.0.0.1:7070";  // port 0 picks a free port
  std::string db_path = "lathe.db";       // ":memory:" keeps nothing
  absl::Duration heartbeat_interval = absl::Seconds(2);
  absl::Duration heartbeat_timeout = absl::Seconds(15);
  std::vector<std::string> allowed_roots;
  DevicePools pools = DefaultPools();  // the planner's rates per device pool
  // Bearer tokens with roles (common/rpc/auth.h); required unless insecure_no_auth.
  std::string auth_tokens_path;
  bool insecure_no_auth = false;  // every caller may do anything: logged loudly
  // TLS (common/rpc/tls.h); with a client CA, worker calls need a verified certificate.
  ServerTlsFiles tls;
  // Where the ranks' logs and the profile captures' files are kept; empty: beside the
  // database (<db>.logs), or a temporary directory (removed at exit) with ":memory:".
  std::string log_dir;
  // On shutdown, how long calls in flight have to finish before they are cancelled.
  absl::Duration shutdown_grace = absl::Seconds(2);
  // Where /metrics, /healthz and /readyz are served (docs/observability.md); empty: nowhere.
  std::string metrics_listen;
};

// How the coordinator shares its limit on open files (issue #27).
struct FdBudget {
  uint64_t limit = 0;  // the soft limit in effect at Start
  // Kept free of gRPC connections, for the store, the ranks' logs, gRPC's own descriptors
  // and the HTTP port's connections; the gRPC port refuses connections beyond the rest.
  int reserved = 0;
  // Wanted: `reserved` at full size and room for 1,024 gRPC connections.
  int wanted = 0;
};

class CoordinatorServer {
 public:
  // Below this limit on open files the coordinator does not start.
  static constexpr int kMinFdLimit = 128;

  // Reads the token file and the TLS files, opens the store, loads its state and starts
  // serving. INVALID_ARGUMENT without a token file or insecure_no_auth, or for a bad token
  // or TLS file; FAILED_PRECONDITION when the limit on open files is below kMinFdLimit;
  // UNAVAILABLE when the address cannot be bound; the store's errors otherwise.
  static absl::StatusOr<std::unique_ptr<CoordinatorServer>> Start(const CoordinatorConfig& config);
  // With `store` instead of the one config.db_path names (tests inject a slow one).
  static absl::StatusOr<std::unique_ptr<CoordinatorServer>> Start(const CoordinatorConfig& config,
                                                                  std::unique_ptr<Store> store);
  ~CoordinatorServer();

  // The port actually bound.
  int port() const { return port_; }
  // Whether the database file was missing or empty at start: a new database (said in the
  // start line, so that an emptied file is not taken silently for a fresh start).
  bool new_database() const { return new_database_; }
  // The port /metrics, /healthz and /readyz are served on; 0 without metrics_listen.
  int metrics_port() const { return http_ ? http_->port() : 0; }
  const FdBudget& fd_budget() const { return fd_budget_; }
  // Blocks until Shutdown.
  void Wait();
  // Stops serving (in-flight streams are cancelled) and the heartbeat checker.
  void Shutdown();

 private:
  CoordinatorServer() = default;

  RealClock clock_;
  std::unique_ptr<Authenticator> auth_;
  bool new_database_ = false;
  std::optional<DatabaseLock> db_lock_;  // held while the store is open (before it)
  std::unique_ptr<Store> store_;
  std::unique_ptr<Scheduler> scheduler_;
  std::unique_ptr<JobManager> jobs_;
  std::unique_ptr<RendezvousStore> rendezvous_;
  std::unique_ptr<CoordinatorMetrics> metrics_;
  std::unique_ptr<LogStore> logs_;
  std::unique_ptr<ProfileStore> profiles_;  // in the logs' directory
  std::string temporary_log_dir_;           // removed by the destructor
  std::unique_ptr<HttpEndpoints> http_;
  // Serving: between a successful Start and Shutdown (/readyz, the gRPC health service).
  std::atomic<bool> ready_{false};
  std::unique_ptr<JobServiceImpl> job_service_;
  std::unique_ptr<WorkerServiceImpl> worker_service_;
  std::unique_ptr<RendezvousServiceImpl> rendezvous_service_;
  FdBudget fd_budget_;
  std::unique_ptr<grpc::experimental::ExternalConnectionAcceptor> acceptor_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<GrpcListener> listener_;  // hands its connections to acceptor_
  std::unique_ptr<PortProbe> probe_;        // /readyz: whether listener_'s port serves
  int port_ = 0;
  absl::Duration shutdown_grace_;
  absl::Notification stop_;
  // Held through Shutdown: a signal's Shutdown and main's (after Wait returns) may race.
  absl::Mutex shutdown_mu_;
  std::thread heartbeat_checker_;
  std::thread scheduling_loop_;
};

}  // namespace lathe

#endif  // LATHE_COORDINATOR_SERVER_COORDINATOR_SERVER_H_
