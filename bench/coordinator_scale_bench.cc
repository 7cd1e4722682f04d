// Issue #13, "Coordinator at scale": drives a real lathe-coordinator with thousands of
// simulated workers and jobs over real gRPC, and measures what the coordinator costs and how
// fast it answers. The simulated workers are not processes: each is a state machine on a
// completion queue (a few polling threads in all), with its own channel and TCP connection,
// that registers, keeps a Heartbeat stream, takes assignments and reports them started;
// its ranks never finish. Scenarios:
//
//   heartbeat  N workers register (spread over 2 s) and heartbeat for --duration seconds:
//              heartbeat round trips, the coordinator's threads, CPU, memory, disk writes,
//              and the workers it considers lost at the end.
//   submit     M jobs submitted one after another from one client, no workers: jobs/s per
//              window of --window jobs (first against last), ListJobs and `lathe list` times.
//   burst      M jobs, then N workers registering all at once: how long each slot waits for
//              its first assignment, heartbeats and registrations during the rush, workers
//              lost and jobs failed at the end.
//
//   build/bin/coordinator_scale_bench --scenario heartbeat --workers 5000 --duration 30
//   build/bin/coordinator_scale_bench --scenario submit --jobs 10000 --json submit.json
//   build/bin/coordinator_scale_bench --scenario burst --jobs 10000 --workers 1000
//
// Prints one "name: value" line per figure (and --json writes them as one object), progress
// lines on stderr. bench/coordinator_scale.py runs the standard set and prints the table.
//
// Windows: the coordinator's CPU, disk writes and the heartbeat round trips are over the
// measured window (heartbeat: from one interval after the last registration to --duration
// after it; submit: the submits; burst: the --duration from the registrations). Placement
// counts only first assignments within the burst's window; ListWorkers and ListJobs at the
// end get kQueryDeadline each, and a coordinator that does not answer in time is reported
// as such ("n/a (code 4: Deadline Exceeded)") rather than waited for.
#include <fcntl.h>
#include <grpcpp/alarm.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <regex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/random/random.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/command_line.h"
#include "common/status_macros.h"
#include "lathe/v1/coordinator.grpc.pb.h"
#include "lathe/v1/coordinator.pb.h"
#include "lathe/v1/job.pb.h"
#include "nlohmann/json.hpp"

namespace lathe {
namespace {

const std::vector<FlagSpec> kFlags = {
    {"scenario", true, "heartbeat | submit | burst"},
    {"bin-dir", true, "where lathe-coordinator, lathe and lathe-synth are (default build/bin)"},
    {"db", true, "sqlite (a file in the scratch directory) | memory (default sqlite)"},
    {"workers", true, "simulated workers (default 1000)"},
    {"jobs", true, "jobs to submit (default 1000)"},
    {"slots", true, "slots per worker (default 1)"},
    {"heartbeat-interval", true, "seconds, the coordinator's --heartbeat-interval (default 2)"},
    {"heartbeat-timeout", true, "seconds, the coordinator's --heartbeat-timeout (default 15)"},
    {"duration", true, "seconds of heartbeats (heartbeat and burst; default 30)"},
    {"window", true, "jobs per submit-throughput window (default 1000)"},
    {"submit-time-limit", true,
     "seconds after which submitting stops and the report says how far it got (default: none)"},
    {"threads", true, "client polling threads for the simulated workers (default 2)"},
    {"watchers", true,
     "heartbeat scenario: WatchJob streams on one running job, held through it (default 0; "
     "at most 1024, the coordinator's limit per host)"},
    {"legacy-replies", false,
     "the coordinator predates in_reply_to (before issue #13): every answer is the oldest "
     "heartbeat's, and none is pushed"},
    {"work-dir", true, "where the scratch directory is made (default $TMPDIR, else /tmp)"},
    {"keep", false, "keep the scratch directory (database, coordinator.log) and print its path"},
    {"json", true, "also write the report as one JSON object to this file"},
    {"help", false, "this message"},
};

constexpr uint64_t kHostMemoryBytes = uint64_t{64} << 30;
constexpr int kMaxMessageBytes = 64 << 20;
// Each query at the end (ListWorkers, a ListJobs page) gets this long: a coordinator that
// takes longer is itself the finding, and the run must end within its driver's limit.
constexpr absl::Duration kQueryDeadline = absl::Seconds(30);

// A line on stderr with the seconds since the start, so that a run its driver had to kill
// still shows how far it got.
void Progress(const std::string& message) {
  static const absl::Time start = absl::Now();
  std::cerr << absl::StrFormat("[%7.1f s] %s\n", absl::ToDoubleSeconds(absl::Now() - start),
                               message);
}

// ---------------------------------------------------------------------------------------
// The report: figures in the order they were added.

class Report {
 public:
  void Text(const std::string& name, const std::string& value) { Add(name, value, value); }
  void Int(const std::string& name, int64_t value) { Add(name, absl::StrCat(value), value); }
  void Real(const std::string& name, double value, int decimals = 2) {
    Add(name, absl::StrFormat("%.*f", decimals, value), value);
  }
  // A figure that could not be measured (the coordinator died, no stats lines were logged).
  void Missing(const std::string& name, const std::string& why) {
    Add(name, absl::StrCat("n/a (", why, ")"), nullptr);
  }

  void Print() const {
    for (const Entry& entry : entries_) std::cout << entry.name << ": " << entry.text << "\n";
    std::cout.flush();
  }

  absl::Status WriteJson(const std::string& path) const {
    nlohmann::ordered_json json;
    for (const Entry& entry : entries_) json[entry.name] = entry.value;
    std::ofstream out(path);
    out << json.dump(2) << "\n";
    out.close();
    if (!out) return absl::UnavailableError(absl::StrCat("cannot write ", path));
    return absl::OkStatus();
  }

 private:
  struct Entry {
    std::string name;
    std::string text;
    nlohmann::ordered_json value;
  };
  void Add(const std::string& name, std::string text, nlohmann::ordered_json value) {
    entries_.push_back({name, std::move(text), std::move(value)});
  }
  std::vector<Entry> entries_;
};

// Nearest-rank percentile of `values` (q in [0, 1]); NaN when empty.
double Percentile(std::vector<double> values, double q) {
  if (values.empty()) return std::nan("");
  std::sort(values.begin(), values.end());
  size_t rank = static_cast<size_t>(std::ceil(q * static_cast<double>(values.size())));
  return values[std::clamp<size_t>(rank, 1, values.size()) - 1];
}

double Max(const std::vector<double>& values) {
  return values.empty() ? std::nan("") : *std::max_element(values.begin(), values.end());
}

void AddDistribution(Report& report, const std::string& name, const std::vector<double>& ms,
                     bool with_p99 = true) {
  if (ms.empty()) {
    report.Missing(name + "_p50_ms", "no samples");
    return;
  }
  report.Real(name + "_p50_ms", Percentile(ms, 0.5));
  if (with_p99) report.Real(name + "_p99_ms", Percentile(ms, 0.99));
  report.Real(name + "_max_ms", Max(ms));
  report.Int(name + "_samples", static_cast<int64_t>(ms.size()));
}

// ---------------------------------------------------------------------------------------
// The coordinator's process as /proc shows it.

struct ProcSample {
  int64_t threads = 0;
  int64_t rss_bytes = 0;
  int64_t hwm_bytes = 0;
  double cpu_seconds = 0;     // user + system
  int64_t write_bytes = 0;    // what reached the block layer
  int64_t written_chars = 0;  // what write() and friends were given (wchar)
  int64_t write_calls = 0;    // syscw
  // This process's user + system seconds at the same moment: the simulated workers share
  // the machine with the coordinator, so the report says what they took.
  double client_cpu_seconds = 0;
};

double ClientCpuSeconds() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  auto seconds = [](const timeval& t) { return t.tv_sec + t.tv_usec / 1e6; };
  return seconds(usage.ru_utime) + seconds(usage.ru_stime);
}

absl::StatusOr<std::string> ReadText(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// The value of "Key:" in a /proc key-value file, scaled by 1024 when it ends in "kB".
int64_t ProcField(const std::string& text, absl::string_view key) {
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (!absl::ConsumePrefix(&line, key) || !absl::ConsumePrefix(&line, ":")) continue;
    line = absl::StripAsciiWhitespace(line);
    const bool kb = absl::ConsumeSuffix(&line, " kB");
    int64_t value = 0;
    if (!absl::SimpleAtoi(line, &value)) return 0;
    return kb ? value * 1024 : value;
  }
  return 0;
}

absl::StatusOr<ProcSample> ReadProcSample(pid_t pid) {
  const std::string dir = absl::StrCat("/proc/", pid, "/");
  absl::StatusOr<std::string> status = ReadText(dir + "status");
  absl::StatusOr<std::string> stat = ReadText(dir + "stat");
  absl::StatusOr<std::string> io = ReadText(dir + "io");
  for (const auto* text : {&status, &stat, &io}) {
    if (!text->ok()) return text->status();
  }
  ProcSample sample;
  sample.threads = ProcField(*status, "Threads");
  sample.rss_bytes = ProcField(*status, "VmRSS");
  sample.hwm_bytes = ProcField(*status, "VmHWM");
  // The command name in parentheses may hold spaces; the fields after it do not.
  // utime and stime are fields 14 and 15, the 12th and 13th after ")".
  std::vector<std::string> fields =
      absl::StrSplit(stat->substr(stat->rfind(')') + 2), ' ', absl::SkipEmpty());
  int64_t utime = 0;
  int64_t stime = 0;
  if (fields.size() < 13 || !absl::SimpleAtoi(fields[11], &utime) ||
      !absl::SimpleAtoi(fields[12], &stime)) {
    return absl::DataLossError(absl::StrCat("cannot parse ", dir, "stat"));
  }
  sample.cpu_seconds = static_cast<double>(utime + stime) / sysconf(_SC_CLK_TCK);
  sample.write_bytes = ProcField(*io, "write_bytes");
  sample.written_chars = ProcField(*io, "wchar");
  sample.write_calls = ProcField(*io, "syscw");
  sample.client_cpu_seconds = ClientCpuSeconds();
  return sample;
}

// Samples the coordinator a few times a second for the figures a single reading at the end
// would miss: the most threads it had.
class ProcSampler {
 public:
  explicit ProcSampler(pid_t pid) : thread_([this, pid] { Run(pid); }) {}
  ~ProcSampler() {
    stop_.Notify();
    thread_.join();
  }
  int64_t max_threads() const {
    absl::MutexLock lock(&mu_);
    return max_threads_;
  }

