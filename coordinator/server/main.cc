// lathe-coordinator: takes jobs, schedules them onto workers, and keeps its state in SQLite.
#include <csignal>
#include <filesystem>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/command_line.h"
#include "common/fd_limit.h"
#include "common/file_util.h"
#include "coordinator/server/coordinator_server.h"
#include "spdlog/spdlog.h"

namespace lathe {
namespace {

const std::vector<FlagSpec> kFlags = {
    {"listen", true, "address to serve on (default 127.0.0.1:7070; port 0 picks one)"},
    {"db", true, "SQLite database, created if missing (default lathe.db; :memory: keeps nothing)"},
    {"heartbeat-timeout", true, "seconds without a heartbeat before a worker is lost (default 15)"},
    {"heartbeat-interval", true, "seconds between worker heartbeats (default 2)"},
    {"allowed-roots", true,
     "comma-separated directories that spec paths must lie inside (default: the current "
     "directory; / allows every path)"},
    {"device-rates", true,
     "JSON file of the planner's rates per device pool (docs/planner.md, \"Device pools\")"},
    {"auth-tokens", true,
     "file of bearer tokens, one \"<role> <name> <token>\" per line (roles: client, worker, "
     "admin); required unless --insecure-no-auth"},
    {"insecure-no-auth", false,
     "accept every call without a token: anyone who reaches the port may do anything"},
    {"tls-cert", true, "PEM certificate chain to serve TLS with (with --tls-key)"},
    {"tls-key", true, "PEM private key of --tls-cert"},
    {"log-dir", true,
     "where the ranks' logs are kept (default: <db>.logs; with --db :memory:, a temporary "
     "directory removed at exit)"},
    {"shutdown-grace", true,
     "seconds calls in flight get to finish on SIGTERM before they are cancelled (default 2)"},
    {"metrics-listen", true,
     "host:port to serve Prometheus metrics on, at /metrics (docs/observability.md; port 0 "
     "picks one); default: none"},
    {"tls-client-ca", true,
     "PEM roots for client certificates: mutual TLS, required of workers (with --tls-cert)"},
    {"help", false, "this message"},
};

int Main(int argc, char** argv) {
  absl::StatusOr<ParsedFlags> flags = ParseFlags({argv + 1, argv + argc}, kFlags);
  if (!flags.ok() || flags->Has("help") || !flags->positional().empty()) {
    if (!flags.ok()) std::cerr << "lathe-coordinator: " << flags.status().message() << "\n";
    std::cerr << "usage: lathe-coordinator [flags]\n" << FlagsHelp(kFlags);
    return flags.ok() && flags->Has("help") ? 0 : 2;
  }
  CoordinatorConfig config;
  config.listen = flags->Get("listen", config.listen);
  config.db_path = flags->Get("db", config.db_path);
  config.auth_tokens_path = flags->Get("auth-tokens");
  config.insecure_no_auth = flags->Has("insecure-no-auth");
  config.tls = {flags->Get("tls-cert"), flags->Get("tls-key"), flags->Get("tls-client-ca")};
  config.metrics_listen = flags->Get("metrics-listen");
  config.log_dir = flags->Get("log-dir");
  absl::StatusOr<double> grace = flags->GetDouble("shutdown-grace", 2);
  if (!grace.ok() || !(*grace >= 0)) {
    std::cerr << "lathe-coordinator: --shutdown-grace: "
              << (grace.ok() ? "must be >= 0 seconds" : std::string(grace.status().message()))
              << "\n";
    return 2;
  }
  config.shutdown_grace = absl::Seconds(*grace);
  if (config.insecure_no_auth && !config.auth_tokens_path.empty()) {
    std::cerr << "lathe-coordinator: --auth-tokens and --insecure-no-auth exclude each other\n";
    return 2;
  }
  if (!config.insecure_no_auth && config.auth_tokens_path.empty()) {
    std::cerr << "lathe-coordinator: --auth-tokens FILE is required (docs/services.md, "
                 "\"Authentication\"), or --insecure-no-auth to let anyone who reaches the "
                 "port do anything\n";
    return 2;
  }
  absl::StatusOr<double> timeout = flags->GetDouble("heartbeat-timeout", 15);
  absl::StatusOr<double> interval = flags->GetDouble("heartbeat-interval", 2);
  for (const absl::StatusOr<double>* value : {&timeout, &interval}) {
    if (!value->ok() || **value <= 0) {
      std::cerr << "lathe-coordinator: "
                << (value->ok() ? "heartbeat times must be > 0" : value->status().message())
                << "\n";
      return 2;
    }
  }
  if (*interval >= *timeout) {
    std::cerr << "lathe-coordinator: --heartbeat-interval must be below --heartbeat-timeout\n";
    return 2;
  }
  config.heartbeat_timeout = absl::Seconds(*timeout);
  config.heartbeat_interval = absl::Seconds(*interval);
  // Spec paths name files the trainers read and write: confined by default.
  std::error_code cwd_error;
  const std::string cwd = std::filesystem::current_path(cwd_error).string();
  config.allowed_roots = absl::StrSplit(flags->Get("allowed-roots", cwd), ',', absl::SkipEmpty());
  if (config.allowed_roots.empty()) {
    std::cerr << "lathe-coordinator: --allowed-roots: no directory given\n";
    return 2;
  }
  if (flags->Has("device-rates")) {
    const std::string path = flags->Get("device-rates");
    absl::StatusOr<std::string> text = ReadFile(path);
    absl::StatusOr<DevicePools> pools =
        text.ok() ? ParseDevicePools(*text, path) : absl::StatusOr<DevicePools>(text.status());
    if (!pools.ok()) {
      std::cerr << "lathe-coordinator: --device-rates: " << pools.status().message() << "\n";
      return 2;
    }
    config.pools = *std::move(pools);
  }

  // Every connection and file takes a descriptor: the soft limit is often far below the
  // hard one (issue #27). Before any thread starts.
  const absl::StatusOr<FdLimit> fd_limit = RaiseFdLimit();

  // Block the stop signals before any thread starts; one thread waits for them.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  absl::StatusOr<std::unique_ptr<CoordinatorServer>> server = CoordinatorServer::Start(config);
  if (!server.ok()) {
    std::cerr << "lathe-coordinator: " << server.status().message() << "\n";
    return 1;
  }
  std::string host = config.listen.substr(0, config.listen.rfind(':'));
  std::cout << "lathe-coordinator listening on " << host << ":" << (*server)->port() << " (db "
            << config.db_path << ((*server)->new_database() ? ", new or empty: a new database" : "")
            << "; spec paths inside " << absl::StrJoin(config.allowed_roots, ", ") << "; "
            << (config.tls.cert.empty() ? "no TLS: tokens and jobs cross the network in clear"
                : config.tls.client_ca.empty() ? "TLS"
                                               : "TLS, mutual TLS for workers")
            << ")" << std::endl;
  const FdBudget& budget = (*server)->fd_budget();
  const std::string fds = absl::StrCat(
      fd_limit.ok() ? DescribeFdLimit(*fd_limit) : std::string(fd_limit.status().message()), ": ",
      budget.limit - budget.reserved, " for gRPC connections, ", budget.reserved,
      " kept for the store and logs", config.metrics_listen.empty() ? "" : " and the HTTP port");
  if (budget.limit >= static_cast<uint64_t>(budget.wanted)) {
    spdlog::info("{}", fds);
  } else {
    spdlog::warn(
        "{}, below the {} wanted: raise the hard limit (ulimit -Hn, systemd's LimitNOFILE, "
        "docker's --ulimit nofile)",
        fds, budget.wanted);
  }
  if (!config.metrics_listen.empty()) {
    const std::string metrics_host =
        config.metrics_listen.substr(0, config.metrics_listen.rfind(':'));
    std::cout << "lathe-coordinator metrics on http://" << metrics_host << ":"
              << (*server)->metrics_port() << "/metrics" << std::endl;
  }
  std::thread waiter([&] {
    int signal = 0;
    sigwait(&signals, &signal);
    (*server)->Shutdown();
  });
  (*server)->Wait();
  (*server)->Shutdown();
  waiter.detach();  // still blocked in sigwait when shutdown came from elsewhere
  return 0;
}

}  // namespace
}  // namespace lathe

int main(int argc, char** argv) { return lathe::Main(argc, argv); }
