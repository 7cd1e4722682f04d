// lathe-agent: the worker agent alone, without libtorch (worker/agent/agent_main.h).
// `lathe-worker agent` execs it; its trainers are the `lathe-worker` beside it.
#include "worker/agent/agent_main.h"

int main(int argc, char** argv) {
  return lathe::RunAgentCommand(argc - 1, argv + 1, lathe::BesideThisExecutable("lathe-worker"));
}