 private:
  void Run(pid_t pid) {
    do {
      absl::StatusOr<ProcSample> sample = ReadProcSample(pid);
      if (!sample.ok()) continue;
      absl::MutexLock lock(&mu_);
      max_threads_ = std::max(max_threads_, sample->threads);
    } while (!stop_.WaitForNotificationWithTimeout(absl::Milliseconds(250)));
  }

  mutable absl::Mutex mu_;
  int64_t max_threads_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Notification stop_;
  std::thread thread_;
};

// ---------------------------------------------------------------------------------------
// Child processes.

// Forks and execs `argv` with stdout and stderr on `output_fd`. The child is killed when this
// thread ends, so that a benchmark killed by its driver leaves no coordinator behind.
absl::StatusOr<pid_t> Spawn(const std::vector<std::string>& argv, int output_fd) {
  std::vector<char*> args;
  for (const std::string& arg : argv) args.push_back(const_cast<char*>(arg.c_str()));
  args.push_back(nullptr);
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127);
    dup2(output_fd, STDOUT_FILENO);
    dup2(output_fd, STDERR_FILENO);
    execv(args[0], args.data());
    std::fprintf(stderr, "cannot run %s: %s\n", args[0], std::strerror(errno));
    _exit(127);
  }
  return pid;
}

