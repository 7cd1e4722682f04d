// One HTTP port (civetweb) for what an operator's tools poll, in both daemons:
//   /metrics  Prometheus' text format of the given prometheus-cpp collectables
//   /healthz  200 "ok" while the process serves at all (a liveness probe)
//   /readyz   200 "ready" when `ready` says so, else 503 with its reason (a readiness probe)
// Only GET; anything else is civetweb's 404 or 405. Up to 256 connections are served at once,
// each for one request whose head must arrive within 2 s, so that connections that stall
// cannot keep the probes from answering (issue #27).
//
// Thread-safety: thread-safe; the collectables and `ready` are called from civetweb's
// threads.
#ifndef LATHE_COMMON_HTTP_HTTP_ENDPOINTS_H_
#define LATHE_COMMON_HTTP_HTTP_ENDPOINTS_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace prometheus {
class Collectable;
}  // namespace prometheus

namespace lathe {

struct HttpEndpointsOptions {
  std::string listen;  // "host:port"; port 0 picks one
  std::vector<std::weak_ptr<prometheus::Collectable>> collectables;
  std::function<absl::Status()> ready;  // OK: ready; null: always ready
};

class HttpEndpoints {
 public:
  // The most connections the port holds open at once, for a daemon's count of its file
  // descriptors: one per thread, those accepted that wait for a thread, and one being
  // accepted (more wait in the kernel's queue, which takes none).
  static constexpr int kMaxConnections = 277;

  // UNAVAILABLE naming `flag` and the address when it cannot be bound.
  static absl::StatusOr<std::unique_ptr<HttpEndpoints>> Start(HttpEndpointsOptions options,
                                                              const std::string& flag);
  // Stops serving (waits for requests in flight).
  ~HttpEndpoints();

  int port() const { return port_; }

 private:
  class Impl;
  HttpEndpoints() = default;

  std::unique_ptr<Impl> impl_;
  int port_ = 0;
};

}  // namespace lathe

#endif  // LATHE_COMMON_HTTP_HTTP_ENDPOINTS_H_
