#include "client/cli.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <system_error>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/job_client.h"
#include "client/job_json.h"
#include "client/request_id.h"
#include "client/status_text.h"
#include "client/watch_printer.h"
#include "common/command_line.h"
#include "common/job_spec.h"
#include "common/profile_limits.h"
#include "common/proto/job_spec_proto.h"
#include "common/rpc/auth.h"
#include "common/rpc/tls.h"
#include "common/status_macros.h"
#include "grpcpp/create_channel.h"
#include "nlohmann/json.hpp"
#include "planner/plan_proto.h"
#include "planner/plan_spec.h"

namespace lathe {
namespace {

constexpr int kExitOk = 0;
constexpr int kExitFailed = 1;
constexpr int kExitUsage = 2;

constexpr char kDefaultCoordinator[] = "127.0.0.1:7070";
constexpr char kCoordinatorEnv[] = "LATHE_COORDINATOR";
constexpr char kTokenEnv[] = "LATHE_TOKEN";

const std::vector<FlagSpec>& GlobalFlags() {
  static const auto* flags = new std::vector<FlagSpec>{
      {"coordinator", true,
       "coordinator host:port (default: $LATHE_COORDINATOR, else 127.0.0.1:7070)"},
      {"output", true, "table (default) or json (one schema for scripts: docs/cli-json.md)"},
      {"token", true, "bearer token of a client or admin (default: --token-file, $LATHE_TOKEN)"},
      {"token-file", true, "file holding the bearer token"},
      {"tls-ca", true,
       "PEM roots of the coordinator's certificate: connect with TLS ($LATHE_TLS_CA)"},
      {"tls-cert", true, "PEM client certificate, for mutual TLS ($LATHE_TLS_CERT)"},
      {"tls-key", true, "PEM private key of --tls-cert ($LATHE_TLS_KEY)"},
      {"help", false, "show this help"},
  };
  return *flags;
}

// Everything a command needs, parsed and checked.
struct Invocation {
  std::vector<std::string> positional;
  ParsedFlags flags;
  std::vector<std::string> states;  // list: every --state value, split at commas
  const JobClient* client = nullptr;
  std::ostream* out = nullptr;
  std::ostream* err = nullptr;
  bool json = false;
  bool tty = false;
};

struct Command {
  std::string name;
  std::string arguments;  // after the name in the usage line
  std::string summary;
  std::vector<FlagSpec> flags;
  size_t positional = 0;  // exact number of positional arguments
  int (*run)(const Invocation&);
};

const std::vector<Command>& Commands();

std::string OneLine(absl::string_view text) {
  return absl::StrReplaceAll(text, {{"\r", ""}, {"\n", "; "}});
}

int Fail(const Invocation& inv, const absl::Status& status) {
  *inv.err << "lathe: " << OneLine(status.message()) << "\n";
  return kExitFailed;
}

int FailForJob(const Invocation& inv, const absl::Status& status, absl::string_view job_id) {
  if (status.code() == absl::StatusCode::kNotFound) {
    *inv.err << "lathe: job " << job_id << " not found\n";
    return kExitFailed;
  }
  return Fail(inv, status);
}

// The coordinator runs elsewhere, with another current directory: paths in the spec are
// resolved here (docs/job-spec.md: relative to the process that reads the spec).
absl::Status MakeSpecPathsAbsolute(JobSpec* spec) {
  std::error_code error;
  const std::filesystem::path cwd = std::filesystem::current_path(error);
  if (error) {
    return absl::InternalError(
        absl::StrCat("cannot resolve relative paths: current directory: ", error.message()));
  }
  for (std::string* path : {&spec->model.path, &spec->data.train, &spec->data.eval,
                            &spec->lora.init_from, &spec->output}) {
    if (path->empty() || std::filesystem::path(*path).is_absolute()) continue;
    *path = (cwd / *path).lexically_normal().string();
  }
  return absl::OkStatus();
}

int RunSubmit(const Invocation& inv) {
  const std::string& file = inv.positional[0];
  absl::StatusOr<JobSpec> spec = LoadJobSpec(file);
  if (!spec.ok()) return Fail(inv, spec.status());
  if (absl::Status status = MakeSpecPathsAbsolute(&*spec); !status.ok()) return Fail(inv, status);

  std::string request_id = inv.flags.Get("request-id");
  if (request_id.empty()) {
    absl::StatusOr<std::string> generated = NewRequestId();
    if (!generated.ok()) return Fail(inv, generated.status());
    request_id = *std::move(generated);
  }
  absl::StatusOr<v1::SubmitJobResponse> response =
      inv.client->SubmitJob(JobSpecToProto(*spec), request_id);
  if (!response.ok()) {
    switch (response.status().code()) {
      case absl::StatusCode::kInvalidArgument:
      case absl::StatusCode::kFailedPrecondition:
      case absl::StatusCode::kResourceExhausted:
      case absl::StatusCode::kUnimplemented:
        return Fail(inv, Annotate(response.status(), "the coordinator refused the job"));
      default:
        return Fail(inv, response.status());
    }
  }
  if (inv.json) {
    // The same job object as `status`, its id from the response (where the API defines it).
    v1::JobStatus job = response->status();
    if (!response->job_id().empty()) job.set_job_id(response->job_id());
    *inv.out << JsonLine(JobJson(job)) << "\n";
  } else {
    *inv.out << response->job_id() << "\n";
  }
  if (response->existing()) {
    *inv.err << "note: request id " << request_id << " matched job " << response->job_id()
             << ", submitted earlier; nothing new was submitted\n";
  }
  return kExitOk;
}

// `plan`: the coordinator's plan, or with --local this process's (reading the model's
// config.json here, fitting to --memory-per-rank, the spec's resources.memory_per_rank, or
// this machine's memory over the ranks).
int RunPlan(const Invocation& inv) {
  if (inv.flags.Has("history")) {
    absl::StatusOr<int64_t> limit = inv.flags.GetInt("limit", 20);
    if (!limit.ok()) return Fail(inv, limit.status());
    if (*limit < 1 || *limit > 1000) {
      return Fail(inv, absl::InvalidArgumentError(
                           absl::StrCat("--limit: must be 1 to 1000, got ", *limit)));
    }
    absl::StatusOr<v1::GetPlanHistoryResponse> history =
        inv.client->GetPlanHistory(static_cast<int32_t>(*limit));
    if (!history.ok()) return Fail(inv, history.status());
    *inv.out << (inv.json ? JsonLine(PlanHistoryJson(*history)) + "\n" : PlanHistoryText(*history));
    return kExitOk;
  }
  absl::StatusOr<JobSpec> spec = LoadJobSpec(inv.positional[0]);
  if (!spec.ok()) return Fail(inv, spec.status());
  if (absl::Status status = MakeSpecPathsAbsolute(&*spec); !status.ok()) return Fail(inv, status);
  absl::StatusOr<v1::PlanJobResponse> response;
  if (inv.flags.Has("local")) {
    const std::string pool =
        spec->resources.device == DeviceKind::kCuda ? inv.flags.Get("gpu", "h100") : "cpu";
    absl::StatusOr<DeviceRates> rates = DefaultRates(pool);
    if (!rates.ok()) return Fail(inv, Annotate(rates.status(), "--gpu"));
    if (inv.flags.Has("memory-per-rank")) {
      absl::StatusOr<uint64_t> bytes = ParseByteSize(inv.flags.Get("memory-per-rank"));
      if (!bytes.ok()) return Fail(inv, Annotate(bytes.status(), "--memory-per-rank"));
      rates->memory_bytes = *bytes;
    }
    absl::StatusOr<PlanOptions> options = PlanOptionsFor(*spec, pool, *rates);
    if (!options.ok()) return Fail(inv, options.status());
    absl::StatusOr<PlanResult> result = PlanSpec(*spec, *options);
    if (!result.ok()) return Fail(inv, result.status());
    response = PlanResultToProto(*result, options->rates.memory_bytes);
  } else {
    response = inv.client->PlanJob(JobSpecToProto(*spec));
  }
  if (!response.ok()) return Fail(inv, response.status());
  *inv.out << (inv.json ? JsonLine(PlanResponseJson(*response)) + "\n"
                        : PlanReportText(*response, 12));
  return kExitOk;
}

// `lathe list` shows the newest 50 jobs in a table unless asked for more: a coordinator may
// hold thousands. JSON is for scripts, which must not miss a job silently: all of them,
// unless --limit.
constexpr int64_t kDefaultListLimit = 50;

int RunList(const Invocation& inv) {
  JobFilter filter;
  for (const std::string& text : inv.states) {
    absl::StatusOr<v1::JobState> state = ParseJobState(text);
    if (!state.ok()) return Fail(inv, state.status());
    filter.states.push_back(*state);
  }
  filter.name = inv.flags.Get("name", "");
  if (inv.flags.Has("since")) {
    absl::Duration since;
    const std::string text = inv.flags.Get("since", "");
    if (!absl::ParseDuration(text, &since) || since <= absl::ZeroDuration()) {
      return Fail(inv, absl::InvalidArgumentError(absl::StrCat(
                           "--since: expected a duration such as 30m or 2h, got \"", text, "\"")));
    }
    filter.since_unix_ms = absl::ToUnixMillis(absl::Now() - since);
  }
  absl::StatusOr<int64_t> limit = inv.flags.GetInt("limit", kDefaultListLimit);
  if (!limit.ok()) return Fail(inv, limit.status());
  if (*limit < 1) {
    return Fail(
        inv, absl::InvalidArgumentError(absl::StrCat("--limit: must be at least 1, got ", *limit)));
  }
  const bool all = inv.flags.Has("all") || (inv.json && !inv.flags.Has("limit"));
  bool more = false;
  absl::StatusOr<std::vector<v1::JobStatus>> jobs =
      inv.client->ListNewestJobs(filter, all ? 0 : static_cast<size_t>(*limit), &more);
  if (!jobs.ok()) return Fail(inv, jobs.status());
  if (inv.json) {
    nlohmann::ordered_json array = nlohmann::ordered_json::array();
    for (const v1::JobStatus& job : *jobs) array.push_back(JobJson(job));
    *inv.out << JsonLine(array) << "\n";
  } else {
    *inv.out << JobTable(*jobs, absl::Now());
    if (more) {
      *inv.out << "(the newest " << jobs->size() << "; --limit N or --all for older ones)\n";
    }
  }
  return kExitOk;
}

int RunStatus(const Invocation& inv) {
  const std::string& id = inv.positional[0];
  absl::StatusOr<v1::JobStatus> job = inv.client->GetJob(id);
  if (!job.ok()) return FailForJob(inv, job.status(), id);
  *inv.out << (inv.json ? JsonLine(JobJson(*job)) + "\n" : JobDetails(*job, absl::Now()));
  return kExitOk;
}

int RunWatch(const Invocation& inv) {
  const std::string& id = inv.positional[0];
  WatchPrinter printer(*inv.out, inv.json  ? WatchFormat::kJson
                                 : inv.tty ? WatchFormat::kProgressBar
                                           : WatchFormat::kLines);
  std::optional<v1::JobStatus> last;
  absl::Status status = inv.client->WatchJob(id, [&](const v1::JobStatus& update) {
    printer.Update(update, absl::Now());
    last = update;
    return !IsFinalState(update.state());
  });
  printer.Finish();
  if (!status.ok()) return FailForJob(inv, status, id);
  if (!last.has_value() || !IsFinalState(last->state())) {
    // The stream ended early (a coordinator restarting, say): ask once for the outcome.
    absl::StatusOr<v1::JobStatus> job = inv.client->GetJob(id);
    if (!job.ok()) return FailForJob(inv, job.status(), id);
    if (!IsFinalState(job->state())) {
      *inv.err << "lathe: the coordinator ended the watch of job " << id << " while it is "
               << JobStateName(job->state()) << "\n";
      return kExitFailed;
    }
    printer.Update(*job, absl::Now());
    printer.Finish();
    last = *std::move(job);
  }
  if (last->state() == v1::JOB_STATE_SUCCEEDED) return kExitOk;
  // Text output already shows the reason on the final state line.
  if (inv.json) {
    *inv.err << "lathe: job " << id << " " << JobStateName(last->state())
             << (last->reason().empty() ? "" : ": ") << OneLine(last->reason()) << "\n";
  }
  return kExitFailed;
}

int RunLogs(const Invocation& inv) {
  const std::string& id = inv.positional[0];
  absl::StatusOr<int64_t> rank = inv.flags.GetInt("rank", 0);
  if (!rank.ok()) return Fail(inv, rank.status());
  absl::StatusOr<int64_t> attempt = inv.flags.GetInt("attempt", 0);
  if (!attempt.ok()) return Fail(inv, attempt.status());
  if (*rank < 0 || *attempt < 0) {
    return Fail(inv, absl::InvalidArgumentError("--rank and --attempt: must be >= 0"));
  }
  const bool follow = inv.flags.Has("follow");
  int64_t offset = 0;
  int64_t generation = *attempt;  // fixed after the first answer, so --follow stays on it
  bool ended_seen = false;
  while (true) {
    absl::StatusOr<v1::GetLogsResponse> chunk = inv.client->GetLogs(id, generation, *rank, offset);
    if (!chunk.ok()) return FailForJob(inv, chunk.status(), id);
    generation = chunk->attempt();
    *inv.out << chunk->data();
    inv.out->flush();
    offset = chunk->next_offset();
    if (offset < chunk->size()) continue;  // more is there already
    if (!follow) break;
    // Its worker sends a rank's log about every second, so the last lines may come after
    // the attempt has ended: one more look two seconds later.
    if (!chunk->attempt_active()) {
      if (ended_seen) break;
      ended_seen = true;
      absl::SleepFor(absl::Seconds(2));
      continue;
    }
    absl::SleepFor(absl::Seconds(1));
  }
  return kExitOk;
}

int RunCancel(const Invocation& inv) {
  const std::string& id = inv.positional[0];
  absl::StatusOr<v1::JobStatus> job = inv.client->CancelJob(id, inv.flags.Get("reason"));
  if (!job.ok()) return FailForJob(inv, job.status(), id);
  if (inv.json) {
    *inv.out << JsonLine(JobJson(*job)) << "\n";
  } else if (job->state() == v1::JOB_STATE_CANCELLED) {
    *inv.out << "job " << id << " cancelled\n";
  } else if (IsFinalState(job->state())) {
    *inv.out << "job " << id << " had already finished: " << JobStateName(job->state()) << "\n";
  } else {
    *inv.out << "job " << id << ": cancel requested (now " << JobStateName(job->state()) << ")\n";
  }
  return kExitOk;
}

// A flag that does not fit the others: one line, exit status 2.
int BadArguments(const Invocation& inv, absl::string_view message) {
  *inv.err << "lathe: " << message << "\n";
  return kExitUsage;
}

// `lathe profile --fetch ID DIR [--capture C]`: the capture's files into DIR/<capture>/rank-<r>/.
int FetchProfile(const Invocation& inv) {
  const std::string& id = inv.positional[0];
  const std::string& dir = inv.positional[1];
  absl::StatusOr<v1::JobStatus> job = inv.client->GetJob(id);
  if (!job.ok()) return FailForJob(inv, job.status(), id);
  const std::string wanted = inv.flags.Get("capture");
  const v1::ProfileCapture* capture = nullptr;
  for (const v1::Attempt& attempt : job->attempts()) {
    for (const v1::ProfileCapture& c : attempt.profiles()) {
      if (wanted.empty() || c.capture_id() == wanted) capture = &c;  // the newest by default
    }
  }
  if (capture == nullptr) {
    return Fail(inv, absl::NotFoundError(
                         wanted.empty() ? absl::StrCat("job ", id, " has no profile captures")
                                        : absl::StrCat("job ", id, " has no capture ", wanted)));
  }
  const std::string& capture_id = capture->capture_id();
  if (capture->state() == v1::PROFILE_STATE_PENDING) {
    return Fail(inv, absl::FailedPreconditionError(absl::StrCat(
                         "capture ", capture_id, " of job ", id,
                         " is still pending; fetch it once it is done (lathe status ", id, ")")));
  }
  if (capture->files().empty()) {
    return Fail(inv, absl::NotFoundError(
                         absl::StrCat("capture ", capture_id, " of job ", id, " has no files",
                                      capture->error().empty() ? "" : ": ", capture->error())));
  }
  // Every target is checked before anything is written: nothing is overwritten, and a name
  // from the coordinator never leaves DIR.
  const std::filesystem::path root = std::filesystem::path(dir) / capture_id;
  std::vector<std::pair<const v1::ProfileFile*, std::filesystem::path>> targets;
  for (const v1::ProfileFile& file : capture->files()) {
    const std::filesystem::path name(file.name());
    if (file.name().empty() || name.has_parent_path() || file.name() == "." ||
        file.name() == "..") {
      return Fail(inv, absl::InvalidArgumentError(absl::StrCat(
                           "capture ", capture_id, ": \"", file.name(), "\" is not a file name")));
    }
    std::filesystem::path target = root / absl::StrCat("rank-", file.rank()) / name;
    std::error_code error;
    if (std::filesystem::exists(std::filesystem::symlink_status(target, error))) {
      return Fail(
          inv, absl::AlreadyExistsError(absl::StrCat(target.string(), " exists; not overwritten")));
    }
    targets.emplace_back(&file, std::move(target));
  }
  uint64_t total = 0;
  for (const auto& [file, target] : targets) {
    std::error_code error;
    std::filesystem::create_directories(target.parent_path(), error);
    if (error) {
      return Fail(inv, absl::InternalError(absl::StrCat("creating ", target.parent_path().string(),
                                                        ": ", error.message())));
    }
    const std::string part = target.string() + ".part";
    std::ofstream out(part, std::ios::binary | std::ios::trunc);
    int64_t offset = 0;
    while (true) {
      absl::StatusOr<v1::GetProfileFileResponse> chunk =
          inv.client->GetProfileFile(id, capture_id, file->rank(), file->name(), offset);
      if (!chunk.ok()) return FailForJob(inv, chunk.status(), id);
      out.write(chunk->data().data(), static_cast<std::streamsize>(chunk->data().size()));
      offset += static_cast<int64_t>(chunk->data().size());
      if (chunk->data().empty() || offset >= chunk->size()) break;
    }
    out.close();
    if (!out || std::filesystem::exists(target)) {
      std::filesystem::remove(part, error);
      return Fail(inv, absl::InternalError(absl::StrCat("writing ", target.string())));
    }
    std::filesystem::rename(part, target, error);
    if (error) {
      return Fail(inv, absl::InternalError(
                           absl::StrCat("writing ", target.string(), ": ", error.message())));
    }
    total += static_cast<uint64_t>(offset);
    if (!inv.json)
      *inv.out << target.string() << "  " << FormatBytes(static_cast<uint64_t>(offset)) << "\n";
  }
  if (inv.json) {
    nlohmann::ordered_json json = ProfileJson(*capture);
    json["directory"] = root.string();
    *inv.out << JsonLine(json) << "\n";
  } else {
    *inv.out << "capture " << capture_id << ": " << targets.size() << " file(s), "
             << FormatBytes(total) << " in " << root.string() << "\n";
  }
  return kExitOk;
}

int RunProfile(const Invocation& inv) {
  const bool fetch = inv.flags.Has("fetch");
  const bool all_ranks = inv.flags.Has("all-ranks");
  if (fetch) {
    for (const char* flag : {"steps", "rank", "all-ranks", "memory"}) {
      if (inv.flags.Has(flag))
        return BadArguments(inv, absl::StrCat("--", flag, ": not with --fetch"));
    }
    return FetchProfile(inv);
  }
  if (inv.flags.Has("capture")) return BadArguments(inv, "--capture: only with --fetch");
  if (all_ranks && inv.flags.Has("rank")) {
    return BadArguments(inv, "--rank and --all-ranks: choose one");
  }
  absl::StatusOr<int64_t> steps = inv.flags.GetInt("steps", 3);
  if (!steps.ok()) return BadArguments(inv, steps.status().message());
  if (*steps < 1 || *steps > kMaxProfileSteps) {
    return BadArguments(
        inv, absl::StrCat("--steps: must be in 1..", kMaxProfileSteps, ", got ", *steps));
  }
  absl::StatusOr<int64_t> rank = inv.flags.GetInt("rank", 0);
  if (!rank.ok()) return BadArguments(inv, rank.status().message());
  if (*rank < 0) return BadArguments(inv, absl::StrCat("--rank: must be >= 0, got ", *rank));
  const std::string& id = inv.positional[0];
  v1::ProfileJobRequest request;
  request.set_job_id(id);
  request.set_steps(*steps);
  request.set_rank(*rank);
  request.set_all_ranks(all_ranks);
  request.set_memory(inv.flags.Has("memory"));
  absl::StatusOr<v1::ProfileJobResponse> asked = inv.client->ProfileJob(request);
  if (!asked.ok()) return FailForJob(inv, asked.status(), id);
  const v1::ProfileCapture& capture = asked->capture();
  if (inv.json) {
    *inv.out << JsonLine(ProfileJson(capture)) << "\n";
  } else {
    *inv.out << "capture " << capture.capture_id() << " of job " << id << " (attempt "
             << asked->generation() << "): the next " << capture.steps()
             << (capture.steps() == 1 ? " step" : " steps") << " of rank"
             << (capture.ranks_size() == 1 ? " " : "s ") << absl::StrJoin(capture.ranks(), ",")
             << (capture.memory() ? ", with memory" : "") << "\n"
             << "follow it with `lathe status " << id << "`; once DONE: `lathe profile --fetch "
             << id << " DIR`\n";
  }
  return kExitOk;
}

int RunWorkers(const Invocation& inv) {
  if (!inv.positional.empty()) {  // drain ID | remove ID (admin)
    const std::string& action = inv.positional[0];
    const std::string& id = inv.positional[1];
    if (action == "drain") {
      absl::StatusOr<v1::WorkerStatus> worker = inv.client->DrainWorker(id);
      if (!worker.ok()) return Fail(inv, worker.status());
      *inv.out << (inv.json ? JsonLine(WorkerJson(*worker)) + "\n"
                            : absl::StrCat("worker ", id,
                                           " is draining: no new ranks, its running ranks "
                                           "checkpoint and move elsewhere\n"));
      return kExitOk;
    }
    if (action == "remove") {
      if (absl::Status status = inv.client->RemoveWorker(id); !status.ok()) {
        return Fail(inv, status);
      }
      if (!inv.json) *inv.out << "worker " << id << " removed\n";
      return kExitOk;
    }
    return Fail(inv, absl::InvalidArgumentError(absl::StrCat(
                         "workers: expected drain ID or remove ID, got \"", action, "\"")));
  }
  absl::StatusOr<std::vector<v1::WorkerStatus>> workers = inv.client->ListWorkers();
  if (!workers.ok()) return Fail(inv, workers.status());
  if (inv.json) {
    nlohmann::ordered_json array = nlohmann::ordered_json::array();
    for (const v1::WorkerStatus& worker : *workers) array.push_back(WorkerJson(worker));
    *inv.out << JsonLine(array) << "\n";
  } else {
    *inv.out << WorkerTable(*workers, absl::Now());
  }
  return kExitOk;
}

const std::vector<Command>& Commands() {
  static const auto* commands = new std::vector<Command>{
      {"submit",
       "FILE [--request-id ID]",
       "Submit a job spec (YAML or JSON); prints the job id. Relative paths in the spec are "
       "made absolute against the current directory.",
       {{"request-id", true, "reuse this id to retry a submission (default: a new UUID)"}},
       1,
       RunSubmit},
      {"plan",
       "FILE [--local [--memory-per-rank SIZE] [--gpu h100|h200]] | --history [--limit N]",
       "Plan a job spec without submitting it: the strategy the planner picks, its memory per "
       "rank by component, predicted speed, and every configuration considered with why it "
       "lost. Exit status 1 with what would fit when nothing does. With --history: the "
       "coordinator's predicted and measured peaks of the latest attempts, and the "
       "corrections it learned from them.",
       {{"local", false,
         "plan here, without a coordinator (reads the model's config.json from this machine)"},
        {"memory-per-rank", true,
         "with --local: the memory of one rank (e.g. 24GiB; default: the spec's "
         "resources.memory_per_rank, else the GPU's)"},
        {"gpu", true, "with --local and device cuda: h100 (default) or h200"},
        {"history", false, "predicted against measured peaks of the latest attempts, no FILE"},
        {"limit", true, "with --history: how many attempts (default 20)"}},
       1,
       RunPlan},
      {"list",
       "[--state STATE]... [--name NAME] [--since DURATION] [--limit N | --all]",
       "List jobs, newest first: the newest 50 in a table (every job in JSON) unless --limit or "
       "--all.",
       {{"state", true,
         "queued, running, succeeded, failed or cancelled; repeat or separate with commas"},
        {"name", true, "only jobs whose spec has this name"},
        {"since", true, "only jobs submitted within this long, e.g. 30m or 2h"},
        {"limit", true, "how many of the newest jobs (default 50 in a table, all in JSON)"},
        {"all", false, "every job that matches"}},
       0,
       RunList},
      {"status",
       "ID",
       "Show a job: state, plan, attempts, progress, memory, result.",
       {},
       1,
       RunStatus},
      {"watch",
       "ID",
       "Follow a job until it ends. Exit status 0 when it succeeded, 1 when it failed or was "
       "cancelled.",
       {},
       1,
       RunWatch},
      {"logs",
       "ID [--rank R] [--attempt A] [--follow]",
       "Print a rank's log (its trainer's output), as its worker sent it to the coordinator.",
       {{"rank", true, "which rank (default 0)"},
        {"attempt", true, "which attempt (default: the latest)"},
        {"follow", false, "keep printing as the rank runs, until its attempt ends"}},
       1,
       RunLogs},
      {"cancel",
       "ID [--reason TEXT]",
       "Cancel a job.",
       {{"reason", true, "recorded as the job's reason"}},
       1,
       RunCancel},
      {"profile",
       "ID [--steps N] [--rank R | --all-ranks] [--memory] | --fetch ID DIR [--capture C]",
       "Profile the next steps of a running job, without a restart: its trainers record where "
       "the time (and with --memory, the memory) goes, and the coordinator keeps the files "
       "with the attempt (`lathe status` lists them). With --fetch: download a capture's files "
       "into DIR/<capture>/rank-<r>/, never overwriting a file. Bounds and states: "
       "docs/observability.md, \"Profiling\".",
       {{"steps", true, "how many optimizer steps, from the next one (1..20, default 3)"},
        {"rank", true, "which rank (default 0)"},
        {"all-ranks", false, "every rank of the attempt"},
        {"memory", false, "also the memory timeline and its peak summary"},
        {"fetch", false, "download a capture: ID DIR"},
        {"capture", true, "with --fetch: which capture (default: the newest)"}},
       1,
       RunProfile},
      {"workers",
       "[drain ID | remove ID]",
       "List the registered workers; with an admin token, drain one (no new ranks; its "
       "running ranks checkpoint and move elsewhere) or remove a lost one.",
       {},
       0,
       RunWorkers},
  };
  return *commands;
}

std::string CommandUsage(const Command& command) {
  return absl::StrCat("usage: lathe ", command.name, command.arguments.empty() ? "" : " ",
                      command.arguments, "\n\n", command.summary, "\n",
                      command.flags.empty() ? "" : absl::StrCat("\n", FlagsHelp(command.flags)),
                      "\nglobal flags:\n", FlagsHelp(GlobalFlags()));
}

int UsageError(std::ostream& err, absl::string_view message, absl::string_view usage) {
  err << "lathe: " << message << "\n\n" << usage;
  return kExitUsage;
}

// A flag's value that cannot be used (a file that is missing, say): the message alone.
int ArgumentError(std::ostream& err, absl::string_view message) {
  err << "lathe: " << message << "\n";
  return kExitUsage;
}

// The global flag `arg` names ("--output" or "--output=json"), or null.
const FlagSpec* GlobalFlagOf(absl::string_view arg) {
  if (!absl::StartsWith(arg, "--")) return nullptr;
  absl::string_view name = arg.substr(2);
  name = name.substr(0, name.find('='));
  for (const FlagSpec& flag : GlobalFlags()) {
    if (flag.name == name) return &flag;
  }
  return nullptr;
}

}  // namespace

std::string CliUsage() {
  std::string usage =
      "usage: lathe [--coordinator ADDR] [--output table|json] COMMAND [ARGS]\n\ncommands:\n";
  for (const Command& command : Commands()) {
    std::string left = absl::StrCat("  ", command.name, " ", command.arguments);
    if (left.size() < 31) left.resize(31, ' ');
    // The first sentence of the summary.
    absl::string_view summary = command.summary;
    summary = summary.substr(0, summary.find(". "));
    absl::StrAppend(&usage, left, " ", absl::StripSuffix(summary, "."), "\n");
  }
  absl::StrAppend(&usage, "\nglobal flags (before or after the command):\n",
                  FlagsHelp(GlobalFlags()),
                  "\nexit status: 0 success; 1 the job failed or was refused, or the coordinator "
                  "is unreachable; 2 usage error\n'lathe COMMAND --help' describes a command.\n");
  return usage;
}

int RunCli(const std::vector<std::string>& args, std::ostream& out, std::ostream& err,
           bool stdout_is_tty) {
  // Global flags before the command; the command is the first other argument.
  std::vector<std::string> flag_args;
  size_t i = 0;
  for (; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg == "--help" || arg == "-h" || arg == "help") {
      out << CliUsage();
      return kExitOk;
    }
    if (!absl::StartsWith(arg, "-")) break;
    const FlagSpec* flag = GlobalFlagOf(arg);
    if (flag == nullptr) return UsageError(err, absl::StrCat("unknown flag ", arg), CliUsage());
    flag_args.push_back(arg);
    if (flag->takes_value && !absl::StrContains(arg, '=')) {
      if (i + 1 == args.size())
        return UsageError(err, absl::StrCat(arg, " needs a value"), CliUsage());
      flag_args.push_back(args[++i]);
    }
  }
  if (i == args.size()) return UsageError(err, "missing command", CliUsage());
  const Command* command = nullptr;
  for (const Command& c : Commands()) {
    if (c.name == args[i]) command = &c;
  }
  if (command == nullptr) {
    return UsageError(err, absl::StrCat("unknown command \"", args[i], "\""), CliUsage());
  }
  const std::string usage = CommandUsage(*command);