// Runs `argv` to the end with its output in `output_path`; the exit status (128 + signal
// when killed).
absl::StatusOr<int> RunToEnd(const std::vector<std::string>& argv, const std::string& output_path) {
  const int fd = open(output_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("cannot write ", output_path));
  absl::StatusOr<pid_t> pid = Spawn(argv, fd);
  close(fd);
  if (!pid.ok()) return pid.status();
  int status = 0;
  while (waitpid(*pid, &status, 0) < 0 && errno == EINTR) {
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// One "scheduler: N passes in ... longest X ms" line of the coordinator's log.
struct SchedulerStats {
  absl::Time logged;
  int64_t passes = 0;
  double longest_ms = 0;
};

// The coordinator as a child process. Its stdout and stderr go through a pipe that a thread
// drains into coordinator.log, so that a slow disk here never blocks its logging; the same
// thread finds the port it listens on and the scheduler's stats lines.
class CoordinatorProcess {
 public:
  ~CoordinatorProcess() {
    Stop();
    if (drain_.joinable()) drain_.join();
  }

  static absl::StatusOr<std::unique_ptr<CoordinatorProcess>> Start(
      const std::vector<std::string>& argv, const std::string& log_path) {
    auto process = std::unique_ptr<CoordinatorProcess>(new CoordinatorProcess());
    process->log_ = std::fopen(log_path.c_str(), "w");
    if (process->log_ == nullptr) {
      return absl::UnavailableError(absl::StrCat("cannot write ", log_path));
    }
    int fds[2];
    if (pipe2(fds, O_CLOEXEC) != 0) {
      return absl::InternalError(absl::StrCat("pipe: ", std::strerror(errno)));
    }
    absl::StatusOr<pid_t> pid = Spawn(argv, fds[1]);
    close(fds[1]);
    if (!pid.ok()) {
      close(fds[0]);
      return pid.status();
    }
    process->pid_ = *pid;
    process->drain_ = std::thread([p = process.get(), fd = fds[0]] { p->Drain(fd); });
    absl::MutexLock lock(&process->mu_);
    auto ready = [p = process.get()]() ABSL_SHARED_LOCKS_REQUIRED(p->mu_) {
      return !p->address_.empty() || p->output_ended_;
    };
    if (!process->mu_.AwaitWithTimeout(absl::Condition(&ready), absl::Seconds(60)) ||
        process->address_.empty()) {
      return absl::UnavailableError(
          absl::StrCat("the coordinator did not say where it listens within 60 s; see ", log_path));
    }
    return process;
  }

  pid_t pid() const { return pid_; }
  std::string address() const {
    absl::MutexLock lock(&mu_);
    return address_;
  }

  // Empty while it runs; how it ended otherwise.
  std::string Ended() {
    if (exit_status_.empty() && pid_ > 0) {
      int status = 0;
      if (waitpid(pid_, &status, WNOHANG) == pid_) exit_status_ = Describe(status);
    }
    return exit_status_;
  }

  // SIGTERM, then SIGKILL after 5 s.
  void Stop() {
    if (pid_ <= 0 || !Ended().empty()) return;
    kill(pid_, SIGTERM);
    const absl::Time deadline = absl::Now() + absl::Seconds(5);
    while (Ended().empty() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(20));
    if (!Ended().empty()) return;
    kill(pid_, SIGKILL);
    int status = 0;
    waitpid(pid_, &status, 0);
    exit_status_ = Describe(status);
  }

  std::vector<SchedulerStats> scheduler_stats() const {
    absl::MutexLock lock(&mu_);
    return scheduler_stats_;
  }

 private:
  CoordinatorProcess() = default;

  static std::string Describe(int status) {
    return WIFEXITED(status) ? absl::StrCat("exit status ", WEXITSTATUS(status))
                             : absl::StrCat("signal ", WTERMSIG(status));
  }

  void Drain(int fd) {
    static const std::regex kStats(R"(scheduler: (\d+) passes in .*longest ([0-9.]+) ms)");
    std::string pending;
    char buffer[1 << 16];
    while (true) {
      const ssize_t n = read(fd, buffer, sizeof(buffer));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      std::fwrite(buffer, 1, static_cast<size_t>(n), log_);
      pending.append(buffer, static_cast<size_t>(n));
      size_t start = 0;
      for (size_t end; (end = pending.find('\n', start)) != std::string::npos; start = end + 1) {
        const std::string line = pending.substr(start, end - start);
        absl::MutexLock lock(&mu_);
        if (address_.empty()) {
          if (size_t at = line.find("listening on "); at != std::string::npos) {
            const std::string rest = line.substr(at + 13);
            address_ = rest.substr(0, rest.find(' '));
          }
        }
        std::smatch match;
        if (line.find("scheduler: ") != std::string::npos &&
            std::regex_search(line, match, kStats)) {
          SchedulerStats& stats = scheduler_stats_.emplace_back();
          stats.logged = absl::Now();
          (void)absl::SimpleAtoi(match[1].str(), &stats.passes);
          (void)absl::SimpleAtod(match[2].str(), &stats.longest_ms);
        }
      }
      pending.erase(0, start);
    }
    std::fwrite(pending.data(), 1, pending.size(), log_);
    std::fclose(log_);
    close(fd);
    absl::MutexLock lock(&mu_);
    output_ended_ = true;
  }

  pid_t pid_ = -1;
  std::FILE* log_ = nullptr;  // the drain thread's
  std::thread drain_;
  std::string exit_status_;
  mutable absl::Mutex mu_;
  std::string address_ ABSL_GUARDED_BY(mu_);
  bool output_ended_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<SchedulerStats> scheduler_stats_ ABSL_GUARDED_BY(mu_);
};

// ---------------------------------------------------------------------------------------
// Simulated workers.

// A completion-queue tag. Each operation a worker starts names one; its completion runs on
// the polling thread of the worker's queue.
class CompletionTag {
 public:
  virtual ~CompletionTag() = default;
  virtual void Complete(bool ok) = 0;
};

class CallbackTag : public CompletionTag {
 public:
  explicit CallbackTag(std::function<void(bool)> done) : done_(std::move(done)) {}
  void Complete(bool ok) override { done_(ok); }

 private:
  std::function<void(bool)> done_;
};

struct BeatSample {
  absl::Time sent;
  double rtt_ms = 0;
};

// What the workers of one queue saw. Written only by that queue's polling thread; read once
// the threads have ended.
struct FleetStats {
  std::vector<BeatSample> beats;
  std::vector<double> registration_ms;  // each worker's first successful RegisterWorker
  std::vector<absl::Time> beat_sent_unanswered;
  int64_t registration_errors = 0;
  int64_t registrations = 0;
  int64_t registrations_unfinished = 0;  // still waiting for an answer when stopped
  int64_t session_expired = 0;           // streams ended with FAILED_PRECONDITION
  int64_t stream_errors = 0;             // streams ended otherwise
  int64_t silence_cancels = 0;  // streams this side ended after a heartbeat timeout of silence
  int64_t assignments = 0;
  int64_t pushes = 0;  // answers to no heartbeat: assignments pushed in between
  int64_t repeated_assignments = 0;
  int64_t cancellations = 0;
  int64_t reports_ok = 0;
  int64_t reports_failed = 0;
  std::string last_error;

  void Merge(FleetStats&& other) {
    beats.insert(beats.end(), other.beats.begin(), other.beats.end());
    registration_ms.insert(registration_ms.end(), other.registration_ms.begin(),
                           other.registration_ms.end());
    beat_sent_unanswered.insert(beat_sent_unanswered.end(), other.beat_sent_unanswered.begin(),
                                other.beat_sent_unanswered.end());
    registration_errors += other.registration_errors;
    registrations += other.registrations;
    registrations_unfinished += other.registrations_unfinished;
    session_expired += other.session_expired;
    stream_errors += other.stream_errors;
    silence_cancels += other.silence_cancels;
    assignments += other.assignments;
    pushes += other.pushes;
    repeated_assignments += other.repeated_assignments;
    cancellations += other.cancellations;
    reports_ok += other.reports_ok;
    reports_failed += other.reports_failed;
    if (!other.last_error.empty()) last_error = other.last_error;
  }
};

class SimWorker;

// One completion queue, its polling thread and the workers on it.
struct Shard {
  grpc::CompletionQueue cq;
  std::vector<SimWorker*> workers;
  FleetStats stats;
  grpc::Alarm stop_alarm;
  std::unique_ptr<CallbackTag> stop_tag;
  std::thread poller;
};

// Counts the operations started on every queue and not completed yet, so that stopping
// knows when nothing is left in flight.
class InFlight {
 public:
  void Started() { count_.fetch_add(1, std::memory_order_relaxed); }
  void Completed() { count_.fetch_sub(1, std::memory_order_relaxed); }
  int64_t count() const { return count_.load(std::memory_order_relaxed); }

 private:
  std::atomic<int64_t> count_{0};
};

struct SimWorkerOptions {
  int64_t slots = 1;
  absl::Duration default_interval = absl::Seconds(2);
  bool legacy_replies = false;
};

// A worker agent without trainers. Everything it does runs on its shard's polling thread,
// so it needs no lock.
class SimWorker {
 public:
  SimWorker(int index, const std::string& address, const SimWorkerOptions& options, Shard* shard,
            InFlight* in_flight, std::atomic<int64_t>* registered)
      : id_(absl::StrFormat("sim-%05d", index)),
        options_(options),
        shard_(shard),
        in_flight_(in_flight),
        registered_(registered),
        slots_(static_cast<size_t>(options.slots)),
        interval_(options.default_interval),
        bitgen_(std::seed_seq{index}) {
    // Each worker its own connection, as separate agents would have: the unique argument
    // keeps gRPC from sharing one subchannel between the channels, and the server takes at
    // most 64 streams per connection.
    grpc::ChannelArguments args;
    args.SetInt("lathe.sim_worker", index);
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    args.SetMaxReceiveMessageSize(kMaxMessageBytes);
    stub_ = v1::WorkerService::NewStub(
        grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
  }

  // Registers at `at`. Any thread, before the polling starts.
  void Start(absl::Time at) { ArmRetry(at); }

  // Ends whatever is in flight and starts nothing more. On the polling thread.
  void Stop() {
    stopping_ = true;
    if (tick_armed_) tick_alarm_.Cancel();
    if (retry_armed_) retry_alarm_.Cancel();
    if (register_context_ != nullptr) {
      ++stats().registrations_unfinished;
      register_context_->TryCancel();
    }
    if (stream_context_ != nullptr) stream_context_->TryCancel();
  }

  // Since the first registration was sent, for each slot: how long until its first
  // assignment arrived (nullopt: not by `until`). Once the polling has ended.
  std::vector<std::optional<absl::Duration>> PlacementDelays(absl::Time until) const {
    std::vector<std::optional<absl::Duration>> delays;
    for (const Slot& slot : slots_) {
      if (slot.first_assigned == absl::InfinitePast() || slot.first_assigned > until) {
        delays.push_back(std::nullopt);
      } else {
        delays.push_back(slot.first_assigned - first_register_sent_);
      }
    }
    return delays;
  }

 private:
  struct Slot {
    std::string job_id;  // empty: idle
    int64_t generation = 0;
    int64_t rank = 0;
    absl::Time first_assigned = absl::InfinitePast();
  };

  // A ReportProgress in flight; deletes itself when answered.
  class ReportCall : public CompletionTag {
   public:
    explicit ReportCall(FleetStats* stats) : stats_(stats) {}
    void Complete(bool) override {
      if (status.ok()) {
        ++stats_->reports_ok;
      } else {
        ++stats_->reports_failed;
        stats_->last_error = absl::StrCat("ReportProgress: ", status.error_message());
      }
      delete this;
    }
    grpc::ClientContext context;
    v1::ReportProgressResponse response;
    grpc::Status status;
    std::unique_ptr<grpc::ClientAsyncResponseReader<v1::ReportProgressResponse>> reader;

   private:
    FleetStats* stats_;
  };

  FleetStats& stats() { return shard_->stats; }

  void ArmRetry(absl::Time at) {
    retry_armed_ = true;
    in_flight_->Started();
    retry_alarm_.Set(&shard_->cq, absl::ToChronoTime(at), &retry_tag_);
  }

  void OnRetry(bool ok) {
    retry_armed_ = false;
    if (ok && !stopping_) Register();
  }

  void Register() {
    v1::RegisterWorkerRequest request;
    request.set_worker_id(id_);
    request.set_device(v1::DEVICE_CPU);
    request.set_slots(options_.slots);
    request.set_host_memory_bytes(kHostMemoryBytes);
    request.set_version("coordinator_scale_bench");
    register_context_ = std::make_unique<grpc::ClientContext>();
    register_context_->set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
    register_response_.Clear();
    register_sent_ = absl::Now();
    if (first_register_sent_ == absl::InfinitePast()) first_register_sent_ = register_sent_;
    register_reader_ =
        stub_->PrepareAsyncRegisterWorker(register_context_.get(), request, &shard_->cq);
    register_reader_->StartCall();
    in_flight_->Started();
    register_reader_->Finish(&register_response_, &register_status_, &registered_tag_);
  }

  void OnRegistered(bool) {
    const absl::Time now = absl::Now();
    register_reader_.reset();
    register_context_.reset();
    if (stopping_) return;
    if (!register_status_.ok()) {
      ++stats().registration_errors;
      stats().last_error = absl::StrCat("RegisterWorker: ", register_status_.error_message());
      ArmRetry(now + absl::Seconds(1) + absl::Milliseconds(absl::Uniform(bitgen_, 0, 500)));
      return;
    }
    ++stats().registrations;
    if (!ever_registered_) {
      stats().registration_ms.push_back(absl::ToDoubleMilliseconds(now - register_sent_));
    }
    session_id_ = register_response_.session_id();
    if (register_response_.heartbeat_interval_ms() > 0) {
      interval_ = absl::Milliseconds(register_response_.heartbeat_interval_ms());
    }
    timeout_ = register_response_.heartbeat_timeout_ms() > 0
                   ? absl::Milliseconds(register_response_.heartbeat_timeout_ms())
                   : absl::InfiniteDuration();
    if (!ever_registered_) {
      ever_registered_ = true;
      registered_->fetch_add(1);
      // A random phase, so that the workers' heartbeats spread over the interval as
      // independent agents' would.
      next_tick_ = now + interval_ * absl::Uniform(bitgen_, 0.0, 1.0);
      ArmTick();
    }
    OpenStream();
  }

  void OpenStream() {
    stream_context_ = std::make_unique<grpc::ClientContext>();
    stream_ = stub_->PrepareAsyncHeartbeat(stream_context_.get(), &shard_->cq);
    stream_ops_ = 1;
    stream_live_ = false;
    stream_finished_ = false;
    silenced_ = false;
    write_pending_ = false;
    want_write_ = false;
    sent_.clear();
    last_answer_ = absl::Now();
    in_flight_->Started();
    stream_->StartCall(&stream_started_tag_);
  }

  void OnStreamStarted(bool ok) {
    --stream_ops_;
    if (!ok || stopping_) {
      FinishStream();
      return;
    }
    stream_live_ = true;
    Read();
    // The agent's first heartbeat goes at once: it settles what the worker runs, and is
    // the first chance of an assignment.
    SendBeat();
  }

  void Read() {
    ++stream_ops_;
    in_flight_->Started();
    stream_->Read(&response_, &read_tag_);
  }

  void FinishStream() {
    stream_live_ = false;
    ++stream_ops_;
    in_flight_->Started();
    stream_->Finish(&stream_status_, &finished_tag_);
  }

  void ArmTick() {
    tick_armed_ = true;
    in_flight_->Started();
    tick_alarm_.Set(&shard_->cq, absl::ToChronoTime(next_tick_), &tick_tag_);
  }

  // The heartbeat clock runs from the first registration to the end, across sessions, as
  // the agent's loop does.
  void OnTick(bool ok) {
    tick_armed_ = false;
    if (!ok || stopping_) return;
    const absl::Time now = absl::Now();
    next_tick_ += interval_;
    if (next_tick_ < now) next_tick_ = now + interval_;  // fell behind: no catch-up burst
    ArmTick();
    if (!stream_live_) return;
    // The agent gives up on a stream whose coordinator stays silent this long.
    if (!sent_.empty() && now - last_answer_ > timeout_) {
      silenced_ = true;
      stream_context_->TryCancel();
      return;
    }
    SendBeat();
  }

  // One write at a time may be in flight on a stream: a beat due while the last one is still
  // being written goes as soon as it is.
  void SendBeat() {
    if (!stream_live_) return;
    if (write_pending_) {
      want_write_ = true;
      return;
    }
    v1::HeartbeatRequest request;
    request.set_worker_id(id_);
    request.set_session_id(session_id_);
    for (size_t i = 0; i < slots_.size(); ++i) {
      v1::SlotStatus* slot = request.add_slots();
      slot->set_slot(static_cast<int64_t>(i));
      if (!slots_[i].job_id.empty()) {
        slot->set_job_id(slots_[i].job_id);
        slot->set_generation(slots_[i].generation);
        slot->set_rank(slots_[i].rank);
      }
    }
    write_pending_ = true;
    request.set_sequence(++sequence_);
    sent_.push_back({sequence_, absl::Now()});
    ++stream_ops_;
    in_flight_->Started();
    stream_->Write(request, &written_tag_);
  }

  void OnWritten(bool ok) {
    --stream_ops_;
    write_pending_ = false;
    if (ok && want_write_ && stream_live_) {
      want_write_ = false;
      SendBeat();
    }
    MaybeStreamEnded();
  }

  void OnRead(bool ok) {
    --stream_ops_;
    if (!ok) {
      FinishStream();
      return;
    }
    const absl::Time now = absl::Now();
    last_answer_ = now;
    // An answer names the heartbeat it answers (in_reply_to); 0 is an assignment pushed
    // between heartbeats. A coordinator from before that answered in order, unprompted never.
    const int64_t answers =
        options_.legacy_replies && !sent_.empty() ? sent_.front().first : response_.in_reply_to();
    while (answers != 0 && !sent_.empty() && sent_.front().first <= answers) {
      if (sent_.front().first == answers) {
        stats().beats.push_back(
            {sent_.front().second, absl::ToDoubleMilliseconds(now - sent_.front().second)});
      } else {
        stats().beat_sent_unanswered.push_back(sent_.front().second);
      }
      sent_.pop_front();
    }
    if (answers == 0) ++stats().pushes;
    HandleResponse(response_, now);
    response_.Clear();
    if (stopping_) {
      FinishStream();
      return;
    }
    Read();
  }

  void OnFinished(bool) {
    --stream_ops_;
    stream_finished_ = true;
    MaybeStreamEnded();
  }

  // Once the stream's last operation has completed: count how it ended and register again,
  // as the agent does after any end of its session.
  void MaybeStreamEnded() {
    if (!stream_finished_ || stream_ops_ > 0) return;
    for (const auto& [sequence, sent] : sent_) stats().beat_sent_unanswered.push_back(sent);
    sent_.clear();
    stream_.reset();
    stream_context_.reset();
    if (stopping_) return;
    absl::Duration delay = absl::Milliseconds(500 + absl::Uniform(bitgen_, 0, 500));
    if (silenced_) {
      ++stats().silence_cancels;
    } else if (stream_status_.error_code() == grpc::StatusCode::FAILED_PRECONDITION) {
      ++stats().session_expired;
      delay = absl::ZeroDuration();
    } else {
      ++stats().stream_errors;
      stats().last_error = absl::StrCat("Heartbeat: ", stream_status_.error_code(), " ",
                                        stream_status_.error_message());
    }
    ArmRetry(absl::Now() + delay);
  }

  void HandleResponse(const v1::HeartbeatResponse& response, absl::Time now) {
    // Cancellations first: an assignment in the same answer may reuse the slot they free.
    for (const v1::Cancellation& cancellation : response.cancellations()) {
      ++stats().cancellations;
      for (Slot& slot : slots_) {
        if (slot.job_id == cancellation.job_id() &&
            (cancellation.generation() == 0 || slot.generation == cancellation.generation())) {
          slot.job_id.clear();
        }
      }
    }
    for (const v1::Assignment& assignment : response.assignments()) {
      if (assignment.slot() < 0 || assignment.slot() >= static_cast<int64_t>(slots_.size())) {
        stats().last_error = absl::StrCat("an assignment to slot ", assignment.slot(), " of ",
                                          slots_.size(), " on ", id_);
        continue;
      }
      Slot& slot = slots_[static_cast<size_t>(assignment.slot())];
      if (slot.job_id == assignment.job_id() && slot.generation == assignment.generation() &&
          slot.rank == assignment.rank()) {
        ++stats().repeated_assignments;
        continue;
      }
      ++stats().assignments;
      slot.job_id = assignment.job_id();
      slot.generation = assignment.generation();
      slot.rank = assignment.rank();
      if (slot.first_assigned == absl::InfinitePast()) slot.first_assigned = now;
      ReportStarted(slot);
    }
  }

  void ReportStarted(const Slot& slot) {
    v1::ReportProgressRequest request;
    request.set_worker_id(id_);
    request.set_job_id(slot.job_id);
    request.set_generation(slot.generation);
    request.set_rank(slot.rank);
    request.set_event(v1::RANK_EVENT_STARTED);
    auto* call = new ReportCall(&stats());
    call->context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    call->reader = stub_->PrepareAsyncReportProgress(&call->context, request, &shard_->cq);
    call->reader->StartCall();
    in_flight_->Started();
    call->reader->Finish(&call->response, &call->status, call);
  }

  const std::string id_;
  const SimWorkerOptions options_;
  Shard* const shard_;
  InFlight* const in_flight_;
  std::atomic<int64_t>* const registered_;
  std::unique_ptr<v1::WorkerService::Stub> stub_;
  std::vector<Slot> slots_;
  absl::Duration interval_;
  absl::Duration timeout_ = absl::InfiniteDuration();
  absl::BitGen bitgen_;
  bool stopping_ = false;

  grpc::Alarm retry_alarm_;
  bool retry_armed_ = false;
  CallbackTag retry_tag_{[this](bool ok) { OnRetry(ok); }};
  grpc::Alarm tick_alarm_;
  bool tick_armed_ = false;
  absl::Time next_tick_;
  CallbackTag tick_tag_{[this](bool ok) { OnTick(ok); }};

  std::unique_ptr<grpc::ClientContext> register_context_;
  std::unique_ptr<grpc::ClientAsyncResponseReader<v1::RegisterWorkerResponse>> register_reader_;
  v1::RegisterWorkerResponse register_response_;
  grpc::Status register_status_;
  absl::Time register_sent_;
  absl::Time first_register_sent_ = absl::InfinitePast();
  bool ever_registered_ = false;
  std::string session_id_;
  CallbackTag registered_tag_{[this](bool ok) { OnRegistered(ok); }};

  std::unique_ptr<grpc::ClientContext> stream_context_;
  std::unique_ptr<grpc::ClientAsyncReaderWriter<v1::HeartbeatRequest, v1::HeartbeatResponse>>
      stream_;
  int stream_ops_ = 0;  // operations in flight on stream_
  bool stream_live_ = false;
  bool stream_finished_ = false;
  bool silenced_ = false;
  bool write_pending_ = false;
  bool want_write_ = false;
  int64_t sequence_ = 0;                             // of the last heartbeat sent
  std::deque<std::pair<int64_t, absl::Time>> sent_;  // beats not answered yet, oldest first
  absl::Time last_answer_;
  v1::HeartbeatResponse response_;
  grpc::Status stream_status_;
  CallbackTag stream_started_tag_{[this](bool ok) { OnStreamStarted(ok); }};
  CallbackTag written_tag_{[this](bool ok) { OnWritten(ok); }};
  CallbackTag read_tag_{[this](bool ok) { OnRead(ok); }};
  CallbackTag finished_tag_{[this](bool ok) { OnFinished(ok); }};
};

// The simulated workers, spread over `threads` completion queues.
class Fleet {
 public:
  Fleet(int64_t workers, int threads, const std::string& address, const SimWorkerOptions& options) {
    for (int i = 0; i < threads; ++i) shards_.push_back(std::make_unique<Shard>());
    for (int64_t i = 0; i < workers; ++i) {
      Shard* shard = shards_[static_cast<size_t>(i) % shards_.size()].get();
      workers_.push_back(std::make_unique<SimWorker>(static_cast<int>(i), address, options, shard,
                                                     &in_flight_, &registered_));
      shard->workers.push_back(workers_.back().get());
    }
  }

  ~Fleet() { Stop(); }

  // Worker i registers at start_at(i).
  void Start(const std::function<absl::Time(int64_t)>& start_at) {
    for (size_t i = 0; i < workers_.size(); ++i) {
      workers_[i]->Start(start_at(static_cast<int64_t>(i)));
    }
    for (auto& shard : shards_) {
      shard->poller = std::thread([this, s = shard.get()] {
        void* tag = nullptr;
        bool ok = false;
        while (s->cq.Next(&tag, &ok)) {
          static_cast<CompletionTag*>(tag)->Complete(ok);
          in_flight_.Completed();
        }
      });
    }
  }

  int64_t registered() const { return registered_.load(); }

  // Cancels everything in flight and ends the polling threads.
  void Stop() {
    if (stopped_) return;
    stopped_ = true;
    for (auto& shard : shards_) {
      if (!shard->poller.joinable()) continue;
      shard->stop_tag = std::make_unique<CallbackTag>([s = shard.get()](bool) {
        for (SimWorker* worker : s->workers) worker->Stop();
      });
      in_flight_.Started();
      shard->stop_alarm.Set(&shard->cq, gpr_now(GPR_CLOCK_MONOTONIC), shard->stop_tag.get());
    }
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    while (in_flight_.count() > 0 && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(10));
    }
    for (auto& shard : shards_) shard->cq.Shutdown();
    for (auto& shard : shards_) {
      if (shard->poller.joinable()) shard->poller.join();
    }
  }

  // REQUIRES: Stop() has returned.
  FleetStats TakeStats() {
    FleetStats all;
    for (auto& shard : shards_) all.Merge(std::move(shard->stats));
    return all;
  }

  // Per slot, the delay to its first assignment (nullopt: none by `until`). REQUIRES: stopped.
  std::vector<std::optional<absl::Duration>> PlacementDelays(absl::Time until) const {
    std::vector<std::optional<absl::Duration>> delays;
    for (const auto& worker : workers_) {
      for (const auto& delay : worker->PlacementDelays(until)) delays.push_back(delay);
    }
    return delays;
  }

 private:
  std::vector<std::unique_ptr<Shard>> shards_;
  std::vector<std::unique_ptr<SimWorker>> workers_;
  InFlight in_flight_;
  std::atomic<int64_t> registered_{0};
  bool stopped_ = false;
};

// ---------------------------------------------------------------------------------------
// Jobs and queries, from one synchronous client.

struct JobFiles {
  std::string model_dir;
  std::string train;
  std::string output_root;
};

absl::StatusOr<JobFiles> MakeJobFiles(const std::string& bin_dir, const std::string& dir) {
  JobFiles files{dir + "/model", dir + "/train.jsonl", dir + "/out"};
  const std::vector<std::vector<std::string>> commands = {
      {bin_dir + "/lathe-synth",
       "model",
       "--out",
       files.model_dir,
       "--vocab",
       "512",
       "--hidden",
       "64",
       "--layers",
       "2",
       "--heads",
       "4",
       "--kv-heads",
       "2",
       "--intermediate",
       "128",
       "--max-pos",
       "256",
       "--seed",
       "1"},
      {bin_dir + "/lathe-synth", "data", "--out", files.train, "--vocab", "512", "--records", "64",
       "--min-len", "16", "--max-len", "64", "--seed", "2"},
  };
  for (const auto& command : commands) {
    const std::string log = dir + "/lathe-synth.log";
    absl::StatusOr<int> code = RunToEnd(command, log);
    if (!code.ok()) return code.status();
    if (*code != 0) {
      return absl::InternalError(
          absl::StrCat("lathe-synth ", command[1], " failed (", *code, "); see ", log));
    }
  }
  std::filesystem::create_directories(files.output_root);
  return files;
}

// A small LoRA job on one CPU rank that never ends (the simulated ranks never finish).
v1::JobSpec MakeJobSpec(const JobFiles& files, int64_t index) {
  v1::JobSpec spec;
  spec.set_name("scale");
  spec.mutable_model()->set_path(files.model_dir);
  spec.mutable_data()->set_train(files.train);
  spec.mutable_data()->set_seq_len(64);
  spec.set_method(v1::METHOD_LORA);
  spec.mutable_train()->set_steps(1000000);
  spec.mutable_resources()->set_ranks(1);
  spec.mutable_resources()->set_device(v1::DEVICE_CPU);
  spec.set_output(absl::StrCat(files.output_root, "/job-", index));
  return spec;
}

std::unique_ptr<grpc::ClientContext> ContextWithin(absl::Duration deadline) {
  auto context = std::make_unique<grpc::ClientContext>();
  context->set_deadline(absl::ToChronoTime(absl::Now() + deadline));
  return context;
}

std::string Describe(const grpc::Status& status) {
  return absl::StrCat("code ", status.error_code(), ": ", status.error_message());
}

// `count` WatchJob streams on one job, on async gRPC (one polling thread), 50 streams per
// connection (the coordinator allows 64 per connection).
class Watchers {
 public:
  Watchers(const std::string& address, const std::string& job_id, int64_t count) {
    v1::WatchJobRequest request;
    request.set_job_id(job_id);
    std::unique_ptr<v1::JobService::Stub> stub;
    for (int64_t i = 0; i < count; ++i) {
      if (i % 50 == 0) {
        grpc::ChannelArguments args;
        args.SetInt("lathe.sim_watcher", static_cast<int>(i));
        args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
        stubs_.push_back(v1::JobService::NewStub(
            grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args)));
      }
      auto watch = std::make_unique<Watch>(this);
      watch->reader = stubs_.back()->PrepareAsyncWatchJob(&watch->context, request, &cq_);
      watch->reader->StartCall(&watch->started);
      watches_.push_back(std::move(watch));
    }
    poller_ = std::thread([this] {
      void* tag = nullptr;
      bool ok = false;
      while (cq_.Next(&tag, &ok)) static_cast<CompletionTag*>(tag)->Complete(ok);
    });
  }

  // Streams that received the job's status at least once and have not ended.
  int64_t open() const { return open_.load(); }

  // Cancels every stream and waits for all to end.
  void Stop() {
    for (auto& watch : watches_) watch->context.TryCancel();
    while (ended_.load() < static_cast<int64_t>(watches_.size())) {
      absl::SleepFor(absl::Milliseconds(10));
    }
    cq_.Shutdown();
    poller_.join();
  }

 private:
  struct Watch {
    explicit Watch(Watchers* owner)
        : started([this](bool ok) { ok ? Read() : End(); }),
          read([this, owner](bool ok) {
            if (!ok) return End();
            if (!got) owner->open_.fetch_add(1);
            got = true;
            Read();
          }),
          finished([this, owner](bool) {
            if (got) owner->open_.fetch_sub(1);
            owner->ended_.fetch_add(1);
          }) {}
    void Read() { reader->Read(&status, &read); }
    void End() { reader->Finish(&end, &finished); }

    grpc::ClientContext context;
    std::unique_ptr<grpc::ClientAsyncReader<v1::JobStatus>> reader;
    v1::JobStatus status;
    grpc::Status end;
    bool got = false;
    CallbackTag started, read, finished;
  };

  grpc::CompletionQueue cq_;
  std::vector<std::unique_ptr<v1::JobService::Stub>> stubs_;
  std::vector<std::unique_ptr<Watch>> watches_;
  std::atomic<int64_t> open_{0};
  std::atomic<int64_t> ended_{0};
  std::thread poller_;
};

struct SubmitResult {
  int64_t submitted = 0;
  int64_t failed = 0;
  double seconds = 0;
  std::vector<double> window_rates;  // jobs/s of each full window, in order
  std::vector<double> latencies_ms;
  std::string first_error;
  bool stopped_early = false;
};

// Submits `jobs` jobs one after another; stops early after `time_limit` or 20 failures in a
// row (a coordinator that refuses everything would otherwise take the whole budget).
SubmitResult SubmitJobs(v1::JobService::Stub& stub, const JobFiles& files, int64_t jobs,
                        int64_t window, absl::Duration time_limit) {
  SubmitResult result;
  const std::string prefix =
      absl::StrFormat("scale-%d-%d-", getpid(), absl::ToUnixMicros(absl::Now()));
  const absl::Time start = absl::Now();
  absl::Time window_start = start;
  int64_t in_window = 0;
  int64_t failed_in_a_row = 0;
  for (int64_t i = 0; i < jobs; ++i) {
    if (absl::Now() - start > time_limit || failed_in_a_row >= 20) {
      result.stopped_early = true;
      break;
    }
    v1::SubmitJobRequest request;
    *request.mutable_spec() = MakeJobSpec(files, i);
    request.set_request_id(absl::StrCat(prefix, i));
    v1::SubmitJobResponse response;
    auto context = ContextWithin(absl::Seconds(60));
    const absl::Time sent = absl::Now();
    const grpc::Status status = stub.SubmitJob(context.get(), request, &response);
    const absl::Time now = absl::Now();
    result.latencies_ms.push_back(absl::ToDoubleMilliseconds(now - sent));
    if (status.ok()) {
      ++result.submitted;
      failed_in_a_row = 0;
    } else {
      ++result.failed;
      ++failed_in_a_row;
      if (result.first_error.empty()) result.first_error = Describe(status);
    }
    if (++in_window == window) {
      result.window_rates.push_back(static_cast<double>(window) /
                                    absl::ToDoubleSeconds(now - window_start));
      Progress(absl::StrFormat("%d jobs sent, %.0f jobs/s", i + 1, result.window_rates.back()));
      window_start = now;
      in_window = 0;
    }
  }
  result.seconds = absl::ToDoubleSeconds(absl::Now() - start);
  return result;
}

void AddSubmitReport(Report& report, const SubmitResult& result, int64_t jobs, int64_t window) {
  report.Int("jobs_submitted", result.submitted);
  report.Int("jobs_refused", result.failed);
  if (!result.first_error.empty()) report.Text("submit_first_error", result.first_error);
  if (result.stopped_early) {
    report.Text("submit_stopped_early",
                absl::StrCat("after ", result.submitted + result.failed, " of ", jobs));
  }
  report.Real("submit_seconds", result.seconds);
  report.Real("submit_jobs_per_s",
              result.seconds > 0 ? static_cast<double>(result.submitted) / result.seconds : 0);
  AddDistribution(report, "submit_latency", result.latencies_ms);
  report.Int("submit_window_jobs", window);
  if (result.window_rates.empty()) {
    report.Missing("submit_first_window_jobs_per_s", "fewer jobs than one window");
    return;
  }
  const double first = result.window_rates.front();
  const double last = result.window_rates.back();
  report.Real("submit_first_window_jobs_per_s", first);
  report.Real("submit_last_window_jobs_per_s", last);
  report.Real("submit_last_over_first", last / first, 3);
  std::vector<std::string> rates;
  for (double rate : result.window_rates) rates.push_back(absl::StrFormat("%.0f", rate));
  report.Text("submit_windows_jobs_per_s", absl::StrJoin(rates, " "));
}

// The first page of ListJobs (100 jobs, no filter), timed `times` times.
void AddListJobsReport(Report& report, v1::JobService::Stub& stub, int times) {
  std::vector<double> ms;
  for (int i = 0; i < times; ++i) {
    v1::ListJobsRequest request;
    request.set_page_size(100);
    v1::ListJobsResponse response;
    auto context = ContextWithin(kQueryDeadline);
    const absl::Time sent = absl::Now();
    const grpc::Status status = stub.ListJobs(context.get(), request, &response);
    if (!status.ok()) {
      report.Missing("list_jobs_p50_ms", Describe(status));
      return;
    }
    ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - sent));
  }
  report.Real("list_jobs_p50_ms", Percentile(ms, 0.5));
  report.Real("list_jobs_max_ms", Max(ms));
}

