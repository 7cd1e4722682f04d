#include "worker/train/profiler.h"

#include <sys/stat.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <unistd.h>

#if LATHE_TORCH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/util/ApproximateClock.h>
#endif

#include <array>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <set>
#include <system_error>
#include <unordered_map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/file_util.h"
#include "common/memory_components.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
#include "worker/engine/memory_tracker.h"
#include "worker/engine/profile_scope.h"

namespace lathe {
namespace {

namespace fs = std::filesystem;
namespace kineto = torch::autograd::profiler;
using torch::profiler::impl::ActivityType;
using torch::profiler::impl::ProfilerConfig;
using torch::profiler::impl::ProfilerState;

std::string HostProcessName(int64_t rank) { return absl::StrCat("lathe rank ", rank); }

// What the memory file says beyond the record.
struct MemoryFileInfo {
  int64_t rank = 0;
  std::string device;
  std::string source;
  std::string capture_id;
  int64_t first_step = 0;
  int64_t last_step = 0;
  int64_t mapped_weight_bytes = 0;
  // CUDA: blocks live before the capture carry no component (the history has no tag for
  // them); they count as "untagged".
  bool untagged_start = false;
};

// Samples of the memory by component for the trace's counter track "memory (bytes)": one per
// event, or, past kMaxMemoryCounterSamples, the highest of each run of consecutive events (so
// that the peak survives). Timestamps as Kineto writes them: microseconds since the trace's
// baseTimeNanoseconds.
void AddMemoryCounters(const MemoryRecord& record, const MemoryFileInfo& info, int64_t pid,
                       int64_t base_ns, nlohmann::json& events) {
  constexpr size_t kMaxMemoryCounterSamples = 20000;
  const int64_t start_blocks = static_cast<int64_t>(record.live_at_start.size());
  std::array<int64_t, kNumMemoryComponents> current{};
  int64_t untagged = 0;
  for (const RecordedBlock& block : record.live_at_start) {
    (info.untagged_start ? untagged : current[static_cast<int>(block.component)]) += block.bytes;
  }
  current[static_cast<int>(MemoryComponent::kWeights)] += info.mapped_weight_bytes;
  auto sample = [&](int64_t time_ns) {
    nlohmann::json args = nlohmann::json::object();
    for (MemoryComponent c : kMemoryComponents) {
      args[std::string(MemoryComponentName(c))] = current[static_cast<int>(c)];
    }
    if (info.untagged_start) args["untagged"] = untagged;
    return nlohmann::json{
        {"name", "memory (bytes)"},
        {"ph", "C"},
        {"pid", pid},
        {"tid", 0},
        {"ts", static_cast<double>(record.start_unix_ns + time_ns - base_ns) / 1e3},
        {"args", std::move(args)}};
  };
  events.push_back(sample(0));
  const size_t run = record.events.size() / kMaxMemoryCounterSamples + 1;
  nlohmann::json best;
  int64_t best_total = -1;
  for (size_t i = 0; i < record.events.size(); ++i) {
    const MemoryEvent& e = record.events[i];
    (info.untagged_start && e.block <= start_blocks ? untagged
                                                    : current[static_cast<int>(e.component)]) +=
        e.bytes;
    if (e.total_bytes > best_total) {
      best = sample(e.time_ns);
      best_total = e.total_bytes;
    }
    if ((i + 1) % run == 0 || i + 1 == record.events.size()) {
      events.push_back(std::move(best));
      best_total = -1;
    }
  }
}

// Names the trace's processes after the rank, so that the traces of several ranks, merged,
// tell apart, and adds the memory record, when there is one, as a counter track: this process
// (Kineto names it after the executable) becomes "lathe rank <R>", labelled "rank <R>" and sorted
// by rank; every other process of the trace (a GPU, in Kineto's traces) "lathe rank <R>: <its
// name>".
absl::Status PostProcessTrace(const std::string& path, int64_t rank, const MemoryRecord* record,
                              const MemoryFileInfo& info) {
  LATHE_ASSIGN_OR_RETURN(std::string text, ReadFile(path));
  nlohmann::json trace = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (trace.is_discarded() || !trace.is_object() || !trace.contains("traceEvents") ||
      !trace["traceEvents"].is_array()) {
    return absl::InternalError(absl::StrCat(path, ": libtorch's profiler wrote no Chrome trace"));
  }
  nlohmann::json& events = trace["traceEvents"];
  const int64_t host_pid = getpid();
  const std::string host_name = HostProcessName(rank);
  std::set<int64_t> pids;
  std::set<std::pair<int64_t, std::string>> present;  // (pid, metadata name) set above
  for (nlohmann::json& event : events) {
    if (!event.is_object() || !event.contains("pid") || !event["pid"].is_number_integer()) continue;
    const int64_t pid = event["pid"].get<int64_t>();
    pids.insert(pid);
    if (event.value("ph", "") != "M") continue;
    const std::string name = event.value("name", "");
    if (!event.contains("args") || !event["args"].is_object())
      event["args"] = nlohmann::json::object();
    nlohmann::json& args = event["args"];
    if (name == "process_name") {
      const std::string original = args.value("name", "");
      args["name"] = pid == host_pid ? host_name : absl::StrCat(host_name, ": ", original);
    } else if (name == "process_labels" && pid == host_pid) {
      args["labels"] = absl::StrCat("rank ", rank);
    } else if (name == "process_sort_index" && pid == host_pid) {
      args["sort_index"] = rank;
    } else {
      continue;
    }
    present.insert({pid, name});
  }
  pids.insert(host_pid);
  auto metadata = [](int64_t pid, const char* name, nlohmann::json args) {
    return nlohmann::json{{"name", name}, {"ph", "M"}, {"pid", pid}, {"tid", 0}, {"args", args}};
  };
  for (int64_t pid : pids) {
    if (present.count({pid, "process_name"}) == 0) {
      events.push_back(
          metadata(pid, "process_name",
                   {{"name", pid == host_pid ? host_name : absl::StrCat(host_name, ": ", pid)}}));
    }
  }
  if (present.count({host_pid, "process_labels"}) == 0) {
    events.push_back(
        metadata(host_pid, "process_labels", {{"labels", absl::StrCat("rank ", rank)}}));
  }
  if (present.count({host_pid, "process_sort_index"}) == 0) {
    events.push_back(metadata(host_pid, "process_sort_index", {{"sort_index", rank}}));
  }
  if (record != nullptr && trace.contains("baseTimeNanoseconds") &&
      trace["baseTimeNanoseconds"].is_number_integer()) {
    AddMemoryCounters(*record, info, host_pid, trace["baseTimeNanoseconds"].get<int64_t>(), events);
  }
  // Invalid UTF-8 in a name (an operator's, say) is replaced rather than thrown on.
  return WriteFileAtomically(path,
                             trace.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
}

nlohmann::ordered_json BlockJson(const RecordedBlock& block, bool untagged) {
  return {{"block", block.id},
          {"bytes", block.bytes},
          {"component", untagged ? "untagged" : std::string(MemoryComponentName(block.component))},
          {"scope", block.scope.ToString()}};
}

// The memory timeline file (docs/observability.md, "Profiling"). Byte counts of the peak and
// the steps include the mapped weights, as a step's reported peak does.
absl::Status WriteMemoryFile(const std::string& path, const MemoryRecord& record,
                             const MemoryFileInfo& info) {
  const int64_t start_blocks = static_cast<int64_t>(record.live_at_start.size());
  auto untagged = [&](int64_t id) { return info.untagged_start && id <= start_blocks; };
  nlohmann::ordered_json out;
  out["rank"] = info.rank;
  out["device"] = info.device;
  out["source"] = info.source;
  out["capture_id"] = info.capture_id;
  out["first_step"] = info.first_step;
  out["last_step"] = info.last_step;
  out["max_events"] = record.max_events;
  out["truncated"] = record.truncated();
  if (record.dropped_events >= 0) {
    out["dropped_events"] = record.dropped_events;
  } else {
    out["dropped_events"] = nullptr;
    out["truncated_note"] =
        "the CUDA allocator's history kept only its last entries: the capture's first events "
        "are lost and the totals, peak and blocks replayed from the start are not exact";
  }
  out["mapped_weight_bytes"] = info.mapped_weight_bytes;
  out["start"] = {{"allocated_bytes", record.start_total_bytes}, {"live_blocks", start_blocks}};

  nlohmann::ordered_json peak;
  peak["bytes"] = record.peak_bytes + info.mapped_weight_bytes;
  peak["allocated_bytes"] = record.peak_bytes;
  peak["time_us"] = static_cast<double>(record.peak_time_ns) / 1e3;
  int64_t peak_step = info.first_step;
  for (const MemoryRecord::StepPeak& s : record.steps) {
    if (s.first_event <= record.peak_event) peak_step = s.step;
  }
  peak["step"] = peak_step;
  peak["scope"] = record.peak_scope.ToString();
  nlohmann::ordered_json at_peak;
  for (MemoryComponent c : kMemoryComponents) {
    int64_t bytes = record.at_peak[static_cast<int>(c)];
    if (c == MemoryComponent::kWeights) bytes += info.mapped_weight_bytes;
    at_peak[std::string(MemoryComponentName(c))] = bytes;
  }
  std::optional<std::vector<RecordedBlock>> top = record.TopBlocksAtPeak(10);
  if (info.untagged_start) {
    int64_t tagged = 0;
    for (MemoryComponent c : kMemoryComponents) tagged += record.at_peak[static_cast<int>(c)];
    at_peak["untagged"] = record.peak_bytes - tagged;
  }
  peak["at_peak"] = std::move(at_peak);
  if (top) {
    nlohmann::ordered_json blocks = nlohmann::ordered_json::array();
    for (const RecordedBlock& block : *top) blocks.push_back(BlockJson(block, untagged(block.id)));
    peak["top_blocks"] = std::move(blocks);
  } else {
    peak["top_blocks"] = nullptr;
    peak["top_blocks_unavailable"] = "the peak came after the record was truncated";
  }
  out["peak"] = std::move(peak);

  nlohmann::ordered_json steps = nlohmann::ordered_json::array();
  for (const MemoryRecord::StepPeak& s : record.steps) {
    steps.push_back({{"step", s.step},
                     {"first_event", s.first_event},
                     {"peak_bytes", s.peak_bytes + info.mapped_weight_bytes}});
  }
  out["steps"] = std::move(steps);

  nlohmann::ordered_json events = nlohmann::ordered_json::array();
  for (const MemoryEvent& e : record.events) {
    events.push_back(
        {{"t_us", static_cast<double>(e.time_ns) / 1e3},
         {"action", e.bytes > 0 ? "alloc" : "free"},
         {"bytes", e.bytes > 0 ? e.bytes : -e.bytes},
         {"block", e.block},
         {"component",
          untagged(e.block) ? "untagged" : std::string(MemoryComponentName(e.component))},
         {"scope", e.scope.ToString()},
         {"total_bytes", e.total_bytes}});
  }
  out["events"] = std::move(events);
  return WriteFileAtomically(
      path, out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n");
}

}  // namespace

// Named (not anonymous): StepProfiler::Capture holds one.
namespace profiler_internal {

#if LATHE_TORCH_CUDA
// CUDA: the caching allocator's history (UNTESTED on a GPU as written; tests/train's gpu test
// covers it where one is lent). Allocations are tagged through the allocator's user metadata,
// "<component>|<scope>", set whenever a MemoryScope or ProfileScope changes.
namespace cuda_alloc = c10::cuda::CUDACachingAllocator;

// Scope names of the capture, interned: a ScopeName holds a pointer that must outlive it.
std::set<std::string>& InternedNames() {
  static auto* names = new std::set<std::string>();
  return *names;
}

void TagCudaAllocations() {
  cuda_alloc::setUserMetadata(absl::StrCat(MemoryComponentName(MemoryScope::Current()), "|",
                                           ProfileScope::Current().ToString()));
}

class CudaHistory {
 public:
  CudaHistory(int device, int64_t max_events) : device_(device), max_events_(max_events) {
    // The blocks live now, from a snapshot without the trace.
    const cuda_alloc::SnapshotInfo before = cuda_alloc::snapshot({0, 0}, /*include_traces=*/false);
    for (const auto& segment : before.segments) {
      if (segment.device != device_) continue;
      size_t address = segment.address;
      for (const auto& block : segment.blocks) {
        if (block.allocated) {
          RecordedBlock recorded{next_id_++, static_cast<int64_t>(block.size),
                                 MemoryComponent::kOverhead, ScopeName{}};
          live_at_start_.push_back(recorded);
          live_.emplace(address, recorded);
          start_bytes_ += recorded.bytes;
        }
        address += block.size;
      }
    }
    start_ns_ = c10::getApproximateTime();
    cuda_alloc::recordHistory(true, nullptr, static_cast<size_t>(max_events),
                              cuda_alloc::RecordContext::NEVER, /*clearHistory=*/true, {});
    ProfileScope::SetListener(&TagCudaAllocations);
    TagCudaAllocations();
  }

  void MarkStep(int64_t step) { marks_.push_back({step, c10::getApproximateTime()}); }

  MemoryRecord Stop() {
    ProfileScope::SetListener(nullptr);
    cuda_alloc::setUserMetadata("");
    const cuda_alloc::SnapshotInfo snapshot = cuda_alloc::snapshot();
    cuda_alloc::recordHistory(false, nullptr, 0, cuda_alloc::RecordContext::NEVER, false, {});
    auto to_unix_ns = converter_.makeConverter();
    MemoryRecord record;
    record.max_events = max_events_;
    record.start_total_bytes = start_bytes_;
    record.start_unix_ns = to_unix_ns(start_ns_);
    record.live_at_start = live_at_start_;
    record.peak_bytes = start_bytes_;
    int64_t total = start_bytes_;
    std::array<int64_t, kNumMemoryComponents> components{};
    size_t mark = 0;
    int64_t index = 0;
    const std::vector<c10::CachingDeviceAllocator::TraceEntry> none;
    const auto& trace = device_ < static_cast<int>(snapshot.device_traces.size())
                            ? snapshot.device_traces[device_]
                            : none;
    const int64_t start_unix = to_unix_ns(start_ns_);
    // The history is a ring of the last max_events entries: a full one lost the capture's
    // first events, and the totals replayed from the start are off by what they held.
    if (static_cast<int64_t>(trace.size()) >= max_events_) record.dropped_events = -1;
    for (const auto& entry : trace) {
      using Action = c10::CachingDeviceAllocator::TraceEntry::Action;
      if (entry.action_ != Action::ALLOC && entry.action_ != Action::FREE_COMPLETED) continue;
      const int64_t t = to_unix_ns(entry.time_.approx_t_);
      while (mark < marks_.size() && to_unix_ns(marks_[mark].second) <= t) {
        record.steps.push_back({marks_[mark].first, index, total});
        ++mark;
      }
      MemoryEvent event;
      event.time_ns = t - start_unix;
      if (entry.action_ == Action::ALLOC) {
        event.bytes = static_cast<int64_t>(entry.size_);
        event.block = next_id_++;
        std::tie(event.component, event.scope) = ParseTag(entry.user_metadata_);
        live_[entry.addr_] = RecordedBlock{event.block, event.bytes, event.component, event.scope};
        components[static_cast<int>(event.component)] += event.bytes;
      } else {
        event.bytes = -static_cast<int64_t>(entry.size_);
        if (auto it = live_.find(entry.addr_); it != live_.end()) {
          event.block = it->second.id;
          event.component = it->second.component;
          event.scope = it->second.scope;
          if (it->second.id > static_cast<int64_t>(live_at_start_.size())) {
            components[static_cast<int>(event.component)] += event.bytes;
          }
          live_.erase(it);
        }
      }
      total += event.bytes;
      event.total_bytes = total;
      if (event.bytes > 0 && total > record.peak_bytes) {
        record.peak_bytes = total;
        record.at_peak = components;
        record.peak_time_ns = event.time_ns;
        record.peak_event = index;
        record.peak_scope = event.scope;
      }
      if (!record.steps.empty()) {
        record.steps.back().peak_bytes = std::max(record.steps.back().peak_bytes, total);
      }
      record.events.push_back(event);
      ++index;
    }
    for (; mark < marks_.size(); ++mark) record.steps.push_back({marks_[mark].first, index, total});
    return record;
  }

 private:
  static std::pair<MemoryComponent, ScopeName> ParseTag(const std::string& tag) {
    const size_t bar = tag.find('|');
    MemoryComponent component = MemoryComponent::kOverhead;
    for (MemoryComponent c : kMemoryComponents) {
      if (absl::string_view(tag).substr(0, bar) == MemoryComponentName(c)) component = c;
    }
    ScopeName scope;
    if (bar != std::string::npos && bar + 1 < tag.size()) {
      scope.name = InternedNames().insert(tag.substr(bar + 1)).first->c_str();
    }
    return {component, scope};
  }

  const int device_;
  const int64_t max_events_;
  c10::ApproximateClockToUnixTimeConverter converter_;
  c10::approx_time_t start_ns_ = 0;
  int64_t next_id_ = 1;
  int64_t start_bytes_ = 0;
  std::vector<RecordedBlock> live_at_start_;
  std::unordered_map<size_t, RecordedBlock> live_;
  std::vector<std::pair<int64_t, c10::approx_time_t>> marks_;
};
#else
class CudaHistory {
 public:
  CudaHistory(int, int64_t) {}
  void MarkStep(int64_t) {}
  MemoryRecord Stop() { return {}; }
};
#endif

}  // namespace profiler_internal

absl::Status CheckProfileRequest(const ProfileRequest& request) {
  LATHE_RETURN_IF_ERROR(CheckCaptureId(request.capture_id));
  if (request.steps < 1 || request.steps > kMaxProfileSteps) {
    return absl::InvalidArgumentError(
        absl::StrCat("steps: ", request.steps, " is not in 1..", kMaxProfileSteps));
  }
  return absl::OkStatus();
}

struct StepProfiler::Capture {
  ProfileRequest request;
  std::string dir;
  int64_t first_step = 0;
  bool kineto = false;                                   // libtorch's profiler is on
  bool cpu_memory = false;                               // the MemoryTracker records
  std::unique_ptr<profiler_internal::CudaHistory> cuda;  // the caching allocator records
  std::vector<std::string> problems;                     // what went wrong on the way
};

StepProfiler::StepProfiler(ProfileOptions options, int64_t rank, at::Device device,
                           int64_t mapped_weight_bytes, MemoryTracker* tracker)
    : options_(std::move(options)),
      rank_(rank),
      device_(device),
      mapped_weight_bytes_(mapped_weight_bytes),
      tracker_(tracker) {
  if (enabled()) request_path_ = (fs::path(options_.dir) / "request.json").string();
}

StepProfiler::~StepProfiler() {
  if (!finished_) Finish(last_done_, "training ended");
}

void StepProfiler::Answer(const ProfileOutcome& outcome) {
  if (options_.on_profile) options_.on_profile(outcome);
}

std::optional<absl::StatusOr<ProfileRequest>> StepProfiler::TakeRequest() {
  if (options_.initial) {
    ProfileRequest request = *std::move(options_.initial);
    options_.initial.reset();
    return request;
  }
  struct stat info;
  if (stat(request_path_.c_str(), &info) != 0) return std::nullopt;  // the common case
  // Claimed by a rename, so that a request renamed into place while this one is read is not
  // removed with it; removed once read, so that a bad request is answered once.
  const std::string taken = request_path_ + ".taken";
  if (std::rename(request_path_.c_str(), taken.c_str()) != 0) return std::nullopt;
  absl::StatusOr<std::string> text = ReadFile(taken);
  std::error_code ignored;
  fs::remove(taken, ignored);
  if (!text.ok()) return text.status();
  if (!options_.parse) {
    return absl::UnimplementedError(
        absl::StrCat(request_path_, ": this lathe-worker cannot read profile requests"));
  }
  return options_.parse(*text);
}

void StepProfiler::BeforeStep(int64_t step) {
  if (!enabled() || finished_) return;
  if (capture_ != nullptr) {
    if (capture_->cpu_memory) tracker_->MarkStep(step);
    if (capture_->cuda) capture_->cuda->MarkStep(step);
    return;
  }
  std::optional<absl::StatusOr<ProfileRequest>> request = TakeRequest();
  if (!request) return;
  if (request->ok()) {
    if (absl::Status valid = CheckProfileRequest(**request); !valid.ok()) *request = valid;
  }
  if (!request->ok()) {
    ProfileOutcome outcome;
    outcome.error = std::string(request->status().message());
    Answer(outcome);
    return;
  }
  Start(**request, step);
}

void StepProfiler::Start(const ProfileRequest& request, int64_t step) {
  ProfileOutcome refused;
  refused.capture_id = request.capture_id;
  const std::string dir = (fs::path(options_.dir) / request.capture_id).string();
  std::error_code error;
  // Ranks may share the directory (`--spec` ranks on one host); each writes its own files.
  for (const char* suffix : {".trace.json", ".memory.json"}) {
    const std::string file = (fs::path(dir) / absl::StrCat("rank-", rank_, suffix)).string();
    if (fs::exists(file, error)) {
      refused.error = absl::StrCat("capture_id: ", file, " exists already");
      Answer(refused);
      return;
    }
  }
  fs::create_directories(dir, error);
  if (error) {
    refused.error = absl::StrCat(dir, ": ", error.message());
    Answer(refused);
    return;
  }
  auto capture = std::make_unique<Capture>();
  capture->request = request;
  capture->dir = fs::absolute(dir).string();
  capture->first_step = step;
  try {
    const ProfilerConfig config(ProfilerState::KINETO);
    std::set<ActivityType> activities = {ActivityType::CPU};
    if (device_.is_cuda()) activities.insert(ActivityType::CUDA);
    kineto::prepareProfiler(config, activities);
    kineto::enableProfiler(config, activities);
    capture->kineto = true;
  } catch (const std::exception& e) {
    capture->problems.push_back(absl::StrCat("no trace: libtorch's profiler: ", e.what()));
  }
  if (request.memory) {
    if (device_.is_cuda()) {
#if LATHE_TORCH_CUDA
      try {
        capture->cuda = std::make_unique<profiler_internal::CudaHistory>(
            device_.has_index() ? device_.index() : 0, kMaxMemoryEvents);
        capture->cuda->MarkStep(step);
      } catch (const std::exception& e) {
        capture->problems.push_back(absl::StrCat("no memory timeline: ", e.what()));
      }
#else
      capture->problems.push_back("no memory timeline: this libtorch has no CUDA");
#endif
    } else {
      tracker_->StartRecording(kMaxMemoryEvents);
      tracker_->MarkStep(step);
      capture->cpu_memory = true;
    }
  }
  capture_ = std::move(capture);
}

void StepProfiler::AfterStep(int64_t step) {
  last_done_ = step;
  if (capture_ != nullptr && step >= capture_->first_step + capture_->request.steps - 1) {
    Close(step, "");
  }
}

void StepProfiler::Finish(int64_t last_step, const std::string& why) {
  if (finished_ || !enabled()) return;
  finished_ = true;
  if (capture_ != nullptr) {
    const int64_t wanted = capture_->first_step + capture_->request.steps - 1;
    Close(last_step,
          absl::StrCat(why, " after step ", last_step, ", before step ", wanted,
                       ": the capture holds steps ", capture_->first_step, " to ", last_step));
  }
  // A request that came too late (or during the capture just closed) is still answered.
  if (std::optional<absl::StatusOr<ProfileRequest>> request = TakeRequest()) {
    ProfileOutcome outcome;
    if (request->ok()) outcome.capture_id = (*request)->capture_id;
    outcome.error = absl::StrCat(why, " after step ", last_step, " before the capture could start");
    Answer(outcome);
  }
}

void StepProfiler::Close(int64_t last_step, std::string error) {
  std::unique_ptr<Capture> capture = std::move(capture_);
  ProfileOutcome outcome;
  outcome.capture_id = capture->request.capture_id;
  outcome.first_step = capture->first_step;
  outcome.last_step = std::max(last_step, capture->first_step - 1);
  if (outcome.last_step < outcome.first_step) outcome.first_step = outcome.last_step = 0;
  std::vector<std::string> problems = std::move(capture->problems);
  // The memory record first: what follows (saving the trace) is not part of the steps.
  std::optional<MemoryRecord> record;
  MemoryFileInfo info;
  info.rank = rank_;
  info.device = device_.str();
  info.capture_id = outcome.capture_id;
  info.first_step = outcome.first_step;
  info.last_step = outcome.last_step;
  if (capture->cpu_memory) {
    record = tracker_->StopRecording();
    info.source = "lathe memory tracker (libtorch CPU allocator)";
    info.mapped_weight_bytes = mapped_weight_bytes_;
  } else if (capture->cuda) {
    try {
      record = capture->cuda->Stop();
      info.source = "CUDA caching allocator history";
      info.untagged_start = true;
    } catch (const std::exception& e) {
      problems.push_back(absl::StrCat("no memory timeline: ", e.what()));
    }
  }
  if (capture->kineto) {
    const std::string path =
        (fs::path(capture->dir) / absl::StrCat("rank-", rank_, ".trace.json")).string();
    try {
      std::unique_ptr<kineto::ProfilerResult> result = kineto::disableProfiler();
      const std::string raw = path + ".kineto";
      result->save(raw);
      std::error_code rename_error;
      const uintmax_t bytes = fs::file_size(raw, rename_error);
      // Renaming parses the whole trace (several times its size in memory): past the bound
      // the trace is kept as Kineto wrote it, its process named after the executable.
      absl::Status named = absl::OkStatus();
      if (!rename_error && bytes <= kMaxRenamedTraceBytes) {
        named = PostProcessTrace(raw, rank_, record ? &*record : nullptr, info);
      } else {
        problems.push_back(absl::StrCat("the trace (", bytes >> 20, " MiB) is larger than ",
                                        kMaxRenamedTraceBytes >> 20,
                                        " MiB: its process is not named after the rank"));
      }
      if (named.ok()) fs::rename(raw, path, rename_error);
      if (!named.ok()) {
        problems.push_back(absl::StrCat("no trace: ", named.message()));
      } else if (rename_error) {
        problems.push_back(absl::StrCat("no trace: ", path, ": ", rename_error.message()));
      } else {
        outcome.files.push_back(path);
      }
      fs::remove(raw, rename_error);
    } catch (const std::exception& e) {
      problems.push_back(absl::StrCat("no trace: libtorch's profiler: ", e.what()));
    }
  }
  if (record) {
    const std::string path =
        (fs::path(capture->dir) / absl::StrCat("rank-", rank_, ".memory.json")).string();
    absl::Status written = WriteMemoryFile(path, *record, info);
    if (written.ok()) {
      outcome.files.push_back(path);
    } else {
      problems.push_back(absl::StrCat("no memory timeline: ", written.message()));
    }
  }
  if (!error.empty()) problems.insert(problems.begin(), std::move(error));
  for (const std::string& problem : problems) {
    if (!outcome.error.empty()) outcome.error += "; ";
    outcome.error += problem;
  }
  Answer(outcome);
}

}  // namespace lathe
