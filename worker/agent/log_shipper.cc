#include "worker/agent/log_shipper.h"

#include <utility>
#include <vector>

#include "common/rpc/auth.h"
#include "spdlog/spdlog.h"

namespace lathe {
namespace {

constexpr size_t kMaxBatch = 1 << 20;  // the coordinator's limit per call

}  // namespace

LogShipper::LogShipper(v1::WorkerService::StubInterface* stub, LogShipperOptions options)
    : stub_(stub), options_(std::move(options)), thread_([this] { Loop(); }) {}

LogShipper::~LogShipper() { Stop(); }

void LogShipper::AppendLine(const std::string& worker_id, const std::string& job_id,
                            int64_t generation, int64_t rank, absl::string_view line) {
  absl::MutexLock lock(&mu_);
  Log& log = logs_[{job_id, generation, rank}];
  log.worker_id = worker_id;
  log.pending.append(line.data(), line.size());
  log.pending.push_back('\n');
  if (log.pending.size() > options_.max_pending) {  // the coordinator is away: oldest go
    const size_t drop = log.pending.size() - options_.max_pending;
    log.pending.erase(0, drop);
    log.sent += static_cast<int64_t>(drop);
    log.lost += static_cast<int64_t>(drop);
  }
}

void LogShipper::Finished(const std::string& job_id, int64_t generation, int64_t rank) {
  absl::MutexLock lock(&mu_);
  auto it = logs_.find({job_id, generation, rank});
  if (it != logs_.end()) it->second.finished = true;
}

bool LogShipper::Shipped(const std::string& job_id, int64_t generation, int64_t rank) {
  absl::MutexLock lock(&mu_);
  auto it = logs_.find({job_id, generation, rank});
  return it == logs_.end() || it->second.pending.empty();
}

void LogShipper::Stop() {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  thread_.join();
  SendAll();
}

void LogShipper::Loop() {
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (mu_.AwaitWithTimeout(absl::Condition(&stopping_), options_.period)) return;
    }
    SendAll();
  }
}

void LogShipper::SendAll() {
  absl::MutexLock sending(&send_mu_);
  struct Batch {
    Key key;
    v1::AppendLogsRequest request;
  };
  std::vector<Batch> batches;
  {
    absl::MutexLock lock(&mu_);
    for (auto it = logs_.begin(); it != logs_.end();) {
      it = it->second.finished && it->second.pending.empty() ? logs_.erase(it) : std::next(it);
    }
    for (auto& [key, log] : logs_) {
      if (log.pending.empty()) continue;
      Batch& b = batches.emplace_back();
      b.key = key;
      b.request.set_worker_id(log.worker_id);
      b.request.set_job_id(std::get<0>(key));
      b.request.set_generation(std::get<1>(key));
      b.request.set_rank(std::get<2>(key));
      b.request.set_offset(log.sent);
      b.request.set_lost(log.lost);
      b.request.set_data(log.pending.substr(0, kMaxBatch));
    }
  }
  for (Batch& b : batches) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + options_.rpc_timeout));
    AttachToken(&context, options_.token);
    v1::AppendLogsResponse response;
    const grpc::Status status = stub_->AppendLogs(&context, b.request, &response);
    const grpc::StatusCode code = status.error_code();
    if (code == grpc::StatusCode::UNAVAILABLE || code == grpc::StatusCode::DEADLINE_EXCEEDED) {
      continue;  // with the next batch
    }
    if (!status.ok()) {
      spdlog::warn("job={} attempt={} rank={} log not taken by the coordinator: {}",
                   b.request.job_id(), b.request.generation(), b.request.rank(),
                   status.error_message());
    }
    // Delivered or refused: either way those bytes are done with.
    absl::MutexLock lock(&mu_);
    auto it = logs_.find(b.key);
    if (it == logs_.end()) continue;
    Log& log = it->second;
    log.lost -= b.request.lost();  // declared; drops since then stay to declare
    const size_t done = std::min(log.pending.size(), b.request.data().size());
    if (log.sent == b.request.offset()) {
      log.pending.erase(0, done);
      log.sent += static_cast<int64_t>(done);
    }
  }
}

}  // namespace lathe