// `lathe list` as a user runs it: every page, the table printed (to /dev/null).
void AddCliListReport(Report& report, const std::string& bin_dir, const std::string& address,
                      const std::string& dir) {
  const absl::Time start = absl::Now();
  absl::StatusOr<int> code =
      RunToEnd({bin_dir + "/lathe", "list", "--coordinator", address}, dir + "/lathe-list.out");
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  if (!code.ok() || *code != 0) {
    report.Missing("lathe_list_s",
                   code.ok() ? absl::StrCat("exit status ", *code, "; see ", dir, "/lathe-list.out")
                             : std::string(code.status().message()));
    return;
  }
  report.Real("lathe_list_s", seconds, 3);
}

// Jobs per state, every page read.
absl::StatusOr<std::map<v1::JobState, int64_t>> CountJobs(v1::JobService::Stub& stub) {
  std::map<v1::JobState, int64_t> counts;
  std::string token;
  const absl::Time deadline = absl::Now() + 2 * kQueryDeadline;
  int pages = 0;
  do {
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat("ListJobs: ", pages, " pages in ",
                                                      absl::FormatDuration(2 * kQueryDeadline)));
    }
    ++pages;
    v1::ListJobsRequest request;
    request.set_page_size(1000);
    request.set_page_token(token);
    v1::ListJobsResponse response;
    auto context = ContextWithin(std::min(kQueryDeadline, deadline - absl::Now()));
    const grpc::Status status = stub.ListJobs(context.get(), request, &response);
    if (!status.ok()) return absl::UnavailableError(absl::StrCat("ListJobs: ", Describe(status)));
    for (const v1::JobStatus& job : response.jobs()) ++counts[job.state()];
    if (!response.next_page_token().empty() && response.next_page_token() == token) {
      return absl::DataLossError("ListJobs repeated its page token");
    }
    token = response.next_page_token();
  } while (!token.empty());
  return counts;
}

