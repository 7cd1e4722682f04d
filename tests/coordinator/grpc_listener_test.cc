// The coordinator's gRPC listener (coordinator/server/grpc_listener.h) with a recording
// acceptor in place of gRPC: addresses and their errors, a port in use, and, under a low limit
// on open files set in this process, connections refused beyond the reserved descriptors and
// at EMFILE, after which the listener takes connections again (gRPC 1.51's own stopped for
// good, issue #27). Real sockets on 127.0.0.1.
#include "coordinator/server/grpc_listener.h"

#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace lathe {
namespace {

using ::testing::HasSubstr;

// Keeps what would be gRPC's connections, and closes them when told or at the end.
class RecordingAcceptor : public grpc::experimental::ExternalConnectionAcceptor {
 public:
  ~RecordingAcceptor() override { CloseAll(); }

  void HandleNewConnection(NewConnectionParameters* connection) override {
    absl::MutexLock lock(&mu_);
    fds_.push_back(connection->fd);
    ++handed_;
  }

  // Waits up to 10 s for `n` connections handed over in all; how many there were.
  int WaitForHanded(int n) {
    absl::MutexLock lock(&mu_);
    wanted_ = n;
    mu_.AwaitWithTimeout(absl::Condition(this, &RecordingAcceptor::Enough), absl::Seconds(10));
    return handed_;
  }

  int handed() {
    absl::MutexLock lock(&mu_);
    return handed_;
  }

  void CloseAll() {
    absl::MutexLock lock(&mu_);
    for (int fd : fds_) close(fd);
    fds_.clear();
  }

 private:
  bool Enough() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return handed_ >= wanted_; }

  absl::Mutex mu_;
  std::vector<int> fds_ ABSL_GUARDED_BY(mu_);
  int handed_ ABSL_GUARDED_BY(mu_) = 0;
  int wanted_ ABSL_GUARDED_BY(mu_) = 0;
};

sockaddr_in Loopback(int port) {
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  return address;
}

