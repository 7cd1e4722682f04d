#include "common/http/http_endpoints.h"

#include <CivetServer.h>

#include <exception>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "prometheus/collectable.h"
#include "prometheus/metric_family.h"
#include "prometheus/text_serializer.h"

namespace lathe {
namespace {

void Send(mg_connection* connection, int code, const char* content_type, const std::string& body) {
  mg_printf(connection,
            "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\nConnection: close\r\n"
            "\r\n",
            code, mg_get_response_code_text(connection, code), content_type, body.size());
  mg_write(connection, body.data(), body.size());
}

class MetricsHandler : public CivetHandler {
 public:
  explicit MetricsHandler(std::vector<std::weak_ptr<prometheus::Collectable>> collectables)
      : collectables_(std::move(collectables)) {}

  bool handleGet(CivetServer*, mg_connection* connection) override {
    std::vector<prometheus::MetricFamily> families;
    for (const auto& weak : collectables_) {
      if (auto collectable = weak.lock()) {
        for (prometheus::MetricFamily& f : collectable->Collect()) families.push_back(std::move(f));
      }
    }
    Send(connection, 200, "text/plain; version=0.0.4; charset=utf-8",
         prometheus::TextSerializer().Serialize(families));
    return true;
  }

 private:
  const std::vector<std::weak_ptr<prometheus::Collectable>> collectables_;
};

class HealthHandler : public CivetHandler {
 public:
  bool handleGet(CivetServer*, mg_connection* connection) override {
    Send(connection, 200, "text/plain", "ok\n");
    return true;
  }
};

class ReadyHandler : public CivetHandler {
 public:
  explicit ReadyHandler(std::function<absl::Status()> ready) : ready_(std::move(ready)) {}

  bool handleGet(CivetServer*, mg_connection* connection) override {
    const absl::Status status = ready_ ? ready_() : absl::OkStatus();
    if (status.ok()) {
      Send(connection, 200, "text/plain", "ready\n");
    } else {
      Send(connection, 503, "text/plain", absl::StrCat("not ready: ", status.message(), "\n"));
    }
    return true;
  }

 private:
  const std::function<absl::Status()> ready_;
};

// civetweb reads a request's head in the thread that took its connection, so a connection
// that sends part of a request and then nothing holds a thread until the head's timeout: with
// the 2 threads this port had, two such connections kept /healthz, /readyz and /metrics from
// answering for 30 s each, and anyone who reached the port could fail its probes at will
// (issue #27). 256 threads outlast hundreds of stalled connections (each thread's stack is
// mostly untouched: a few MiB resident in all), and a head must arrive within 2 s of its
// connection being taken (a probe or a scrape sends it at once), so a stalled connection gives
// its thread back soon. Without keep-alive a connection holds its thread for one request
// only (a scraper's idle connection would hold one between scrapes).
constexpr int kThreads = 256;
constexpr int kQueuedConnections = 20;  // accepted, waiting for a thread (civetweb's default)
constexpr char kRequestTimeoutMs[] = "2000";
static_assert(kThreads + kQueuedConnections + 1 == HttpEndpoints::kMaxConnections);

// civetweb's own message when it cannot start (it says why only through this callback).
absl::Mutex start_error_mu;
std::string* start_error ABSL_GUARDED_BY(start_error_mu) = nullptr;

int LogMessage(const mg_connection*, const char* message) {
  absl::MutexLock lock(&start_error_mu);
  if (start_error != nullptr && start_error->empty()) *start_error = message;
  return 1;  // logged
}

}  // namespace

class HttpEndpoints::Impl {
 public:
  explicit Impl(HttpEndpointsOptions options)
      : metrics(std::move(options.collectables)), ready(std::move(options.ready)) {}

  MetricsHandler metrics;
  HealthHandler health;
  ReadyHandler ready;
  std::unique_ptr<CivetServer> server;  // last: stopped before the handlers go
};

absl::StatusOr<std::unique_ptr<HttpEndpoints>> HttpEndpoints::Start(HttpEndpointsOptions options,
                                                                    const std::string& flag) {
  const std::string listen = options.listen;
  std::unique_ptr<HttpEndpoints> endpoints(new HttpEndpoints());
  endpoints->impl_ = std::make_unique<Impl>(std::move(options));
  CivetCallbacks callbacks;
  callbacks.log_message = LogMessage;
  std::string why;
  {
    absl::MutexLock lock(&start_error_mu);
    start_error = &why;
  }
  std::string failure;
  try {
    endpoints->impl_->server = std::make_unique<CivetServer>(
        std::vector<std::string>{"listening_ports", listen, "num_threads", std::to_string(kThreads),
                                 "connection_queue", std::to_string(kQueuedConnections),
                                 "request_timeout_ms", kRequestTimeoutMs, "enable_keep_alive",
                                 "no"},
        &callbacks);
  } catch (const std::exception& e) {
    failure = e.what();
  }
  {
    absl::MutexLock lock(&start_error_mu);
    start_error = nullptr;
  }
  if (!failure.empty()) {
    return absl::UnavailableError(
        absl::StrCat(flag, ": cannot serve HTTP on ", listen, ": ", why.empty() ? failure : why));
  }
  CivetServer& server = *endpoints->impl_->server;
  server.addHandler("/metrics", &endpoints->impl_->metrics);
  server.addHandler("/healthz", &endpoints->impl_->health);
  server.addHandler("/readyz", &endpoints->impl_->ready);
  const std::vector<int> ports = server.getListeningPorts();
  endpoints->port_ = ports.empty() ? 0 : ports.front();
  return endpoints;
}

HttpEndpoints::~HttpEndpoints() {
  if (impl_ && impl_->server) impl_->server->close();
}

}  // namespace lathe