void AddJobCountsReport(Report& report, v1::JobService::Stub& stub) {
  absl::StatusOr<std::map<v1::JobState, int64_t>> counts = CountJobs(stub);
  if (!counts.ok()) {
    report.Missing("jobs_failed_at_end", std::string(counts.status().message()));
    return;
  }
  report.Int("jobs_queued_at_end", (*counts)[v1::JOB_STATE_QUEUED]);
  report.Int("jobs_running_at_end", (*counts)[v1::JOB_STATE_RUNNING]);
  report.Int("jobs_failed_at_end", (*counts)[v1::JOB_STATE_FAILED]);
}

void AddWorkerCountsReport(Report& report, v1::WorkerService::Stub& stub) {
  v1::ListWorkersResponse response;
  auto context = ContextWithin(kQueryDeadline);
  const grpc::Status status = stub.ListWorkers(context.get(), {}, &response);
  if (!status.ok()) {
    report.Missing("workers_lost_at_end", Describe(status));
    return;
  }
  int64_t lost = 0;
  int64_t ready = 0;
  for (const v1::WorkerStatus& worker : response.workers()) {
    lost += worker.state() == v1::WORKER_STATE_LOST;
    ready += worker.state() == v1::WORKER_STATE_READY;
  }
  report.Int("workers_ready_at_end", ready);
  report.Int("workers_lost_at_end", lost);
}

