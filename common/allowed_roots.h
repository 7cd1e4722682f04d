// Paths confined to the allowed roots (`--allowed-roots`; issue #27, docs/services.md
// "Paths"). A spec's paths are checked twice: by the coordinator at submission, which stores
// their canonical form (symbolic links resolved), and by the trainer at its start, which
// opens each one again below its root without following any link. A link swapped in
// between (an output directory replaced by a link out of the roots while the job waits) is
// then refused instead of followed.
//
// Thread-safety: free functions; PinInRoots leaves file descriptors open for the process's
// lifetime (the returned paths go through them).
#ifndef LATHE_COMMON_ALLOWED_ROOTS_H_
#define LATHE_COMMON_ALLOWED_ROOTS_H_

#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace lathe {

// Whether `path` is `root` or lies below it, component by component (both lexically
// normal, absolute).
bool IsInsideRoot(const std::string& path, const std::string& root);

// The canonical form of the absolute `path`: symbolic links resolved as far as it exists,
// "." and ".." gone. With `roots` (none: anywhere), INVALID_ARGUMENT "<field>: <path> is
// outside the allowed roots (...)" unless that form lies in one of the roots' own canonical
// forms; "<field>: must be an absolute path" for a relative one.
absl::StatusOr<std::string> CanonicalInRoots(const std::string& path,
                                             const std::vector<std::string>& roots,
                                             absl::string_view field);

enum class PinKind {
  kFile,             // an existing regular file
  kDirectory,        // an existing directory
  kCreateDirectory,  // a directory, made (with its missing parents below the root) if absent
};

// Opens `path` (absolute, lexically inside one of `roots`) from a descriptor of that root,
// one component at a time with O_NOFOLLOW, and returns "/proc/self/fd/<n>": a path that
// names what was opened and checked for as long as the process lives, whatever is renamed
// or linked along the original path later. INVALID_ARGUMENT "<field>: <path>: ..." naming
// the component that is a symbolic link, missing, or of the wrong kind, or when no root
// contains the path; INTERNAL for other errors.
absl::StatusOr<std::string> PinInRoots(const std::string& path,
                                       const std::vector<std::string>& roots, PinKind kind,
                                       absl::string_view field);

// The paths one process pinned, and what each stands for: what it shows or records (a
// message, a reported path, a checkpoint's fingerprint, an adapter's base model) names the
// spec's path, never "/proc/self/fd/<n>".
class PinnedPaths {
 public:
  // PinInRoots, remembered.
  absl::StatusOr<std::string> Pin(const std::string& path, const std::vector<std::string>& roots,
                                  PinKind kind, absl::string_view field);
  // `text` with every pinned path in it replaced by the path it stands for.
  std::string Original(absl::string_view text) const;

 private:
  std::vector<std::pair<std::string, std::string>> pins_;  // longest pinned path first
};

}  // namespace lathe

#endif  // LATHE_COMMON_ALLOWED_ROOTS_H_
