#include "client/watch_printer.h"

#include <algorithm>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/job_json.h"
#include "client/status_text.h"

namespace lathe {
namespace {

constexpr int kBarCells = 20;

int64_t Generation(const v1::JobStatus& status) {
  return status.attempts().empty() ? 0 : status.attempts().rbegin()->generation();
}

}  // namespace

std::string WatchPrinter::StatusLine(const v1::JobStatus& status, absl::Time now) {
  const int64_t stamp =
      status.updated_unix_ms() > 0 ? status.updated_unix_ms() : absl::ToUnixMillis(now);
  std::string line = absl::StrCat(FormatTimestamp(stamp), " ", JobStateName(status.state()));
  const v1::Progress* p = LatestProgress(status);
  switch (status.state()) {
    case v1::JOB_STATE_RUNNING:
      if (p != nullptr) {
        absl::StrAppend(&line, " step ", StepText(status));
        if (p->has_loss()) absl::StrAppend(&line, absl::StrFormat(" loss %.4f", p->loss()));
        if (p->tokens_per_second() > 0) {
          absl::StrAppend(&line, absl::StrFormat(" tokens/s %.0f", p->tokens_per_second()));
        }
      } else if (!status.attempts().empty() &&
                 status.attempts().rbegin()->state() != v1::ATTEMPT_STATE_RUNNING) {
        // "RUNNING STARTING"; never "RUNNING RUNNING".
        absl::StrAppend(&line, " ", AttemptStateName(status.attempts().rbegin()->state()));
      }
      if (Generation(status) > 1) absl::StrAppend(&line, " attempt ", Generation(status));
      break;
    case v1::JOB_STATE_SUCCEEDED:
      if (status.has_final_loss()) {
        absl::StrAppend(&line, absl::StrFormat(" final loss %.4f", status.final_loss()));
      }
      if (!status.adapter_path().empty())
        absl::StrAppend(&line, " adapter ", status.adapter_path());
      if (!status.model_path().empty()) absl::StrAppend(&line, " model ", status.model_path());
      break;
    default:
      break;
  }
  if (!status.reason().empty() && status.state() != v1::JOB_STATE_RUNNING) {
    absl::StrAppend(&line, ": ", Truncate(status.reason(), 500));
  }
  return line;
}

std::string WatchPrinter::ProgressBar(const v1::JobStatus& status) {
  const v1::Progress* p = LatestProgress(status);
  const int64_t total = TotalSteps(status);
  const int64_t step = p != nullptr ? p->step() : 0;
  int filled = 0;
  if (total > 0) {
    filled = static_cast<int>(std::clamp<int64_t>(step * kBarCells / total, 0, kBarCells));
  }
  std::string line =
      absl::StrCat("[", std::string(filled, '#'), std::string(kBarCells - filled, '.'), "] step ",
                   StepText(status));
  if (p != nullptr && p->has_loss())
    absl::StrAppend(&line, absl::StrFormat("  loss %.4f", p->loss()));
  if (p != nullptr && p->tokens_per_second() > 0) {
    absl::StrAppend(&line, absl::StrFormat("  %.0f tok/s", p->tokens_per_second()));
  }
  const std::optional<double> eta = EtaSeconds(status);
  absl::StrAppend(&line, "  ETA ", eta.has_value() ? ShortDuration(absl::Seconds(*eta)) : "--");
  return line;
}

void WatchPrinter::DrawBar(const std::string& line) {
  out_ << '\r' << line;
  if (line.size() < bar_width_) out_ << std::string(bar_width_ - line.size(), ' ');
  out_.flush();
  bar_width_ = line.size();
}

void WatchPrinter::ClearBar() {
  if (bar_width_ == 0) return;
  out_ << '\r' << std::string(bar_width_, ' ') << '\r';
  bar_width_ = 0;
}

void WatchPrinter::Update(const v1::JobStatus& status, absl::Time now) {
  switch (format_) {
    case WatchFormat::kJson:
      out_ << JsonLine(JobJson(status)) << "\n";
      out_.flush();
      return;
    case WatchFormat::kLines: {
      // An update that changes nothing the line shows (a heartbeat's, the status after the
      // last step) is not printed again: the line without its timestamp is compared.
      const std::string line = StatusLine(status, now);
      const std::string shown = line.substr(std::min(line.find(' '), line.size()));
      if (have_previous_ && shown == previous_line_) return;
      have_previous_ = true;
      previous_line_ = shown;
      out_ << line << "\n";
      out_.flush();
      return;
    }
    case WatchFormat::kProgressBar:
      break;
  }
  // A reason only matters outside RUNNING (why queued, why it ended).
  const bool changed =
      !have_previous_ || status.state() != previous_state_ ||
      Generation(status) != previous_generation_ ||
      (status.state() != v1::JOB_STATE_RUNNING && status.reason() != previous_reason_);
  have_previous_ = true;
  previous_state_ = status.state();
  previous_generation_ = Generation(status);
  previous_reason_ = status.reason();

  const bool show_bar =
      status.state() == v1::JOB_STATE_RUNNING && LatestProgress(status) != nullptr;
  if (changed) {
    if (IsFinalState(status.state()) && bar_width_ > 0) {
      // Leave the last bar on screen as a record of how far the job got.
      out_ << "\n";
      bar_width_ = 0;
    } else {
      ClearBar();
    }
    out_ << StatusLine(status, now) << "\n";
  }
  if (show_bar) DrawBar(ProgressBar(status));
  out_.flush();
}

void WatchPrinter::Finish() {
  if (bar_width_ == 0) return;
  out_ << "\n";
  out_.flush();
  bar_width_ = 0;
}

}  // namespace lathe