// ---------------------------------------------------------------------------------------
// Scenarios.

struct BenchConfig {
  std::string scenario;
  std::string bin_dir = "build/bin";
  bool sqlite = true;
  int64_t workers = 1000;
  int64_t jobs = 1000;
  int64_t slots = 1;
  double heartbeat_interval = 2;
  double heartbeat_timeout = 15;
  double duration = 30;
  int64_t window = 1000;
  absl::Duration submit_time_limit = absl::InfiniteDuration();
  int threads = 2;
  std::string work_dir;
  bool keep = false;
  bool legacy_replies = false;
  int64_t watchers = 0;
  std::string json_path;
};

// Everything one scenario run holds: the scratch directory, the coordinator, a client.
class Bench {
 public:
  Bench(const BenchConfig& config, std::string dir) : config_(config), dir_(std::move(dir)) {}

  absl::Status StartCoordinator() {
    std::vector<std::string> argv = {config_.bin_dir + "/lathe-coordinator",
                                     "--listen",
                                     "127.0.0.1:0",
                                     "--db",
                                     config_.sqlite ? dir_ + "/lathe.db" : ":memory:",
                                     "--insecure-no-auth",
                                     "--allowed-roots",
                                     dir_,
                                     "--heartbeat-interval",
                                     absl::StrCat(config_.heartbeat_interval),
                                     "--heartbeat-timeout",
                                     absl::StrCat(config_.heartbeat_timeout)};
    absl::StatusOr<std::unique_ptr<CoordinatorProcess>> process =
        CoordinatorProcess::Start(argv, dir_ + "/coordinator.log");
    if (!process.ok()) return process.status();
    coordinator_ = *std::move(process);
    Progress(absl::StrCat("lathe-coordinator (pid ", coordinator_->pid(), ") listening on ",
                          coordinator_->address()));
    sampler_ = std::make_unique<ProcSampler>(coordinator_->pid());
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(kMaxMessageBytes);
    auto channel = grpc::CreateCustomChannel(coordinator_->address(),
                                             grpc::InsecureChannelCredentials(), args);
    jobs_ = v1::JobService::NewStub(channel);
    workers_ = v1::WorkerService::NewStub(channel);
    absl::StatusOr<ProcSample> start = ReadProcSample(coordinator_->pid());
    if (!start.ok()) return start.status();
    started_ = *start;
    return absl::OkStatus();
  }

  // The coordinator's figures over [from, to], read at `from` (`begin`) and now.
  void AddProcessReport(Report& report, const std::optional<ProcSample>& begin, absl::Time from,
                        absl::Time to) {
    const std::string ended = coordinator_->Ended();
    if (!ended.empty()) {
      report.Text("coordinator_ended_early", ended);
      return;
    }
    absl::StatusOr<ProcSample> end = ReadProcSample(coordinator_->pid());
    if (!end.ok() || !begin.has_value()) {
      report.Missing("coordinator_threads", end.ok() ? "no reading at the window's start"
                                                     : std::string(end.status().message()));
      return;
    }
    const double seconds = absl::ToDoubleSeconds(to - from);
    report.Real("window_s", seconds, 1);
    report.Int("coordinator_threads", end->threads);
    report.Int("coordinator_threads_max", std::max(sampler_->max_threads(), end->threads));
    report.Real("coordinator_rss_mib", static_cast<double>(end->rss_bytes) / (1 << 20), 1);
    report.Real("coordinator_hwm_mib", static_cast<double>(end->hwm_bytes) / (1 << 20), 1);
    report.Real("coordinator_cpu_percent",
                seconds > 0 ? 100 * (end->cpu_seconds - begin->cpu_seconds) / seconds : 0, 1);
    report.Real("coordinator_disk_write_mib",
                static_cast<double>(end->write_bytes - begin->write_bytes) / (1 << 20), 2);
    report.Real(
        "coordinator_write_calls_per_s",
        seconds > 0 ? static_cast<double>(end->write_calls - begin->write_calls) / seconds : 0, 1);
    report.Real("coordinator_disk_write_mib_whole_run",
                static_cast<double>(end->write_bytes - started_.write_bytes) / (1 << 20), 2);
    report.Real(
        "client_cpu_percent",
        seconds > 0 ? 100 * (end->client_cpu_seconds - begin->client_cpu_seconds) / seconds : 0, 1);
  }

