// The daemons' HTTP port (common/http): /metrics in Prometheus' text format, /healthz,
// /readyz following its callback, and a port in use refused with the flag's name. Real
// sockets on 127.0.0.1.
#include "common/http/http_endpoints.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "prometheus/counter.h"
#include "prometheus/registry.h"

namespace lathe {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

// The whole answer to `GET path` (HTTP/1.1, Connection: close).
std::string Get(int port, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, "127.0.0.1", &address.sin_addr);
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    close(fd);
    return "connect failed";
  }
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

}  // namespace
}  // namespace lathe
