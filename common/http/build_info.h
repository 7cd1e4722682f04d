// lathe_build_info: a gauge of 1 whose labels say which build serves /metrics (both daemons
// export it; docs/observability.md). The values are taken when CMake configures the build
// (common/http/CMakeLists.txt): `git describe --tags --always --dirty` and the commit of the
// source tree, "unknown" where there is no git checkout (a source tarball).
#ifndef LATHE_COMMON_HTTP_BUILD_INFO_H_
#define LATHE_COMMON_HTTP_BUILD_INFO_H_

#include <string>

#include "prometheus/metric_family.h"

namespace lathe {

struct BuildInfo {
  std::string version;     // git describe --tags --always --dirty; "unknown" without git
  std::string git_commit;  // the full commit hash; "unknown" without git
  std::string build_type;  // CMAKE_BUILD_TYPE: Release, Debug, RelWithDebInfo, ...
};

// This binary's.
const BuildInfo& ThisBuild();

// lathe_build_info{version, git_commit, build_type, daemon} 1.
prometheus::MetricFamily BuildInfoFamily(const std::string& daemon);

}  // namespace lathe

#endif  // LATHE_COMMON_HTTP_BUILD_INFO_H_