  // The longest scheduling pass logged in [from, to].
  void AddSchedulerReport(Report& report, absl::Time from, absl::Time to) {
    int64_t passes = 0;
    double longest = -1;
    for (const SchedulerStats& stats : coordinator_->scheduler_stats()) {
      if (stats.logged < from || stats.logged > to) continue;
      passes += stats.passes;
      longest = std::max(longest, stats.longest_ms);
    }
    if (longest < 0) {
      report.Missing("scheduler_longest_pass_ms", "no scheduler stats lines in the log");
      return;
    }
    report.Int("scheduler_passes", passes);
    report.Real("scheduler_longest_pass_ms", longest);
  }

  void AddFleetReport(Report& report, const FleetStats& stats, absl::Time from, absl::Time to) {
    std::vector<double> rtt;
    for (const BeatSample& beat : stats.beats) {
      if (beat.sent >= from && beat.sent <= to) rtt.push_back(beat.rtt_ms);
    }
    AddDistribution(report, "heartbeat_rtt", rtt);
    int64_t unanswered = 0;
    for (absl::Time sent : stats.beat_sent_unanswered) unanswered += sent >= from && sent <= to;
    report.Int("heartbeats_unanswered", unanswered);
    report.Int("registrations", stats.registrations);
    report.Int("registration_errors", stats.registration_errors);
    report.Int("registrations_unanswered_at_stop", stats.registrations_unfinished);
    report.Int("sessions_expired", stats.session_expired);
    report.Int("heartbeat_stream_errors", stats.stream_errors);
    report.Int("heartbeat_streams_given_up_silent", stats.silence_cancels);
    report.Int("pushed_answers", stats.pushes);
    if (!stats.last_error.empty()) report.Text("last_client_error", stats.last_error);
  }

  absl::Status Heartbeat(Report& report) {
    LATHE_RETURN_IF_ERROR(StartCoordinator());
    // Watchers follow one job (placed on a simulated worker, where it runs for good).
    std::unique_ptr<Watchers> watchers;
    if (config_.watchers > 0) {
      absl::StatusOr<JobFiles> files = MakeJobFiles(config_.bin_dir, dir_);
      if (!files.ok()) return files.status();
      v1::SubmitJobRequest request;
      *request.mutable_spec() = MakeJobSpec(*files, 0);
      v1::SubmitJobResponse response;
      const grpc::Status submitted =
          jobs_->SubmitJob(ContextWithin(absl::Seconds(60)).get(), request, &response);
      if (!submitted.ok()) {
        return absl::UnavailableError(absl::StrCat("the watched job: ", Describe(submitted)));
      }
      Progress(absl::StrCat(config_.watchers, " watchers of ", response.job_id()));
      watchers =
          std::make_unique<Watchers>(coordinator_->address(), response.job_id(), config_.watchers);
    }
    Fleet fleet(config_.workers, config_.threads, coordinator_->address(), WorkerOptions());
    const absl::Time start = absl::Now() + absl::Milliseconds(100);
    const absl::Duration spread = absl::Seconds(2);
    fleet.Start([&](int64_t i) { return start + spread * (double(i) / config_.workers); });
    Progress(absl::StrCat(config_.workers, " workers registering over 2 s"));
    const absl::Time registered = WaitForRegistrations(fleet, start + spread + absl::Seconds(60));
    Progress(
        absl::StrCat(fleet.registered(), " registered; heartbeats for ", config_.duration, " s"));
    report.Int("workers_registered", fleet.registered());
    report.Real("registration_all_s", absl::ToDoubleSeconds(registered - start), 2);
    // The first interval after the last registration is warm-up: every worker's first
    // beats, and the connections still settling.
    const absl::Time from = registered + Interval();
    const absl::Time to = registered + absl::Seconds(config_.duration);
    absl::SleepFor(from - absl::Now());
    std::optional<ProcSample> begin = Sample();
    absl::SleepFor(to - absl::Now());
    AddProcessReport(report, begin, from, absl::Now());
    AddSchedulerReport(report, from, to);
    Progress("ListWorkers");
    if (coordinator_->Ended().empty()) AddWorkerCountsReport(report, *workers_);
    if (watchers != nullptr) {
      report.Int("watchers", config_.watchers);
      report.Int("watch_streams_open_at_end", watchers->open());
      watchers->Stop();
    }
    Progress("stopping the workers");
    fleet.Stop();
    AddFleetReport(report, fleet.TakeStats(), from, to);
    return absl::OkStatus();
  }

  absl::Status Submit(Report& report) {
    LATHE_RETURN_IF_ERROR(StartCoordinator());
    absl::StatusOr<JobFiles> files = MakeJobFiles(config_.bin_dir, dir_);
    if (!files.ok()) return files.status();
    std::optional<ProcSample> begin = Sample();
    const absl::Time from = absl::Now();
    Progress(absl::StrCat("submitting ", config_.jobs, " jobs"));
    SubmitResult result =
        SubmitJobs(*jobs_, *files, config_.jobs, config_.window, config_.submit_time_limit);
    const absl::Time to = absl::Now();
    AddSubmitReport(report, result, config_.jobs, config_.window);
    AddProcessReport(report, begin, from, to);
    if (!coordinator_->Ended().empty()) return absl::OkStatus();
    Progress("ListJobs, lathe list");
    AddListJobsReport(report, *jobs_, 5);
    AddCliListReport(report, config_.bin_dir, coordinator_->address(), dir_);
    // The coordinator logs its passes every 10 s: wait for the line that covers the end.
    Progress("waiting for the coordinator's scheduler stats");
    const absl::Time give_up = absl::Now() + absl::Seconds(11);
    auto logged_after = [&](absl::Time t) {
      for (const SchedulerStats& stats : coordinator_->scheduler_stats()) {
        if (stats.logged >= t) return true;
      }
      return false;
    };
    while (!logged_after(to) && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(100));
    AddSchedulerReport(report, from, absl::Now());
    return absl::OkStatus();
  }

  absl::Status Burst(Report& report) {
    LATHE_RETURN_IF_ERROR(StartCoordinator());
    absl::StatusOr<JobFiles> files = MakeJobFiles(config_.bin_dir, dir_);
    if (!files.ok()) return files.status();
    Progress(absl::StrCat("submitting ", config_.jobs, " jobs"));
    SubmitResult submitted =
        SubmitJobs(*jobs_, *files, config_.jobs, config_.window, config_.submit_time_limit);
    AddSubmitReport(report, submitted, config_.jobs, config_.window);
    if (!coordinator_->Ended().empty()) {
      report.Text("coordinator_ended_early", coordinator_->Ended());
      return absl::OkStatus();
    }
    Fleet fleet(config_.workers, config_.threads, coordinator_->address(), WorkerOptions());
    // Every registration at one instant: a cluster coming back after an outage.
    const absl::Time from = absl::Now() + absl::Milliseconds(200);
    const absl::Time to = from + absl::Seconds(config_.duration);
    std::optional<ProcSample> begin = Sample();
    fleet.Start([&](int64_t) { return from; });
    Progress(absl::StrCat(config_.workers, " workers registering at once; heartbeats for ",
                          config_.duration, " s"));
    absl::SleepFor(to - absl::Now());
    report.Int("workers_registered", fleet.registered());
    AddProcessReport(report, begin, from, absl::Now());
    AddSchedulerReport(report, from, to);
    if (coordinator_->Ended().empty()) {
      Progress("ListWorkers, ListJobs");
      AddWorkerCountsReport(report, *workers_);
      AddJobCountsReport(report, *jobs_);
    }
    Progress("stopping the workers");
    fleet.Stop();
    std::vector<double> placement_ms;
    int64_t never = 0;
    // Assignments after the window are the queries' doing as much as the burst's.
    for (const auto& delay : fleet.PlacementDelays(to)) {
      if (delay.has_value()) {
        placement_ms.push_back(absl::ToDoubleMilliseconds(*delay));
      } else {
        ++never;
      }
    }
    AddDistribution(report, "placement", placement_ms);
    report.Int("slots_never_assigned", never);
    FleetStats stats = fleet.TakeStats();
    AddDistribution(report, "registration", stats.registration_ms, /*with_p99=*/false);
    report.Int("assignments", stats.assignments);
    report.Int("cancellations", stats.cancellations);
    report.Int("reports_started_ok", stats.reports_ok);
    report.Int("reports_started_failed", stats.reports_failed);
    AddFleetReport(report, stats, from, to);
    return absl::OkStatus();
  }

  void StopCoordinator(Report& report) {
    if (coordinator_ == nullptr) return;
    const std::string early = coordinator_->Ended();
    sampler_.reset();
    Progress("stopping the coordinator");
    coordinator_->Stop();
    if (!early.empty()) report.Text("coordinator_exit", early);
  }

