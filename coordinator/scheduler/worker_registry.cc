#include "coordinator/scheduler/worker_registry.h"

#include <algorithm>

#include "absl/random/random.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace lathe {
namespace {

// Whether two heartbeats list the same ranks.
bool SameRanks(const std::vector<v1::SlotStatus>& before,
               const google::protobuf::RepeatedPtrField<v1::SlotStatus>& now) {
  if (before.size() != static_cast<size_t>(now.size())) return false;
  for (size_t i = 0; i < before.size(); ++i) {
    const v1::SlotStatus& a = before[i];
    const v1::SlotStatus& b = now[static_cast<int>(i)];
    if (a.slot() != b.slot() || a.job_id() != b.job_id() || a.generation() != b.generation() ||
        a.rank() != b.rank()) {
      return false;
    }
  }
  return true;
}

}  // namespace

absl::Status WorkerRegistry::CheckRegistration(const v1::RegisterWorkerRequest& request) {
  const std::string& id = request.worker_id();
  if (id.empty() || id.size() > kMaxWorkerIdBytes || !std::all_of(id.begin(), id.end(), [](char c) {
        return absl::ascii_isalnum(c) || c == '.' || c == '_' || c == '-';
      })) {
    return absl::InvalidArgumentError(absl::StrCat("worker_id: must be 1 to ", kMaxWorkerIdBytes,
                                                   " characters from A-Z a-z 0-9 . _ -"));
  }
  if (request.slots() < 1 || request.slots() > kMaxSlots) {
    return absl::InvalidArgumentError(
        absl::StrCat("slots: must be 1 to ", kMaxSlots, ", got ", request.slots()));
  }
  if (request.devices_size() > kMaxSlots) {
    return absl::InvalidArgumentError(
        absl::StrCat("devices: at most ", kMaxSlots, ", got ", request.devices_size()));
  }
  bool short_fields = request.address().size() <= kMaxShortFieldBytes &&
                      request.version().size() <= kMaxShortFieldBytes;
  for (const v1::DeviceInfo& d : request.devices()) {
    short_fields = short_fields && d.name().size() <= kMaxShortFieldBytes;
  }
  if (!short_fields) {
    return absl::InvalidArgumentError(absl::StrCat("address, version and device names: at most ",
                                                   kMaxShortFieldBytes, " bytes each"));
  }
  return absl::OkStatus();
}

// --- sessions and liveness ------------------------------------------------------------

void WorkerRegistry::Restore(const std::string& worker_id, bool live) {
  absl::MutexLock lock(&mu_);
  Mailbox& mailbox = mail_[worker_id];
  mailbox.live = live;
  mailbox.last_heartbeat = clock_->Now();  // a grace period to register again
}

absl::StatusOr<std::string> WorkerRegistry::Open(const std::string& worker_id) {
  absl::MutexLock lock(&mu_);
  const absl::Time now = clock_->Now();
  auto it = mail_.find(worker_id);
  // Another agent under a live session's worker id (issue #27): its heartbeats still arrive
  // on an open stream within the timeout. Taking the id over would fail that agent's
  // attempts, and the two would take it from each other in turn. An agent that died has
  // closed its stream (or stopped its heartbeats), so a restarted one gets in.
  if (it != mail_.end() && it->second.live && !it->second.session_id.empty() &&
      !it->second.listener.expired()) {
    const absl::Duration silence = now - it->second.last_heartbeat;
    if (silence <= heartbeat_timeout_) {
      return absl::AlreadyExistsError(absl::StrCat(
          "worker ", worker_id,
          " is registered by a live agent (its heartbeat stream is open, the last heartbeat ",
          absl::StrFormat("%.1fs", absl::ToDoubleSeconds(silence)),
          " ago): give this agent another --worker-id, or stop the other"));
    }
  }
  Mailbox& mailbox = mail_[worker_id];
  mailbox.session_id = absl::StrFormat("%s/%d/%016x", worker_id, ++next_session_,
                                       absl::Uniform<uint64_t>(absl::BitGen()));
  mailbox.live = true;
  mailbox.last_heartbeat = now;
  mailbox.last_heartbeat_unix_ms = absl::ToUnixMillis(now);
  mailbox.running.clear();
  mailbox.listener.reset();  // the new session's stream opens with its first heartbeat
  mailbox.reconcile = true;
  mailbox.reconciling = true;
  mailbox.delivered.clear();
  return mailbox.session_id;
}

