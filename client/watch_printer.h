// Renders the stream of JobStatus updates of `lathe watch` in one of three forms:
//
//   kProgressBar (stdout is a terminal): a single line redrawn in place with '\r',
//       [#######.............] step 35/100  loss 3.2110  1234 tok/s  ETA 1m05s
//     with state changes (queued, started, restarted, finished) on lines of their own.
//   kLines (stdout is a file or pipe): one line per update,
//       2026-01-02T03:04:05Z RUNNING step 12/100 loss 3.2110 tokens/s 1234
//   kJson: one job object (client/job_json.h, docs/cli-json.md) per line.
//
// The bar's ETA is EtaSeconds (client/status_text.h): the steps left times the trainer's mean
// step time, the same number as the JSON job object's eta_seconds.
//
// Thread-safety: not thread-safe; one printer per watch.
#ifndef LATHE_CLIENT_WATCH_PRINTER_H_
#define LATHE_CLIENT_WATCH_PRINTER_H_

#include <cstddef>
#include <cstdint>
#include <ostream>
#include <string>

#include "absl/time/time.h"
#include "lathe/v1/job.pb.h"

namespace lathe {

enum class WatchFormat { kProgressBar, kLines, kJson };

class WatchPrinter {
 public:
  // `out` must outlive the printer.
  WatchPrinter(std::ostream& out, WatchFormat format) : out_(out), format_(format) {}

  WatchPrinter(const WatchPrinter&) = delete;
  WatchPrinter& operator=(const WatchPrinter&) = delete;

  // Prints one update. `now` stamps lines whose status carries no updated_unix_ms.
  void Update(const v1::JobStatus& status, absl::Time now);

  // Ends a progress bar that is still on screen with a newline. Idempotent.
  void Finish();

  // The one-line summary of `status` used by kLines and for state changes:
  // "<timestamp> <STATE> <details>", without a newline.
  static std::string StatusLine(const v1::JobStatus& status, absl::Time now);

  // The progress bar line for `status` (without '\r' or newline), ending in its EtaSeconds
  // ("ETA --" when unknown).
  static std::string ProgressBar(const v1::JobStatus& status);

 private:
  // Writes `line` over the bar on screen (or over nothing), padding with spaces to erase
  // what was longer.
  void DrawBar(const std::string& line);
  // Clears the bar from the screen so that a full line can take its place.
  void ClearBar();

  std::ostream& out_;
  const WatchFormat format_;

  // What the previous update showed, to notice state changes.
  bool have_previous_ = false;
  v1::JobState previous_state_ = v1::JOB_STATE_UNSPECIFIED;
  int64_t previous_generation_ = 0;
  std::string previous_reason_;
  std::string previous_line_;  // kLines: the last line printed, without its timestamp

  // Width of the bar currently on screen; 0 when none.
  size_t bar_width_ = 0;
};

}  // namespace lathe

#endif  // LATHE_CLIENT_WATCH_PRINTER_H_
