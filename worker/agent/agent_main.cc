#include "worker/agent/agent_main.h"

#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/command_line.h"
#include "common/fd_limit.h"
#include "common/http/http_endpoints.h"
#include "common/rpc/auth.h"
#include "common/rpc/tls.h"
#include "common/status_macros.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"
#include "lathe/v1/coordinator.grpc.pb.h"
#include "spdlog/spdlog.h"
#include "worker/agent/agent_metrics.h"
#include "worker/agent/host_resources.h"
#include "worker/agent/process_launcher.h"
#include "worker/agent/worker_agent.h"

namespace lathe {
namespace {

const std::vector<FlagSpec> kAgentFlags = {
    {"coordinator", true,
     "coordinator host:port (default $LATHE_COORDINATOR, else 127.0.0.1:7070)"},
    {"device", true, "cpu | cuda (default cpu)"},
    {"slots", true,
     "ranks run at once: GPUs, or CPU slots (default: cuda, one per GPU visible; cpu, 1)"},
    {"worker-id", true, "name to register under (default <hostname>-<device>)"},
    {"work-dir", true, "per-rank specs and logs (default /tmp/lathe-worker-<worker-id>)"},
    {"keep-attempt-dirs", true,
     "how long a finished rank's folder stays in the work dir once its log is with the "
     "coordinator, e.g. 30m, 24h, 0 (remove at once), inf (keep) (default 24h)"},
    {"trainer-threads", true, "intra-op threads per trainer, passed as --threads (default all)"},
    {"collective-timeout", true,
     "seconds a trainer's collective waits for the other ranks before it fails (default 60)"},
    {"stop-grace", true,
     "seconds a trainer asked to stop (cancelled, drained, or the agent shutting down on "
     "SIGTERM) has to checkpoint and exit before SIGKILL (default 5)"},
    {"trainer-binary", true, "lathe-worker binary that runs `train` (default this one)"},
    {"token", true,
     "the worker's bearer token (default: --token-file, then $LATHE_TOKEN); its trainers get it "
     "as $LATHE_TOKEN"},
    {"token-file", true, "file holding the worker's bearer token"},
    {"tls-ca", true,
     "PEM roots of the coordinator's certificate: connect with TLS (default $LATHE_TLS_CA); "
     "its trainers get the TLS files as $LATHE_TLS_CA, $LATHE_TLS_CERT, $LATHE_TLS_KEY"},
    {"tls-cert", true, "PEM certificate of this worker, for mutual TLS (default $LATHE_TLS_CERT)"},
    {"metrics-listen", true,
     "host:port to serve /metrics, /healthz and /readyz on (docs/observability.md; port 0 "
     "picks one); default: none"},
    {"tls-key", true, "PEM private key of --tls-cert (default $LATHE_TLS_KEY)"},
    {"peak-flops", true,
     "peak FLOP/s of one slot's device, for MFU (default: looked up (CUDA) or measured (CPU) by "
     "each trainer)"},
};

std::string HostName() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0 || name[0] == '\0') return "localhost";
  return name;
}