 private:
  SimWorkerOptions WorkerOptions() const {
    SimWorkerOptions options;
    options.slots = config_.slots;
    options.default_interval = Interval();
    options.legacy_replies = config_.legacy_replies;
    return options;
  }
  absl::Duration Interval() const { return absl::Seconds(config_.heartbeat_interval); }

  std::optional<ProcSample> Sample() const {
    absl::StatusOr<ProcSample> sample = ReadProcSample(coordinator_->pid());
    if (!sample.ok()) return std::nullopt;
    return *sample;
  }

  // When every worker had registered once, or `deadline`.
  absl::Time WaitForRegistrations(const Fleet& fleet, absl::Time deadline) const {
    while (fleet.registered() < config_.workers && absl::Now() < deadline &&
           coordinator_->Ended().empty()) {
      absl::SleepFor(absl::Milliseconds(20));
    }
    return absl::Now();
  }

  const BenchConfig config_;
  const std::string dir_;
  std::unique_ptr<CoordinatorProcess> coordinator_;
  std::unique_ptr<ProcSampler> sampler_;
  ProcSample started_;
  std::unique_ptr<v1::JobService::Stub> jobs_;
  std::unique_ptr<v1::WorkerService::Stub> workers_;
};

// ---------------------------------------------------------------------------------------

std::string CpuModel() {
  absl::StatusOr<std::string> cpuinfo = ReadText("/proc/cpuinfo");
  if (!cpuinfo.ok()) return "unknown";
  for (absl::string_view line : absl::StrSplit(*cpuinfo, '\n')) {
    if (absl::ConsumePrefix(&line, "model name")) {
      return std::string(absl::StripAsciiWhitespace(
          absl::StripPrefix(absl::StripLeadingAsciiWhitespace(line), ":")));
    }
  }
  return "unknown";
}

// Each simulated worker holds a socket here and one in the coordinator, which inherits this
// limit.
void RaiseFileLimit() {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) == 0 && limit.rlim_cur < limit.rlim_max) {
    limit.rlim_cur = limit.rlim_max;
    setrlimit(RLIMIT_NOFILE, &limit);
  }
}

absl::StatusOr<BenchConfig> ParseConfig(const ParsedFlags& flags) {
  BenchConfig config;
  config.scenario = flags.Get("scenario");
  if (config.scenario != "heartbeat" && config.scenario != "submit" && config.scenario != "burst") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--scenario: expected heartbeat, submit or burst, got \"", config.scenario, "\""));
  }
  config.bin_dir = flags.Get("bin-dir", config.bin_dir);
  const std::string db = flags.Get("db", "sqlite");
  if (db != "sqlite" && db != "memory") {
    return absl::InvalidArgumentError(
        absl::StrCat("--db: expected sqlite or memory, got \"", db, "\""));
  }
  config.sqlite = db == "sqlite";
  struct IntFlag {
    const char* name;
    int64_t* value;
    int64_t min;
  };
  int64_t threads = config.threads;
  for (const IntFlag& f :
       {IntFlag{"workers", &config.workers, 1}, IntFlag{"jobs", &config.jobs, 0},
        IntFlag{"slots", &config.slots, 1}, IntFlag{"window", &config.window, 1},
        IntFlag{"threads", &threads, 1}, IntFlag{"watchers", &config.watchers, 0}}) {
    absl::StatusOr<int64_t> value = flags.GetInt(f.name, *f.value);
    if (!value.ok()) return value.status();
    if (*value < f.min) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", f.name, ": must be at least ", f.min, ", got ", *value));
    }
    *f.value = *value;
  }
  config.threads = static_cast<int>(std::min<int64_t>(threads, 64));
  struct RealFlag {
    const char* name;
    double* value;
  };
  double time_limit = 0;
  for (const RealFlag& f :
       {RealFlag{"heartbeat-interval", &config.heartbeat_interval},
        RealFlag{"heartbeat-timeout", &config.heartbeat_timeout},
        RealFlag{"duration", &config.duration}, RealFlag{"submit-time-limit", &time_limit}}) {
    absl::StatusOr<double> value = flags.GetDouble(f.name, *f.value);
    if (!value.ok()) return value.status();
    if (!(*value >= 0) || (*value == 0 && f.value != &time_limit)) {
      return absl::InvalidArgumentError(absl::StrCat("--", f.name, ": must be > 0, got ", *value));
    }
    *f.value = *value;
  }
  if (time_limit > 0) config.submit_time_limit = absl::Seconds(time_limit);
  if (config.heartbeat_interval >= config.heartbeat_timeout) {
    return absl::InvalidArgumentError("--heartbeat-interval must be below --heartbeat-timeout");
  }
  if (config.scenario == "heartbeat" && config.duration <= config.heartbeat_interval) {
    return absl::InvalidArgumentError(
        "--duration must exceed --heartbeat-interval (the first interval is warm-up)");
  }
  const char* tmpdir = std::getenv("TMPDIR");
  config.work_dir = flags.Get("work-dir", tmpdir != nullptr && *tmpdir ? tmpdir : "/tmp");
  config.keep = flags.Has("keep");
  config.legacy_replies = flags.Has("legacy-replies");
  config.json_path = flags.Get("json");
  return config;
}

int Main(int argc, char** argv) {
  absl::StatusOr<ParsedFlags> flags = ParseFlags({argv + 1, argv + argc}, kFlags);
  if (!flags.ok() || flags->Has("help") || !flags->positional().empty()) {
    if (!flags.ok()) std::cerr << "coordinator_scale_bench: " << flags.status().message() << "\n";
    std::cerr << "usage: coordinator_scale_bench --scenario heartbeat|submit|burst [flags]\n"
              << FlagsHelp(kFlags);
    return flags.ok() && flags->Has("help") ? 0 : 2;
  }
  absl::StatusOr<BenchConfig> config = ParseConfig(*flags);
  if (!config.ok()) {
    std::cerr << "coordinator_scale_bench: " << config.status().message() << "\n";
    return 2;
  }
  config->bin_dir = std::filesystem::absolute(config->bin_dir).string();
  const std::string coordinator = config->bin_dir + "/lathe-coordinator";
  if (access(coordinator.c_str(), X_OK) != 0) {
    std::cerr << "coordinator_scale_bench: no lathe-coordinator in " << config->bin_dir
              << " (--bin-dir)\n";
    return 2;
  }
  RaiseFileLimit();
  signal(SIGPIPE, SIG_IGN);

  std::string pattern = config->work_dir + "/lathe-scale-XXXXXX";
  if (mkdtemp(pattern.data()) == nullptr) {
    std::cerr << "coordinator_scale_bench: cannot make a directory in " << config->work_dir << ": "
              << std::strerror(errno) << "\n";
    return 1;
  }
  // The coordinator resolves symbolic links in --allowed-roots and in spec paths alike;
  // the canonical form keeps both sides the same.
  const std::string dir = std::filesystem::canonical(pattern).string();
  Progress(absl::StrCat("scratch directory ", dir, config->keep ? "" : " (removed at the end)"));

  Report report;
  report.Text("scenario", config->scenario);
  report.Text("date", absl::FormatTime("%Y-%m-%d %H:%M:%S %Z", absl::Now(), absl::UTCTimeZone()));
  report.Text("cpu", CpuModel());
  report.Int("cores", sysconf(_SC_NPROCESSORS_ONLN));
  // Other work on the machine skews every figure here; say how busy it was when we began.
  absl::StatusOr<std::string> loadavg = ReadText("/proc/loadavg");
  if (loadavg.ok()) {
    std::vector<std::string> fields = absl::StrSplit(*loadavg, ' ');
    report.Text("load_average_at_start", absl::StrJoin(fields.begin(), fields.begin() + 3, " "));
  }
  report.Text("coordinator", coordinator);
  report.Text("db", config->sqlite ? "sqlite" : "memory");
  if (config->scenario != "submit") {
    report.Int("workers", config->workers);
    report.Int("slots_per_worker", config->slots);
    report.Real("heartbeat_interval_s", config->heartbeat_interval, 1);
    report.Real("heartbeat_timeout_s", config->heartbeat_timeout, 1);
    report.Real("duration_s", config->duration, 1);
    report.Int("client_threads", config->threads);
  }
  if (config->scenario != "heartbeat") report.Int("jobs", config->jobs);

  Bench bench(*config, dir);
  absl::Status status = config->scenario == "heartbeat" ? bench.Heartbeat(report)
                        : config->scenario == "submit"  ? bench.Submit(report)
                                                        : bench.Burst(report);
  bench.StopCoordinator(report);
  if (!status.ok()) report.Text("error", std::string(status.message()));
  if (config->keep) {
    report.Text("work_dir", dir);
  } else {
    std::error_code ignored;
    std::filesystem::remove_all(dir, ignored);
  }
  report.Print();
  if (!config->json_path.empty()) {
    if (absl::Status written = report.WriteJson(config->json_path); !written.ok()) {
      std::cerr << "coordinator_scale_bench: " << written.message() << "\n";
      return 1;
    }
  }
  if (!status.ok()) {
    std::cerr << "coordinator_scale_bench: " << status.message() << "\n";
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace lathe

int main(int argc, char** argv) { return lathe::Main(argc, argv); }
