#include "common/http/build_info.h"

#include "common/http/metric_families.h"
#include "lathe_build_info_values.h"  // generated at configure time (CMakeLists.txt)

namespace lathe {

const BuildInfo& ThisBuild() {
  static const BuildInfo* const kBuild =
      new BuildInfo{kLatheVersion, kLatheGitCommit, kLatheBuildType};
  return *kBuild;
}

prometheus::MetricFamily BuildInfoFamily(const std::string& daemon) {
  const BuildInfo& build = ThisBuild();
  prometheus::MetricFamily family =
      MakeFamily("lathe_build_info",
                 "1, labelled with the build that serves this: its version (git describe), "
                 "commit and build type, and which daemon it is.",
                 prometheus::MetricType::Gauge);
  AddSample(family,
            {{"build_type", build.build_type},
             {"daemon", daemon},
             {"git_commit", build.git_commit},
             {"version", build.version}},
            1);
  return family;
}

}  // namespace lathe
