// Helpers shared by the agent's tests: trainer scripts and an event recorder.
#ifndef LATHE_TESTS_WORKER_AGENT_TEST_UTIL_H_
#define LATHE_TESTS_WORKER_AGENT_TEST_UTIL_H_

#include <filesystem>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/proto/trainer_io.h"
#include "tests/testing/temp_dir.h"
#include "worker/agent/trainer_supervisor.h"

namespace lathe::testing {

// Long enough for a loaded CI machine; tests never wait this long when things work.
inline constexpr absl::Duration kWaitLimit = absl::Seconds(60);

// Writes an executable shell script to dir/name and returns its path.
inline std::string WriteScript(const TempDir& dir, const std::string& name,
                               const std::string& body) {
  std::string path = dir.Write(name, "#!/bin/sh\n" + body);
  std::filesystem::permissions(path, std::filesystem::perms::owner_all);
  return path;
}

// TrainerEvent lines as `lathe-worker train --output json` prints them.
inline std::string StartLine(int steps, int resumed_from_step = 0) {
  v1::TrainerEvent event;
  event.mutable_start()->set_total_steps(steps);
  event.mutable_start()->set_resumed_from_step(resumed_from_step);
  event.mutable_start()->mutable_plan()->mutable_strategy()->set_micro_batch(1);
  return TrainerEventLine(event);
}
// `loss` "null": a step without a finite loss.
inline std::string StepLine(int step, int steps, const std::string& loss) {
  v1::TrainerEvent event;
  v1::Progress* p = event.mutable_step()->mutable_progress();
  p->set_step(step);
  p->set_total_steps(steps);
  if (loss != "null") p->set_loss(std::stod(loss));
  p->set_lr(0.001);
  p->set_grad_norm(0.5);
  p->set_tokens_per_second(1000.0);
  p->set_mfu(0.25);
  event.mutable_step()->set_tokens(64);
  return TrainerEventLine(event);
}
inline std::string DoneLine(int steps, const std::string& final_loss, const std::string& adapter) {
  v1::TrainerEvent event;
  v1::TrainerDone* done = event.mutable_done();
  done->set_steps(steps);
  done->set_final_loss(std::stod(final_loss));
  done->set_adapter_path(adapter);
  done->set_seconds(1.5);
  done->set_tokens_per_second(900.0);
  done->set_peak_rss_bytes(1000);
  return TrainerEventLine(event);
}
inline std::string ErrorLine(const std::string& code, const std::string& message) {
  v1::TrainerEvent event;
  event.mutable_error()->set_code(code);
  event.mutable_error()->set_message(message);
  return TrainerEventLine(event);
}

// Records a supervisor's events.
class EventRecorder {
 public:
  TrainerSupervisor::EventCallback Callback() {
    return [this](const RankReport& event) {
      absl::MutexLock lock(&mu_);
      events_.push_back(event);
    };
  }

  // The terminal event, once there is one; an UNSPECIFIED event after kWaitLimit.
  RankReport WaitForEnd() {
    absl::MutexLock lock(&mu_);
    auto ended = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return !events_.empty() && IsEnd(events_.back().kind);
    };
    if (!mu_.AwaitWithTimeout(absl::Condition(&ended), kWaitLimit)) return RankReport();
    return events_.back();
  }

  // True once an event of `kind` has arrived.
  bool WaitFor(v1::RankEvent kind) {
    absl::MutexLock lock(&mu_);
    auto seen = [this, kind]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      for (const RankReport& e : events_) {
        if (e.kind == kind) return true;
      }
      return false;
    };
    return mu_.AwaitWithTimeout(absl::Condition(&seen), kWaitLimit);
  }

  std::vector<RankReport> events() const {
    absl::MutexLock lock(&mu_);
    return events_;
  }

  std::vector<v1::RankEvent> kinds() const {
    absl::MutexLock lock(&mu_);
    std::vector<v1::RankEvent> kinds;
    for (const RankReport& e : events_) kinds.push_back(e.kind);
    return kinds;
  }

 private:
  static bool IsEnd(v1::RankEvent kind) {
    return kind == v1::RANK_EVENT_SUCCEEDED || kind == v1::RANK_EVENT_FAILED ||
           kind == v1::RANK_EVENT_CANCELLED;
  }

  mutable absl::Mutex mu_;
  std::vector<RankReport> events_ ABSL_GUARDED_BY(mu_);
};

}  // namespace lathe::testing

#endif  // LATHE_TESTS_WORKER_AGENT_TEST_UTIL_H_