absl::StatusOr<WorkerAgentOptions> OptionsFromFlags(const ParsedFlags& flags,
                                                    const std::string& default_trainer,
                                                    ProcessLauncher& launcher) {
  WorkerAgentOptions options;
  const std::string device = flags.Get("device", "cpu");
  if (device == "cpu") {
    options.device = v1::DEVICE_CPU;
  } else if (device == "cuda") {
    options.device = v1::DEVICE_CUDA;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--device: expected cpu or cuda, got \"", device, "\""));
  }
  LATHE_ASSIGN_OR_RETURN(options.slots, flags.GetInt("slots", 1));
  if (options.slots < 1) {
    return absl::InvalidArgumentError(absl::StrCat("--slots: must be >= 1, got ", options.slots));
  }
  options.worker_id = flags.Get("worker-id", absl::StrCat(HostName(), "-", device));
  if (options.worker_id.empty())
    return absl::InvalidArgumentError("--worker-id: must not be empty");

  const char* env_coordinator = std::getenv("LATHE_COORDINATOR");
  std::string coordinator = flags.Get(
      "coordinator",
      env_coordinator != nullptr && *env_coordinator != '\0' ? env_coordinator : "127.0.0.1:7070");
  TrainerSupervisorOptions& trainer = options.trainer;
  trainer.coordinator_address = coordinator;
  trainer.work_dir = flags.Get("work-dir", absl::StrCat("/tmp/lathe-worker-", options.worker_id));
  const std::string keep = flags.Get("keep-attempt-dirs", "24h");
  if (!absl::ParseDuration(keep, &options.keep_attempt_dirs) ||
      options.keep_attempt_dirs < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--keep-attempt-dirs: expected a duration >= 0 such as 30m, 24h or 0, got \"", keep, "\""));
  }
  LATHE_ASSIGN_OR_RETURN(trainer.trainer_threads, flags.GetInt("trainer-threads", 0));
  if (trainer.trainer_threads < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--trainer-threads: must be >= 0, got ", trainer.trainer_threads));
  }
  LATHE_ASSIGN_OR_RETURN(trainer.peak_flops, flags.GetDouble("peak-flops", 0));
  if (flags.Has("peak-flops") && trainer.peak_flops <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--peak-flops: must be > 0, got ", trainer.peak_flops));
  }
  LATHE_ASSIGN_OR_RETURN(double collective_timeout, flags.GetDouble("collective-timeout", 60));
  if (collective_timeout <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--collective-timeout: must be > 0 seconds, got ", collective_timeout));
  }
  trainer.collective_timeout = absl::Seconds(collective_timeout);
  LATHE_ASSIGN_OR_RETURN(double stop_grace, flags.GetDouble("stop-grace", 5));
  if (!(stop_grace > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--stop-grace: must be > 0 seconds, got ", stop_grace));
  }
  trainer.cancel_grace = absl::Seconds(stop_grace);
  LATHE_ASSIGN_OR_RETURN(options.token, ResolveToken(flags.Get("token"), flags.Get("token-file"),
                                                     "--token-file", "LATHE_TOKEN"));
  if (!options.token.empty()) trainer.environment.push_back({"LATHE_TOKEN", options.token});
  const ClientTlsFiles tls = ClientTlsFilesFrom(flags);  // its trainers get them too
  for (auto [name, file] : {std::pair{kTlsEnvCa, &tls.ca}, std::pair{kTlsEnvCert, &tls.cert},
                            std::pair{kTlsEnvKey, &tls.key}}) {
    if (!file->empty()) trainer.environment.push_back({name, *file});
  }
  trainer.trainer_binary = flags.Get("trainer-binary", default_trainer);
  if (access(trainer.trainer_binary.c_str(), X_OK) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--trainer-binary: ", trainer.trainer_binary, " is not an executable file"));
  }

  absl::StatusOr<uint64_t> memory = HostMemoryBytes();
  if (memory.ok()) {
    options.host_memory_bytes = *memory;
  } else {
    spdlog::warn("worker={} host memory unknown: {}", options.worker_id,
                 memory.status().ToString());
  }
  std::vector<std::string> slot_devices;
  std::vector<GpuInfo> gpus;
  if (options.device == v1::DEVICE_CUDA) {
    const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
    absl::StatusOr<std::vector<GpuInfo>> found = QueryGpus(launcher);
    if (found.ok()) {
      gpus = *std::move(found);
    } else {
      spdlog::warn("worker={} GPU names and memory unknown: {}", options.worker_id,
                   found.status().ToString());
    }
    if (!flags.Has("slots")) {
      options.slots = DefaultCudaSlots(visible != nullptr ? visible : "", gpus);
    }
    LATHE_ASSIGN_OR_RETURN(slot_devices,
                           SlotCudaDevices(visible != nullptr ? visible : "", options.slots));
    for (const std::string& cuda_device : slot_devices) {
      // Each trainer sees only its slot's GPU, numbered as nvidia-smi numbers them.
      options.slot_environment.push_back(
          {{"CUDA_DEVICE_ORDER", "PCI_BUS_ID"}, {"CUDA_VISIBLE_DEVICES", cuda_device}});
    }
  }
  options.devices =
      SlotDevices(options.device, options.slots, slot_devices, gpus, options.host_memory_bytes);
  return options;
}

}  // namespace

std::shared_ptr<grpc::Channel> CoordinatorChannel(
    const std::string& address, std::shared_ptr<grpc::ChannelCredentials> credentials) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 200);
  // (Not GRPC_ARG_MIN_RECONNECT_BACKOFF_MS: gRPC takes it as the connect timeout too, and a
  // busy coordinator that just restarted may need longer than that for the handshake.)
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  return grpc::CreateCustomChannel(address, std::move(credentials), args);
}

std::string AgentFlagsHelp() { return FlagsHelp(kAgentFlags); }

std::string BesideThisExecutable(const std::string& name) {
  std::error_code error;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", error);
  return error ? name : (self.parent_path() / name).string();
}