void WorkerRegistry::TakeDeliverable(Mailbox& mailbox, uint64_t durable,
                                     v1::HeartbeatResponse* response) {
  auto& pending = mailbox.assignments;
  auto kept = pending.begin();
  for (auto& a : pending) {
    if (a.first <= durable) {
      if (mailbox.reconciling) {
        mailbox.delivered.emplace_back(a.second.job_id(), a.second.generation());
      }
      *response->add_assignments() = std::move(a.second);
    } else {
      *kept++ = std::move(a);
    }
  }
  pending.erase(kept, pending.end());
  for (v1::Cancellation& c : mailbox.cancellations) *response->add_cancellations() = std::move(c);
  mailbox.cancellations.clear();
  for (v1::ProfileOrder& order : mailbox.profiles) *response->add_profiles() = std::move(order);
  mailbox.profiles.clear();
}

absl::StatusOr<v1::HeartbeatResponse> WorkerRegistry::Heartbeat(
    const v1::HeartbeatRequest& request, std::shared_ptr<MailListener> listener, uint64_t durable,
    bool* reported) {
  *reported = false;
  if (request.slots_size() > kMaxSlots) {
    return absl::InvalidArgumentError(
        absl::StrCat("slots: at most ", kMaxSlots, ", got ", request.slots_size()));
  }
  v1::HeartbeatResponse response;
  response.set_in_reply_to(request.sequence());
  absl::MutexLock lock(&mu_);
  auto it = mail_.find(request.worker_id());
  if (it == mail_.end() || it->second.session_id.empty() ||
      it->second.session_id != request.session_id()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "worker ", request.worker_id(), ": unknown or expired session; register again"));
  }
  Mailbox& mailbox = it->second;
  heartbeats_.fetch_add(1, std::memory_order_relaxed);
  const absl::Time now = clock_->Now();
  mailbox.last_heartbeat = now;
  mailbox.last_heartbeat_unix_ms = absl::ToUnixMillis(now);
  if (listener != nullptr) mailbox.listener = listener;
  const bool changed = !SameRanks(mailbox.running, request.slots());
  if (changed) mailbox.running.assign(request.slots().begin(), request.slots().end());
  // The scheduler looks at what the worker runs when it changed, after a registration, and
  // now and then while it runs something (a cancellation may have been lost).
  const bool report = changed || mailbox.reconcile ||
                      (!mailbox.running.empty() && now - mailbox.last_report > heartbeat_timeout_);
  TakeDeliverable(mailbox, durable, &response);
  if (report) {
    reports_.push_back(
        {request.worker_id(), mailbox.session_id, mailbox.running, mailbox.reconcile});
    mailbox.reconcile = false;
    mailbox.last_report = now;
    *reported = true;
  }
  return response;
}

std::vector<WorkerRegistry::Report> WorkerRegistry::TakeReports() {
  std::vector<Report> reports;
  absl::MutexLock lock(&mu_);
  reports.swap(reports_);
  return reports;
}

std::vector<std::pair<std::string, absl::Duration>> WorkerRegistry::Silent() const {
  const absl::Time now = clock_->Now();
  std::vector<std::pair<std::string, absl::Duration>> silent;
  absl::MutexLock lock(&mu_);
  for (const auto& [id, mailbox] : mail_) {
    if (mailbox.live && now - mailbox.last_heartbeat > heartbeat_timeout_) {
      silent.emplace_back(id, now - mailbox.last_heartbeat);
    }
  }
  return silent;
}

void WorkerRegistry::Lose(const std::string& worker_id) {
  absl::MutexLock lock(&mu_);
  Mailbox& mailbox = mail_[worker_id];
  mailbox.session_id.clear();
  mailbox.live = false;
  mailbox.running.clear();
  mailbox.assignments.clear();
  mailbox.cancellations.clear();
  mailbox.profiles.clear();
}

int64_t WorkerRegistry::RenewWindows() {
  const absl::Time now = clock_->Now();
  int64_t renewed = 0;
  absl::MutexLock lock(&mu_);
  for (auto& [id, mailbox] : mail_) {
    if (!mailbox.live) continue;
    mailbox.last_heartbeat = std::max(mailbox.last_heartbeat, now);
    ++renewed;
  }
  return renewed;
}

void WorkerRegistry::Remove(const std::string& worker_id) {
  absl::MutexLock lock(&mu_);
  mail_.erase(worker_id);
  waiting_.erase(worker_id);
}

void WorkerRegistry::Describe(std::vector<v1::WorkerStatus>& workers) const {
  absl::MutexLock lock(&mu_);
  for (v1::WorkerStatus& status : workers) {
    auto mailbox = mail_.find(status.worker_id());
    if (mailbox == mail_.end() || mailbox->second.session_id.empty()) continue;
    for (const v1::SlotStatus& slot : mailbox->second.running) {
      if (!slot.job_id().empty()) *status.add_running() = slot;
    }
    status.set_last_heartbeat_unix_ms(mailbox->second.last_heartbeat_unix_ms);
  }
}

