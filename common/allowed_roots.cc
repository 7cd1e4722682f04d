#include "common/allowed_roots.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"

namespace lathe {
namespace {

namespace fs = std::filesystem;

absl::Status PathError(absl::string_view field, absl::string_view path, absl::string_view problem) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", path, ": ", problem));
}

// "<field>: <path> <problem>" when `part` is the whole path, else "<field>: <path>: <part>
// <problem>".
absl::Status PartError(absl::string_view field, const fs::path& path, const fs::path& part,
                       absl::string_view problem) {
  if (part == path) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", path.string(), " ", problem));
  }
  return PathError(field, path.string(), absl::StrCat(part.string(), " ", problem));
}

absl::Status Outside(absl::string_view field, absl::string_view path,
                     const std::vector<std::string>& roots) {
  return absl::InvalidArgumentError(absl::StrCat(
      field, ": ", path, " is outside the allowed roots (", absl::StrJoin(roots, ", "), ")"));
}

}  // namespace

bool IsInsideRoot(const std::string& path, const std::string& root) {
  const fs::path p(path), r(root);
  auto pi = p.begin();
  for (auto ri = r.begin(); ri != r.end(); ++ri, ++pi) {
    if (ri->empty()) continue;  // a trailing slash
    if (pi == p.end() || *pi != *ri) return false;
  }
  return true;
}

absl::StatusOr<std::string> CanonicalInRoots(const std::string& path,
                                             const std::vector<std::string>& roots,
                                             absl::string_view field) {
  if (!fs::path(path).is_absolute()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": must be an absolute path, got \"", path, "\""));
  }
  std::error_code error;
  std::string real = fs::weakly_canonical(path, error).string();
  if (error) return PathError(field, path, error.message());
  while (real.size() > 1 && real.back() == '/') real.pop_back();  // a trailing slash
  if (roots.empty()) return real;
  for (const std::string& root : roots) {
    const fs::path real_root = fs::weakly_canonical(root, error);
    if (!error && IsInsideRoot(real, real_root.string())) return real;
  }
  return Outside(field, path, roots);
}

absl::StatusOr<std::string> PinInRoots(const std::string& path,
                                       const std::vector<std::string>& roots, PinKind kind,
                                       absl::string_view field) {
  const fs::path normal = fs::path(path).lexically_normal();
  if (!normal.is_absolute()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": must be an absolute path, got \"", path, "\""));
  }
  // The root that holds it, as configured or resolved (the coordinator stored the path
  // with the links resolved; a root may itself be a link, which is the operator's to make).
  std::string root;
  for (const std::string& r : roots) {
    std::error_code error;
    for (const std::string& form :
         {fs::path(r).lexically_normal().string(), fs::canonical(r, error).string()}) {
      if (!form.empty() && IsInsideRoot(normal.string(), form) && form.size() > root.size()) {
        root = form;
      }
    }
  }
  if (root.empty()) return Outside(field, path, roots);
  int fd = open(root.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) {
    return absl::InternalError(
        absl::StrCat(field, ": cannot open the allowed root ", root, ": ", std::strerror(errno)));
  }
  const fs::path relative = normal.lexically_relative(root);
  std::vector<std::string> parts;
  for (const fs::path& part : relative) {
    if (!part.empty() && part != ".") parts.push_back(part.string());
  }
  fs::path reached(root);
  for (size_t i = 0; i < parts.size(); ++i) {
    const bool last = i + 1 == parts.size();
    reached /= parts[i];
    int next = openat(fd, parts[i].c_str(), O_PATH | O_NOFOLLOW | O_CLOEXEC);
    if (next < 0 && errno == ENOENT && kind == PinKind::kCreateDirectory) {
      if (mkdirat(fd, parts[i].c_str(), 0777) != 0 && errno != EEXIST) {
        const int mkdir_errno = errno;
        close(fd);
        return absl::InternalError(absl::StrCat(field, ": ", path, ": cannot create ",
                                                reached.string(), ": ",
                                                std::strerror(mkdir_errno)));
      }
      next = openat(fd, parts[i].c_str(), O_PATH | O_NOFOLLOW | O_CLOEXEC);
    }
    const int open_errno = errno;
    close(fd);
    if (next < 0) {
      if (open_errno == ENOENT) return PartError(field, normal, reached, "does not exist");
      return absl::InternalError(
          absl::StrCat(field, ": ", path, ": ", reached.string(), ": ", std::strerror(open_errno)));
    }
    fd = next;
    struct stat st;
    if (fstat(fd, &st) != 0) {
      close(fd);
      return absl::InternalError(absl::StrCat(field, ": ", path, ": ", std::strerror(errno)));
    }
    if (S_ISLNK(st.st_mode)) {
      close(fd);
      return PartError(field, normal, reached,
                       "is a symbolic link: below an allowed root the trainer follows none (the "
                       "path changed after the job was submitted?)");
    }
    if (!last && !S_ISDIR(st.st_mode)) {
      close(fd);
      return PartError(field, normal, reached, "is not a directory");
    }
  }
  struct stat st;
  if (fstat(fd, &st) != 0) {
    close(fd);
    return absl::InternalError(absl::StrCat(field, ": ", path, ": ", std::strerror(errno)));
  }
  const bool file = kind == PinKind::kFile;
  if (file ? !S_ISREG(st.st_mode) : !S_ISDIR(st.st_mode)) {
    close(fd);
    return PartError(field, normal, normal, file ? "is not a regular file" : "is not a directory");
  }
  return absl::StrCat("/proc/self/fd/", fd);
}

absl::StatusOr<std::string> PinnedPaths::Pin(const std::string& path,
                                             const std::vector<std::string>& roots, PinKind kind,
                                             absl::string_view field) {
  absl::StatusOr<std::string> pinned = PinInRoots(path, roots, kind, field);
  if (!pinned.ok()) return pinned;
  pins_.emplace_back(*pinned, path);
  // "/proc/self/fd/12" before "/proc/self/fd/1", which is a prefix of it.
  std::sort(pins_.begin(), pins_.end(),
            [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
  return pinned;
}

std::string PinnedPaths::Original(absl::string_view text) const {
  std::string out(text);
  for (const auto& [pinned, original] : pins_) out = absl::StrReplaceAll(out, {{pinned, original}});
  return out;
}

}  // namespace lathe
