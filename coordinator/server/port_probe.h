// Whether a gRPC port serves: a standard health check (grpc.health.v1.Health/Check, which
// needs no token) over a connection of its own, within a short deadline. The coordinator's
// /readyz asks it of the coordinator's own port, so that ready means that the port takes
// connections and answers calls, not only that the process runs (issue #27: a port that
// had stopped accepting stayed "ready"). An answer is kept for a while, so that frequent
// probes cost one connection per period.
//
// Thread-safety: thread-safe; callers that come while a check runs wait for its answer.
#ifndef LATHE_COORDINATOR_SERVER_PORT_PROBE_H_
#define LATHE_COORDINATOR_SERVER_PORT_PROBE_H_

#include <functional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace lathe {

struct PortProbeOptions {
  std::string target;  // "127.0.0.1:7070"
  // Empty: plaintext. Else TLS, with these PEM certificates (the server's own) as the roots,
  // unverified: the probe learns only whether the port answers, and sends nothing secret.
  std::string tls_roots;
  absl::Duration deadline = absl::Seconds(1);
  absl::Duration keep_answer = absl::Seconds(2);
  // Said after a failed check's reason (what the listener knows about refused connections).
  std::function<std::string()> explain;
};

class PortProbe {
 public:
  explicit PortProbe(PortProbeOptions options) : options_(std::move(options)) {}

  // OK when the health check answered SERVING within the deadline; else UNAVAILABLE naming
  // the target and what went wrong. At most one check per keep_answer.
  absl::Status Check();

 private:
  absl::Status CheckNow() const;

  const PortProbeOptions options_;
  absl::Mutex mu_;
  absl::Time checked_at_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  absl::Status answer_ ABSL_GUARDED_BY(mu_);
};

}  // namespace lathe

#endif  // LATHE_COORDINATOR_SERVER_PORT_PROBE_H_