// --- mailboxes ------------------------------------------------------------------------

void WorkerRegistry::Post(const std::string& worker_id, uint64_t batch,
                          std::vector<v1::Assignment> assignments) {
  absl::MutexLock lock(&mu_);
  Mailbox& mailbox = mail_[worker_id];
  for (v1::Assignment& a : assignments) mailbox.assignments.emplace_back(batch, std::move(a));
  waiting_.insert(worker_id);
}

void WorkerRegistry::PostProfile(const std::string& worker_id, v1::ProfileOrder order) {
  absl::MutexLock lock(&mu_);
  mail_[worker_id].profiles.push_back(std::move(order));
  waiting_.insert(worker_id);
}

bool WorkerRegistry::WithdrawOrCancel(const std::string& worker_id, const std::string& job_id,
                                      int64_t generation, int64_t rank, const std::string& reason) {
  absl::MutexLock lock(&mu_);
  Mailbox& mailbox = mail_[worker_id];
  auto& pending = mailbox.assignments;
  auto it = std::find_if(pending.begin(), pending.end(), [&](const auto& a) {
    return a.second.job_id() == job_id && a.second.generation() == generation &&
           a.second.rank() == rank;
  });
  if (it != pending.end()) {
    pending.erase(it);
    return true;
  }
  v1::Cancellation& c = mailbox.cancellations.emplace_back();
  c.set_job_id(job_id);
  c.set_generation(generation);
  c.set_reason(reason);
  waiting_.insert(worker_id);
  return false;
}

void WorkerRegistry::CancelUnlessPending(const std::string& worker_id,
                                         const std::vector<AttemptRef>& attempts,
                                         const std::string& reason) {
  if (attempts.empty()) return;
  absl::MutexLock lock(&mu_);
  Mailbox& mailbox = mail_[worker_id];
  for (const AttemptRef& attempt : attempts) {
    const bool pending = std::any_of(
        mailbox.cancellations.begin(), mailbox.cancellations.end(), [&](const v1::Cancellation& c) {
          return c.job_id() == attempt.first && c.generation() == attempt.second;
        });
    if (pending) continue;
    v1::Cancellation& c = mailbox.cancellations.emplace_back();
    c.set_job_id(attempt.first);
    c.set_generation(attempt.second);
    c.set_reason(reason);
    waiting_.insert(worker_id);
  }
}

std::vector<WorkerRegistry::AttemptRef> WorkerRegistry::Reconcile(
    const std::string& worker_id, const std::vector<AttemptRef>& placed) {
  std::vector<AttemptRef> lost;
  absl::MutexLock lock(&mu_);
  Mailbox& mailbox = mail_[worker_id];
  for (const AttemptRef& ref : placed) {
    const bool delivered = std::find(mailbox.delivered.begin(), mailbox.delivered.end(), ref) !=
                           mailbox.delivered.end();
    const bool pending =
        std::any_of(mailbox.assignments.begin(), mailbox.assignments.end(), [&](const auto& a) {
          return a.second.job_id() == ref.first && a.second.generation() == ref.second;
        });
    if (!delivered && !pending) lost.push_back(ref);
  }
  mailbox.reconciling = false;
  mailbox.delivered.clear();
  return lost;
}

v1::HeartbeatResponse WorkerRegistry::TakeMail(absl::string_view worker_id,
                                               absl::string_view session_id, uint64_t durable) {
  v1::HeartbeatResponse response;
  absl::MutexLock lock(&mu_);
  auto it = mail_.find(worker_id);
  if (it == mail_.end() || it->second.session_id.empty() || it->second.session_id != session_id) {
    return response;
  }
  TakeDeliverable(it->second, durable, &response);
  return response;
}

std::set<std::string> WorkerRegistry::TakeWaiting() {
  std::set<std::string> waiting;
  absl::MutexLock lock(&mu_);
  waiting.swap(waiting_);
  return waiting;
}

void WorkerRegistry::Notify(const std::set<std::string>& workers) {
  std::vector<std::shared_ptr<MailListener>> listeners;
  {
    absl::MutexLock lock(&mu_);
    for (const std::string& id : workers) {
      auto mailbox = mail_.find(id);
      if (mailbox == mail_.end()) continue;
      if (std::shared_ptr<MailListener> listener = mailbox->second.listener.lock()) {
        listeners.push_back(std::move(listener));
      }
    }
  }
  for (const std::shared_ptr<MailListener>& listener : listeners) listener->OnMail();
}

}  // namespace lathe