// A socket connected to 127.0.0.1:port, or -1.
int Connect(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  const sockaddr_in address = Loopback(port);
  if (connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// `n` connections to 127.0.0.1:port from a child process under `limit`, so that they take
// none of this process's descriptors; held until Release.
class ChildClients {
 public:
  ChildClients(int port, int n, rlimit limit) {
    int hold[2];
    if (pipe2(hold, O_CLOEXEC) != 0) return;
    const sockaddr_in address = Loopback(port);
    pid_ = fork();
    if (pid_ == 0) {  // only async-signal-safe calls from here
      close(hold[1]);
      setrlimit(RLIMIT_NOFILE, &limit);
      for (int i = 0; i < n; ++i) {
        const int fd = socket(AF_INET, SOCK_STREAM, 0);
        connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof(address));
      }
      char byte;
      (void)read(hold[0], &byte, 1);  // until the parent closes its end
      _exit(0);
    }
    close(hold[0]);
    hold_ = hold[1];
  }
  ~ChildClients() { Release(); }

  // Closes the connections (the child exits).
  void Release() {
    if (hold_ >= 0) close(hold_);
    hold_ = -1;
    if (pid_ > 0) waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

 private:
  pid_t pid_ = -1;
  int hold_ = -1;
};

int OpenFds() {
  int n = 0;
  DIR* dir = opendir("/proc/self/fd");
  while (readdir(dir) != nullptr) ++n;
  closedir(dir);
  return n - 3;  // ".", ".." and the directory's own
}

TEST(GrpcListenerTest, HandsOverConnectionsOnTheBoundPort) {
  absl::StatusOr<std::unique_ptr<GrpcListener>> listener = GrpcListener::Bind("127.0.0.1:0", 16);
  ASSERT_TRUE(listener.ok()) << listener.status();
  const int port = (*listener)->port();
  ASSERT_GT(port, 0);
  EXPECT_EQ((*listener)->local_target(), absl::StrCat("127.0.0.1:", port));
  RecordingAcceptor acceptor;
  (*listener)->Start(&acceptor);
  const int client = Connect(port);
  ASSERT_GE(client, 0);
  EXPECT_EQ(acceptor.WaitForHanded(1), 1);
  EXPECT_EQ((*listener)->refused(), 0u);
  close(client);

  // Taken without SO_REUSEPORT: a second listener fails, naming the address.
  const std::string taken = absl::StrCat("127.0.0.1:", port);
  absl::StatusOr<std::unique_ptr<GrpcListener>> second = GrpcListener::Bind(taken, 16);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(second.status().message(), HasSubstr("cannot listen on " + taken + ": "));
  (*listener)->Stop();
  EXPECT_LT(Connect(port), 0);  // closed
}

TEST(GrpcListenerTest, AWildcardIsReachedOnLoopback) {
  absl::StatusOr<std::unique_ptr<GrpcListener>> listener = GrpcListener::Bind("0.0.0.0:0", 16);
  ASSERT_TRUE(listener.ok()) << listener.status();
  EXPECT_EQ((*listener)->local_target(), absl::StrCat("127.0.0.1:", (*listener)->port()));
  RecordingAcceptor acceptor;
  (*listener)->Start(&acceptor);
  const int client = Connect((*listener)->port());
  ASSERT_GE(client, 0);
  EXPECT_EQ(acceptor.WaitForHanded(1), 1);
  close(client);
}

TEST(GrpcListenerTest, BadAddressesNameTheAddress) {
  for (const std::string address : {"7070", "::1:7070", "127.0.0.1:", "127.0.0.1:99999",
                                    "127.0.0.1:http", "no-such-host.invalid:7070"}) {
    absl::StatusOr<std::unique_ptr<GrpcListener>> listener = GrpcListener::Bind(address, 16);
    EXPECT_EQ(listener.status().code(), absl::StatusCode::kUnavailable) << address;
    EXPECT_THAT(listener.status().message(), HasSubstr("cannot listen on " + address + ": "));
  }
}

// Under a limit on open files set low in this process, 100 connections wait: those that
// would leave fewer than the reserved descriptors free are closed at once; with none
// reserved, the listener runs out (EMFILE) and closes the waiting ones with its reserve.
// Once the descriptors are free again a new connection is handed over: the listener never
// stopped (gRPC 1.51's own did).
TEST(GrpcListenerTest, RefusesWhenOutOfDescriptorsAndAcceptsAgain) {
  constexpr int kConnections = 100;
  rlimit saved{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &saved), 0);
  for (const int reserved : {16, 0}) {
    SCOPED_TRACE(absl::StrCat("reserved descriptors: ", reserved));
    absl::StatusOr<std::unique_ptr<GrpcListener>> listener =
        GrpcListener::Bind("127.0.0.1:0", reserved);
    ASSERT_TRUE(listener.ok()) << listener.status();
    RecordingAcceptor acceptor;
    const rlimit low{static_cast<rlim_t>(OpenFds() + 40), saved.rlim_max};
    ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &low), 0);
    (*listener)->Start(&acceptor);
    EXPECT_EQ((*listener)->fd_limit(), low.rlim_cur);

    ChildClients clients((*listener)->port(), kConnections, saved);
    // Every connection is handed over or refused, none left waiting.
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    int handed = 0;
    while (handed + static_cast<int>((*listener)->refused()) < kConnections &&
           absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(10));
      handed = acceptor.handed();
    }
    EXPECT_EQ(handed + static_cast<int>((*listener)->refused()), kConnections);
    EXPECT_GT((*listener)->refused(), 0u);
    EXPECT_LT(handed, 40 - reserved);

    clients.Release();
    acceptor.CloseAll();
    ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &saved), 0);
    const int client = Connect((*listener)->port());
    ASSERT_GE(client, 0);
    EXPECT_EQ(acceptor.WaitForHanded(handed + 1), handed + 1) << "the listener stopped accepting";
    close(client);
  }
}

}  // namespace
}  // namespace lathe