int RunAgentCommand(int argc, char** argv, const std::string& default_trainer) {
  std::vector<std::string> args(argv, argv + argc);
  for (const std::string& arg : args) {
    if (arg == "--help" || arg == "-h") {
      std::cout << "usage: lathe-worker agent [flags]\n" << AgentFlagsHelp();
      return 0;
    }
  }
  absl::StatusOr<ParsedFlags> flags = ParseFlags(args, kAgentFlags);
  if (flags.ok() && !flags->positional().empty()) {
    flags = absl::InvalidArgumentError(
        absl::StrCat("unexpected argument \"", flags->positional()[0], "\""));
  }
  if (!flags.ok()) {
    std::cerr << "lathe-worker agent: " << flags.status().message() << "\n";
    return 2;
  }

  // SIGINT and SIGTERM are taken by sigwait below; blocked before any thread exists, so that
  // every thread inherits the mask (trainers get a clean mask from the launcher). SIGUSR1
  // tells the main thread that Run returned on its own.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGUSR1);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  // Each rank takes pipes, a process descriptor and log files: the soft limit is often
  // far below the hard one (issue #27). Before any thread starts.
  const absl::StatusOr<FdLimit> fd_limit = RaiseFdLimit();

  PosixProcessLauncher launcher;
  absl::StatusOr<WorkerAgentOptions> options = OptionsFromFlags(*flags, default_trainer, launcher);
  if (!options.ok()) {
    std::cerr << "lathe-worker agent: " << options.status().message() << "\n";
    return 2;
  }
  const std::string coordinator = options->trainer.coordinator_address;
  spdlog::info("worker={} coordinator {}, {} {} slot(s), work dir {}", options->worker_id,
               coordinator, options->slots, options->device == v1::DEVICE_CUDA ? "cuda" : "cpu",
               options->trainer.work_dir);
  if (fd_limit.ok()) {
    spdlog::info("worker={} {}", options->worker_id, DescribeFdLimit(*fd_limit));
  } else {
    spdlog::warn("worker={} {}", options->worker_id, std::string(fd_limit.status().message()));
  }

  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials =
      MakeChannelCredentials(ClientTlsFilesFrom(*flags));
  if (!credentials.ok()) {
    std::cerr << "lathe-worker agent: " << credentials.status().message() << "\n";
    return 2;
  }
  std::unique_ptr<v1::WorkerService::Stub> stub =
      v1::WorkerService::NewStub(CoordinatorChannel(coordinator, *credentials));
  RealClock clock;
  // The agent's metrics and probes: ready while its heartbeat stream is answered.
  std::shared_ptr<AgentMetrics> metrics;
  std::unique_ptr<HttpEndpoints> http;
  WorkerAgent* serving = nullptr;  // set once the agent exists
  if (flags->Has("metrics-listen")) {
    AgentMetrics::DeviceMemoryUsed device_used;
    if (options->device == v1::DEVICE_CUDA) {
      const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");  // checked by OptionsFromFlags
      auto probe = std::make_shared<GpuMemoryProbe>(
          &launcher, *SlotCudaDevices(visible != nullptr ? visible : "", options->slots), &clock,
          absl::Seconds(5));
      device_used = [probe] { return probe->UsedBytes(); };
    }
    metrics = std::make_shared<AgentMetrics>(options->worker_id, options->slots, options->devices,
                                             &clock, std::move(device_used));
    options->on_event = [metrics](const v1::Assignment& assignment, const RankReport& event) {
      metrics->Record(assignment, event);
    };
    absl::StatusOr<std::unique_ptr<HttpEndpoints>> started = HttpEndpoints::Start(
        {flags->Get("metrics-listen"),
         {metrics},
         [&serving] {
           return serving != nullptr && serving->Connected()
                      ? absl::OkStatus()
                      : absl::UnavailableError("not registered with the coordinator");
         }},
        "--metrics-listen");
    if (!started.ok()) {
      std::cerr << "lathe-worker agent: " << started.status().message() << "\n";
      return 2;
    }
    http = *std::move(started);
    const std::string listen = flags->Get("metrics-listen");
    options->address = absl::StrCat(listen.substr(0, listen.rfind(':')), ":", http->port());
    spdlog::info("worker={} metrics on http://{}/metrics", options->worker_id, options->address);
  }
  WorkerAgent agent(*std::move(options), stub.get(), &launcher, &clock);
  serving = &agent;

  absl::Status result;
  std::thread runner([&] {
    result = agent.Run();
    kill(getpid(), SIGUSR1);
  });
  int received = 0;
  while (sigwait(&signals, &received) != 0) {
  }
  if (received != SIGUSR1) {
    spdlog::info("worker: {} received, shutting down", SignalName(received));
    agent.Shutdown();
  }
  runner.join();
  http.reset();  // before the agent it asks
  if (!result.ok()) {
    std::cerr << "lathe-worker agent: " << result.message() << "\n";
    return 1;
  }
  return 0;
}

}  // namespace lathe
