// The daemons' HTTP port (common/http): /metrics in Prometheus' text format, /healthz,
// /readyz following its callback, a port in use refused with the flag's name, and /healthz
// answering within 1 s while 200 connections hold back their requests (issue #27). Real
// sockets on 127.0.0.1.
#include "common/http/http_endpoints.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "prometheus/counter.h"
#include "prometheus/registry.h"

namespace lathe {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

// A socket connected to 127.0.0.1:port, or -1.
int Connect(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, "127.0.0.1", &address.sin_addr);
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// The whole answer to `GET path` (HTTP/1.1, Connection: close): what arrived before the
// server closed the connection, or before no byte came for `read_timeout`.
std::string Get(int port, const std::string& path,
                std::chrono::seconds read_timeout = std::chrono::seconds(60)) {
  const int fd = Connect(port);
  if (fd < 0) return "connect failed";
  const timeval timeout{static_cast<time_t>(read_timeout.count()), 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  const std::string request =
      absl::StrCat("GET ", path, " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
  (void)write(fd, request.data(), request.size());
  std::string answer;
  char buffer[4096];
  for (ssize_t n; (n = read(fd, buffer, sizeof(buffer))) > 0;) answer.append(buffer, n);
  close(fd);
  return answer;
}

TEST(HttpEndpointsTest, MetricsHealthAndReadiness) {
  auto registry = std::make_shared<prometheus::Registry>();
  prometheus::BuildCounter()
      .Name("lathe_test_total")
      .Help("A test.")
      .Register(*registry)
      .Add({})
      .Increment(3);
  std::atomic<bool> ready{false};
  absl::StatusOr<std::unique_ptr<HttpEndpoints>> http = HttpEndpoints::Start(
      {"127.0.0.1:0",
       {registry},
       [&] { return ready ? absl::OkStatus() : absl::UnavailableError("still loading"); }},
      "--metrics-listen");
  ASSERT_TRUE(http.ok()) << http.status();
  const int port = (*http)->port();
  ASSERT_GT(port, 0);

  std::string metrics = Get(port, "/metrics");
  EXPECT_THAT(metrics, StartsWith("HTTP/1.1 200"));
  EXPECT_THAT(metrics, HasSubstr("Content-Type: text/plain; version=0.0.4"));
  EXPECT_THAT(metrics, HasSubstr("# TYPE lathe_test_total counter\nlathe_test_total 3\n"));
  EXPECT_THAT(Get(port, "/healthz"), StartsWith("HTTP/1.1 200"));
  std::string readiness = Get(port, "/readyz");
  EXPECT_THAT(readiness, StartsWith("HTTP/1.1 503"));
  EXPECT_THAT(readiness, HasSubstr("not ready: still loading"));
  ready = true;
  EXPECT_THAT(Get(port, "/readyz"), StartsWith("HTTP/1.1 200"));
  EXPECT_THAT(Get(port, "/elsewhere"), StartsWith("HTTP/1.1 404"));

  // The port is taken: the second server names the flag and the address.
  const std::string taken = absl::StrCat("127.0.0.1:", port);
  absl::StatusOr<std::unique_ptr<HttpEndpoints>> second =
      HttpEndpoints::Start({taken, {}, nullptr}, "--metrics-listen");
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(second.status().message(),
              HasSubstr("--metrics-listen: cannot serve HTTP on " + taken));
}

// Connections that send part of a request line and then nothing must not stall the probes:
// with 200 of them open, /healthz answers within 1 s of its request (behind the port's 2
// threads of old, it waited for the stalled connections ahead of it, 30 s a pair).
TEST(HttpEndpointsTest, HealthAnswersWithinASecondWhile200ConnectionsStall) {
  absl::StatusOr<std::unique_ptr<HttpEndpoints>> http =
      HttpEndpoints::Start({"127.0.0.1:0", {}, nullptr}, "--metrics-listen");
  ASSERT_TRUE(http.ok()) << http.status();
  const int port = (*http)->port();
  struct Stalled {
    std::vector<int> fds;
    ~Stalled() {
      for (int fd : fds) close(fd);
    }
  } stalled;
  const std::string partial = "GET /metr";
  for (int i = 0; i < 200; ++i) {
    const int fd = Connect(port);
    ASSERT_GE(fd, 0) << "connection " << i;
    stalled.fds.push_back(fd);
    ASSERT_EQ(write(fd, partial.data(), partial.size()), static_cast<ssize_t>(partial.size()));
  }

  const auto sent = std::chrono::steady_clock::now();
  // Read for up to 5 s: long enough to tell a slow answer from none, short enough that the
  // old setup fails here rather than after 30 s.
  const std::string health = Get(port, "/healthz", std::chrono::seconds(5));
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - sent).count();
  EXPECT_THAT(health, StartsWith("HTTP/1.1 200"));
  EXPECT_LT(seconds, 1.0) << "/healthz answered after " << seconds << " s";
}

}  // namespace
}  // namespace lathe
