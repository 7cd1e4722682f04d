#include "worker/agent/attempt_dir_pruner.h"

#include <sys/stat.h>

#include <filesystem>
#include <optional>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

namespace lathe {
namespace {

bool IsSafeFileName(absl::string_view name) {
  if (name.empty() || name == "." || name == "..") return false;
  for (char c : name) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_' && c != '.') {
      return false;
    }
  }
  return true;
}

// Strips "<marker><digits>" from the end of `*name`; false when it does not end so.
bool StripNumberSuffix(absl::string_view* name, absl::string_view marker) {
  size_t digits = 0;
  while (digits < name->size() &&
         absl::ascii_isdigit(static_cast<unsigned char>((*name)[name->size() - 1 - digits]))) {
    ++digits;
  }
  if (digits == 0 || digits > 18) return false;
  absl::string_view rest = name->substr(0, name->size() - digits);
  if (rest.size() < marker.size() || rest.substr(rest.size() - marker.size()) != marker) {
    return false;
  }
  *name = rest.substr(0, rest.size() - marker.size());
  return true;
}

// The modification time of `path` itself (a link's own); nullopt when it cannot be read.
std::optional<absl::Time> ModifiedAt(const std::string& path, bool* is_directory = nullptr) {
  struct stat st;
  if (lstat(path.c_str(), &st) != 0) return std::nullopt;
  if (is_directory != nullptr) *is_directory = S_ISDIR(st.st_mode);
  return absl::TimeFromTimespec(st.st_mtim);
}

}  // namespace

AttemptDirPruner::AttemptDirPruner(std::string work_dir, absl::Duration keep, const Clock* clock)
    : work_dir_(std::move(work_dir)), keep_(keep), clock_(clock) {}

std::string AttemptDirPruner::DirName(absl::string_view job_id, int64_t generation, int64_t rank) {
  return absl::StrCat(job_id, "-g", generation, "-r", rank);
}

bool AttemptDirPruner::IsAttemptDirName(absl::string_view name) {
  return StripNumberSuffix(&name, "-r") && StripNumberSuffix(&name, "-g") && IsSafeFileName(name);
}

void AttemptDirPruner::Ended(const std::string& name, Released released) {
  if (!IsAttemptDirName(name)) return;
  Attempt& attempt = ended_[name];
  attempt.released = std::move(released);
  attempt.is_released = false;
}

int AttemptDirPruner::Prune(const InUse& in_use) {
  const absl::Time now = clock_->Now();
  int removed = 0;
  for (auto it = ended_.begin(); it != ended_.end();) {
    Attempt& attempt = it->second;
    if (!attempt.is_released && (attempt.released == nullptr || attempt.released())) {
      attempt.is_released = true;
      attempt.since = now;
    }
    if (!attempt.is_released || now - attempt.since < keep_ || in_use(it->first)) {
      ++it;
      continue;
    }
    if (Remove(it->first, absl::StrCat("finished ", absl::FormatDuration(now - attempt.since),
                                       " ago, its log shipped"))) {
      ++removed;
    }
    it = ended_.erase(it);  // a folder that cannot be removed is left to the next start
  }
  return removed;
}

int AttemptDirPruner::SweepLeftovers(const InUse& in_use) {
  const absl::Time now = clock_->Now();
  std::vector<std::string> names;
  std::error_code error;
  for (std::filesystem::directory_iterator it(work_dir_, error), end; !error && it != end;
       it.increment(error)) {
    names.push_back(it->path().filename().string());
  }
  if (error) {
    spdlog::warn("listing work directory {}: {}", work_dir_, error.message());
  }
  int removed = 0;
  for (const std::string& name : names) {
    if (!IsAttemptDirName(name) || ended_.count(name) > 0 || in_use(name)) continue;
    const std::string path = absl::StrCat(work_dir_, "/", name);
    bool is_directory = false;
    std::optional<absl::Time> newest = ModifiedAt(path, &is_directory);
    if (!newest || !is_directory) continue;
    std::error_code list_error;
    for (std::filesystem::directory_iterator it(path, list_error), end; !list_error && it != end;
         it.increment(list_error)) {
      std::optional<absl::Time> modified = ModifiedAt(it->path().string());
      if (modified && *modified > *newest) newest = modified;
    }
    if (list_error || now - *newest < keep_) continue;
    if (Remove(name, absl::StrCat(
                         "left by an earlier run, last written ",
                         absl::FormatDuration(absl::Seconds(absl::ToInt64Seconds(now - *newest))),
                         " ago"))) {
      ++removed;
    }
  }
  return removed;
}

bool AttemptDirPruner::Remove(const std::string& name, const std::string& why) {
  const std::string path = absl::StrCat(work_dir_, "/", name);
  bool is_directory = false;
  // Already gone, or a link or a file (not a folder the agent made): nothing to do.
  if (!ModifiedAt(path, &is_directory) || !is_directory) return false;
  std::error_code error;
  std::filesystem::remove_all(path, error);
  if (error) {
    spdlog::warn("removing attempt folder {}: {}", path, error.message());
    return false;
  }
  spdlog::info("removed attempt folder {} ({})", path, why);
  return true;
}

}  // namespace lathe
