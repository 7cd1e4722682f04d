// `lathe-agent` (and `lathe-worker agent`, which runs it): the worker agent's command line
// (flags, environment, signals) around WorkerAgent. Runs until SIGINT or SIGTERM, then
// cancels its trainers and exits 0.
//
// The agent runs in a process of its own without libtorch: `lathe-worker agent` execs the
// `lathe-agent` beside it. Besides being smaller, that is what lets it serve /metrics: the
// HTTP server (civetweb) starts its threads with a fixed 100 KiB stack, which the static TLS
// of libtorch and OpenBLAS (over 100 KiB) does not leave room for.
//
// Thread-safety: RunAgentCommand is meant to be called once, from main.
#ifndef LATHE_WORKER_AGENT_AGENT_MAIN_H_
#define LATHE_WORKER_AGENT_AGENT_MAIN_H_

#include <memory>
#include <string>

#include "grpcpp/channel.h"
#include "grpcpp/security/credentials.h"

namespace lathe {

// `args` are the flags (after "agent" for lathe-worker). `default_trainer`: the binary that
// runs `train` when --trainer-binary is not given. Returns the process exit code: 0 after a
// clean shutdown, 1 when the agent fails, 2 for a usage error.
int RunAgentCommand(int argc, char** argv, const std::string& default_trainer);

// `name` in the directory of the running executable.
std::string BesideThisExecutable(const std::string& name);

// A channel to the coordinator at `address` (insecure by default; TLS with credentials from
// common/rpc/tls.h), set up for a long-lived agent: it tries to reconnect at least every
// second (gRPC's default backs off to 2 minutes), so a restarted coordinator is found again
// quickly.
std::shared_ptr<grpc::Channel> CoordinatorChannel(
    const std::string& address,
    std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials());

// The "  --flag VALUE   help" lines of the agent's flags, for lathe-worker's usage text.
std::string AgentFlagsHelp();

}  // namespace lathe

#endif  // LATHE_WORKER_AGENT_AGENT_MAIN_H_
