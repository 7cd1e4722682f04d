#include "worker/agent/progress_reporter.h"

#include <algorithm>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/rpc/auth.h"
#include "common/rpc/grpc_status.h"
#include "grpcpp/client_context.h"
#include "spdlog/spdlog.h"

namespace lathe {
namespace {

bool IsTerminal(v1::RankEvent event) {
  return event == v1::RANK_EVENT_SUCCEEDED || event == v1::RANK_EVENT_FAILED ||
         event == v1::RANK_EVENT_CANCELLED;
}

bool SameRank(const v1::ReportProgressRequest& a, const v1::ReportProgressRequest& b) {
  return a.job_id() == b.job_id() && a.generation() == b.generation() && a.rank() == b.rank();
}

}  // namespace

ProgressReporter::ProgressReporter(v1::WorkerService::StubInterface* stub,
                                   ProgressReporterOptions options)
    : stub_(stub), options_(options) {
  thread_ = std::thread([this] { Loop(); });
}

ProgressReporter::~ProgressReporter() { Stop(); }

void ProgressReporter::Report(v1::ReportProgressRequest request, std::function<void()> on_done) {
  {
    absl::MutexLock lock(&mu_);
    if (!stopping_) {
      if (request.event() == v1::RANK_EVENT_PROGRESS && !on_done) {
        for (Item& queued : queue_) {
          if (queued.request.event() == v1::RANK_EVENT_PROGRESS && !queued.on_done &&
              SameRank(queued.request, request)) {
            // The newer progress supersedes the queued one, but not what only the first
            // report of a rank says: the step it resumed from.
            if (request.resumed_from_step() == 0) {
              request.set_resumed_from_step(queued.request.resumed_from_step());
            }
            queued.request = std::move(request);
            return;
          }
        }
      }
      queue_.push_back({std::move(request), std::move(on_done)});
      return;
    }
  }
  spdlog::warn("job={} attempt={} rank={}: {} not reported, the agent is stopping",
               request.job_id(), request.generation(), request.rank(),
               v1::RankEvent_Name(request.event()));
  if (on_done) on_done();
}

void ProgressReporter::Stop() {
  {
    absl::MutexLock lock(&mu_);
    if (stopped_) return;
    stopping_ = true;
    stopped_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

void ProgressReporter::Loop() {
  while (true) {
    Item item;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]()
                       ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || !queue_.empty(); };
      mu_.Await(absl::Condition(&ready));
      if (queue_.empty()) return;
      item = std::move(queue_.front());
      queue_.pop_front();
    }
    Deliver(item.request);
    if (item.on_done) item.on_done();
  }
}

void ProgressReporter::Deliver(const v1::ReportProgressRequest& request) {
  Backoff backoff(options_.retry);
  while (true) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + options_.rpc_timeout));
    AttachToken(&context, options_.token);
    v1::ReportProgressResponse response;
    const absl::Status status = FromGrpcStatus(stub_->ReportProgress(&context, request, &response));
    if (status.ok()) {
      if (dropped_progress_ > 1) {
        spdlog::info("job={} attempt={} rank={}: reporting again after {} dropped progress reports",
                     request.job_id(), request.generation(), request.rank(), dropped_progress_);
      }
      dropped_progress_ = 0;
      return;
    }
    // A step's progress is superseded by the next: while the coordinator is away, one line
    // says so rather than one per step.
    if (request.event() == v1::RANK_EVENT_PROGRESS && ++dropped_progress_ > 1) return;
    bool stopping;
    {
      absl::MutexLock lock(&mu_);
      stopping = stopping_;
    }
    const bool retry = IsTerminal(request.event()) && IsRetryable(status.code()) && !stopping;
    const absl::Duration delay = retry ? backoff.Next() : absl::ZeroDuration();
    spdlog::warn("job={} attempt={} rank={}: reporting {} failed: {}{}", request.job_id(),
                 request.generation(), request.rank(), v1::RankEvent_Name(request.event()),
                 status.ToString(),
                 retry ? absl::StrCat("; retrying in ", absl::FormatDuration(delay))
                       : std::string("; dropped"));
    if (!retry) return;
    absl::MutexLock lock(&mu_);
    mu_.AwaitWithTimeout(absl::Condition(&stopping_), delay);
  }
}

}  // namespace lathe