  // `list --state` may repeat, which ParseFlags (last value wins) does not keep: collect it
  // here.
  Invocation inv;
  for (++i; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (command->name == "list" && (arg == "--state" || absl::StartsWith(arg, "--state="))) {
      std::string value;
      if (arg != "--state") {
        value = arg.substr(sizeof("--state=") - 1);
      } else if (i + 1 < args.size()) {
        value = args[++i];
      } else {
        return UsageError(err, "--state needs a value", usage);
      }
      for (absl::string_view state : absl::StrSplit(value, ',', absl::SkipWhitespace())) {
        inv.states.emplace_back(state);
      }
      continue;
    }
    flag_args.push_back(arg);
  }
  std::vector<FlagSpec> specs = command->flags;
  specs.insert(specs.end(), GlobalFlags().begin(), GlobalFlags().end());
  absl::StatusOr<ParsedFlags> flags = ParseFlags(flag_args, specs);
  if (!flags.ok()) return UsageError(err, flags.status().message(), usage);
  if (flags->Has("help")) {
    out << usage;
    return kExitOk;
  }
  const std::string output = flags->Get("output", "table");
  if (output != "table" && output != "json") {
    return UsageError(err, absl::StrCat("--output: expected table or json, got \"", output, "\""),
                      usage);
  }
  // `plan --history` takes no FILE; `workers` takes nothing or an action and an id;
  // `profile --fetch` an id and a directory.
  size_t positional = command->name == "plan" && flags->Has("history") ? 0 : command->positional;
  if (command->name == "workers" && !flags->positional().empty()) positional = 2;
  if (command->name == "profile" && flags->Has("fetch")) positional = 2;
  if (flags->positional().size() != positional) {
    std::string message =
        flags->positional().size() < positional
            ? absl::StrCat("missing argument: ", command->name, " ", command->arguments)
            : absl::StrCat("unexpected argument \"", flags->positional()[positional], "\"");
    return UsageError(err, message, usage);
  }

  std::string address = flags->Get("coordinator");
  if (address.empty()) {
    const char* env = std::getenv(kCoordinatorEnv);
    address = env != nullptr && *env != '\0' ? env : kDefaultCoordinator;
  }
  absl::StatusOr<std::string> token =
      ResolveToken(flags->Get("token"), flags->Get("token-file"), "--token-file", kTokenEnv);
  // The flags were right; what they name is not: one line, no usage (issue #32).
  if (!token.ok()) return ArgumentError(err, token.status().message());
  JobClientOptions client_options;
  client_options.token = *std::move(token);
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials =
      MakeChannelCredentials(ClientTlsFilesFrom(*flags));
  if (!credentials.ok()) return ArgumentError(err, credentials.status().message());
  const JobClient client(grpc::CreateChannel(address, *credentials), address, client_options);
  inv.positional = flags->positional();
  inv.flags = *std::move(flags);
  inv.client = &client;
  inv.out = &out;
  inv.err = &err;
  inv.json = output == "json";
  inv.tty = stdout_is_tty;
  const int code = command->run(inv);
  out.flush();
  return code;
}

}  // namespace lathe
