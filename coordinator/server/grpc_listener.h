// The coordinator's gRPC port: a listening socket of its own, whose connections it accepts
// and hands to gRPC (ServerBuilder's external connection acceptor) in place of gRPC's own
// listener. gRPC 1.51's listener stops accepting for good after one failed accept4, such as
// EMFILE when the process is out of file descriptors: 400 idle connections against a limit
// of 256 left the port dead while the process, and its /readyz, went on (issue #27). This
// one never stops. It accepts a connection only while that leaves `reserved_fds` descriptors
// free for the rest of the process (the store, the ranks' logs, the HTTP port) and closes
// it at once otherwise; out of descriptors all the same, it takes the waiting connection
// with one it keeps in reserve and closes it, so that the next can be taken once
// descriptors are free again.
//
// Thread-safety: Start and Stop must not run at once; the const methods from any thread.
#ifndef LATHE_COORDINATOR_SERVER_GRPC_LISTENER_H_
#define LATHE_COORDINATOR_SERVER_GRPC_LISTENER_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/server_builder.h"

namespace lathe {

class GrpcListener {
 public:
  // Listens on `address` ("host:port" or "[v6]:port"; port 0 picks one; a host name on every
  // address it resolves to; 0.0.0.0 and [::] on every address, IPv6 and IPv4, as gRPC
  // does), without SO_REUSEPORT. UNAVAILABLE "cannot listen on ADDRESS: why".
  static absl::StatusOr<std::unique_ptr<GrpcListener>> Bind(const std::string& address,
                                                            int reserved_fds);
  // Stops.
  ~GrpcListener();

  int port() const { return port_; }
  // An address of this port that a client on this host reaches ("127.0.0.1:7070" for
  // 0.0.0.0:7070).
  const std::string& local_target() const { return local_target_; }

  // Accepts in a thread of its own until Stop, handing every connection to `acceptor`
  // (which must outlive Stop; call it after the server started, and Stop before the server
  // shuts down).
  void Start(grpc::experimental::ExternalConnectionAcceptor* acceptor);
  // Stops accepting and closes the listening sockets. Idempotent.
  void Stop();

  // Connections closed at once for want of file descriptors, and when the latest was.
  uint64_t refused() const { return refused_.load(); }
  absl::Time last_refused() const;
  // The limit on open files in effect at Start, and how many of them it keeps free.
  uint64_t fd_limit() const { return fd_limit_; }
  int reserved_fds() const { return reserved_fds_; }

 private:
  GrpcListener() = default;

  void Run();
  // Accepts until none is waiting.
  void AcceptAll(int listener);
  // Closes a connection not handed to gRPC, and says so in the log at most every 10 s.
  void Refuse(int fd);
  void LogRefusals();

  std::vector<int> listeners_;
  int port_ = 0;
  std::string local_target_;
  int reserved_fds_ = 0;
  uint64_t fd_limit_ = 0;
  int accept_below_ = 0;  // descriptors from this number up are refused
  int reserve_ = -1;      // /dev/null, given up to take a connection when none is free
  int wake_ = -1;         // an eventfd: Stop
  grpc::experimental::ExternalConnectionAcceptor* acceptor_ = nullptr;
  std::thread thread_;
  std::atomic<uint64_t> refused_{0};
  std::atomic<int64_t> last_refused_ns_{0};  // absl::ToUnixNanos
  // For the log (the accepting thread's): refusals until the last line about them, when
  // that line was, and when the last line about an accept error was.
  uint64_t refused_logged_ = 0;
  absl::Time refusals_logged_at_ = absl::InfinitePast();
  absl::Time error_logged_at_ = absl::InfinitePast();
};

}  // namespace lathe

#endif  // LATHE_COORDINATOR_SERVER_GRPC_LISTENER_H_
