// The `lathe` command line: submit, list, status, watch, cancel and workers against a
// coordinator's JobService and WorkerService.
//
//   lathe [--coordinator ADDR] [--output table|json] COMMAND [ARGS]
//
// ADDR defaults to $LATHE_COORDINATOR, then 127.0.0.1:7070. Global flags may also follow
// the command. Exit status: 0 success; 1 the job failed or was cancelled (watch), the spec
// or request was refused, or the coordinator could not be reached (one line on `err`);
// 2 a usage error (unknown command or flag, missing argument; the usage goes to `err`).
//
// `--output json` prints the job and worker objects of docs/cli-json.md (client/job_json.h),
// a schema that fields are only ever added to.
//
// Thread-safety: RunCli may run on several threads at once (it reads the environment and
// the current directory, and keeps no state of its own).
#ifndef LATHE_CLIENT_CLI_H_
#define LATHE_CLIENT_CLI_H_

#include <ostream>
#include <string>
#include <vector>

namespace lathe {

// Runs one `lathe` invocation. `args` excludes the program name. Results go to `out`,
// errors and notes to `err`. `stdout_is_tty` selects the live progress bar of `watch`.
// Returns the process exit status.
int RunCli(const std::vector<std::string>& args, std::ostream& out, std::ostream& err,
           bool stdout_is_tty);

// The top-level usage message.
std::string CliUsage();

}  // namespace lathe

#endif  // LATHE_CLIENT_CLI_H_
