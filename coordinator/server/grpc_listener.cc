#include "coordinator/server/grpc_listener.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "spdlog/spdlog.h"

namespace lathe {
namespace {

// Between two log lines about refused connections (or accept errors), at least this long.
constexpr absl::Duration kRefusalLogPeriod = absl::Seconds(10);
// After an accept error that leaves a connection waiting (the poll would wake at once).
constexpr absl::Duration kRetryPause = absl::Milliseconds(10);

// "host" and "port" of "host:port" or "[host]:port"; false when it is neither.
bool SplitHostPort(const std::string& address, std::string& host, std::string& port) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) return false;
  host = address.substr(0, colon);
  port = address.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  } else if (host.find(':') != std::string::npos) {
    return false;  // an IPv6 address without brackets
  }
  return !port.empty() && port.size() <= 5 &&
         std::all_of(port.begin(), port.end(), absl::ascii_isdigit) && std::stoi(port) <= 65535;
}

std::string Endpoint(const sockaddr_storage& address) {
  char text[INET6_ADDRSTRLEN] = {};
  if (address.ss_family == AF_INET6) {
    const auto& v6 = reinterpret_cast<const sockaddr_in6&>(address);
    inet_ntop(AF_INET6, &v6.sin6_addr, text, sizeof(text));
    return absl::StrCat("[", text, "]:", ntohs(v6.sin6_port));
  }
  const auto& v4 = reinterpret_cast<const sockaddr_in&>(address);
  inet_ntop(AF_INET, &v4.sin_addr, text, sizeof(text));
  return absl::StrCat(text, ":", ntohs(v4.sin_port));
}

void SetPort(sockaddr_storage& address, int port) {
  if (address.ss_family == AF_INET6) {
    reinterpret_cast<sockaddr_in6&>(address).sin6_port = htons(static_cast<uint16_t>(port));
  } else {
    reinterpret_cast<sockaddr_in&>(address).sin_port = htons(static_cast<uint16_t>(port));
  }
}

// The addresses to listen on, each with its length.
using Addresses = std::vector<std::pair<sockaddr_storage, socklen_t>>;

absl::StatusOr<Addresses> Resolve(const std::string& host, const std::string& port) {
  Addresses addresses;
  if (host.empty() || host == "0.0.0.0" || host == "::") {
    // The IPv6 wildcard first: it takes IPv4 too (IPV6_V6ONLY off), as gRPC's own listener
    // does; the IPv4 one alone where the host has no IPv6.
    sockaddr_storage any6{};
    any6.ss_family = AF_INET6;
    reinterpret_cast<sockaddr_in6&>(any6).sin6_addr = in6addr_any;
    sockaddr_storage any4{};
    any4.ss_family = AF_INET;
    reinterpret_cast<sockaddr_in&>(any4).sin_addr.s_addr = htonl(INADDR_ANY);
    addresses = {{any6, sizeof(sockaddr_in6)}, {any4, sizeof(sockaddr_in)}};
  } else {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICSERV;
    addrinfo* found = nullptr;
    const int error = getaddrinfo(host.c_str(), port.c_str(), &hints, &found);
    if (error != 0) return absl::UnavailableError(gai_strerror(error));
    for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
      if (a->ai_family != AF_INET && a->ai_family != AF_INET6) continue;
      sockaddr_storage address{};
      memcpy(&address, a->ai_addr, a->ai_addrlen);
      addresses.push_back({address, a->ai_addrlen});
    }
    freeaddrinfo(found);
  }
  for (auto& [address, length] : addresses) SetPort(address, std::stoi(port));
  return addresses;
}

}  // namespace

absl::StatusOr<std::unique_ptr<GrpcListener>> GrpcListener::Bind(const std::string& address,
                                                                 int reserved_fds) {
  auto fail = [&address](absl::string_view why) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", address, ": ", why));
  };
  std::string host, port;
  if (!SplitHostPort(address, host, port)) return fail("expected HOST:PORT or [IPV6]:PORT");
  absl::StatusOr<Addresses> addresses = Resolve(host, port);
  if (!addresses.ok()) return fail(addresses.status().message());
  const bool wildcard = host.empty() || host == "0.0.0.0" || host == "::";

  std::unique_ptr<GrpcListener> listener(new GrpcListener());
  listener->reserved_fds_ = reserved_fds;
  std::string skipped;  // why an address was left out
  for (auto& [bind_address, length] : *addresses) {
    if (wildcard && !listener->listeners_.empty()) break;  // the IPv6 wildcard took IPv4 too
    const int fd = socket(bind_address.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      skipped = strerror(errno);
      continue;
    }
    const int on = 1;
    const int off = 0;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on));  // not SO_REUSEPORT
    if (bind_address.ss_family == AF_INET6) {
      setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, wildcard ? &off : &on, sizeof(int));
    }
    // Every address of one name on one port: the first one bound picks it for port 0.
    if (listener->port_ != 0) SetPort(bind_address, listener->port_);
    if (bind(fd, reinterpret_cast<sockaddr*>(&bind_address), length) != 0) {
      const int error = errno;
      close(fd);
      if (error == EADDRINUSE || error == EACCES) return fail(strerror(error));
      skipped = strerror(error);  // an address family or address this host does not have
      continue;
    }
    sockaddr_storage bound{};
    socklen_t bound_length = sizeof(bound);
    if (listen(fd, SOMAXCONN) != 0 ||
        getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &bound_length) != 0) {
      const int error = errno;
      close(fd);
      return fail(strerror(error));
    }
    listener->listeners_.push_back(fd);
    if (listener->port_ == 0) {
      listener->port_ = bound.ss_family == AF_INET6
                            ? ntohs(reinterpret_cast<sockaddr_in6&>(bound).sin6_port)
                            : ntohs(reinterpret_cast<sockaddr_in&>(bound).sin_port);
      listener->local_target_ =
          wildcard ? absl::StrCat("127.0.0.1:", listener->port_) : Endpoint(bound);
    }
  }
  if (listener->listeners_.empty()) {
    return fail(skipped.empty() ? "the name has no IPv4 or IPv6 address" : skipped);
  }
  return listener;
}

GrpcListener::~GrpcListener() { Stop(); }

void GrpcListener::Start(grpc::experimental::ExternalConnectionAcceptor* acceptor) {
  acceptor_ = acceptor;
  rlimit limit{};
  getrlimit(RLIMIT_NOFILE, &limit);
  fd_limit_ = limit.rlim_cur;
  accept_below_ = static_cast<int>(std::min<uint64_t>(fd_limit_, INT_MAX)) - reserved_fds_;
  reserve_ = open("/dev/null", O_RDONLY | O_CLOEXEC);
  wake_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  thread_ = std::thread([this] { Run(); });
}

void GrpcListener::Stop() {
  if (thread_.joinable()) {
    const uint64_t one = 1;
    (void)write(wake_, &one, sizeof(one));
    thread_.join();
  }
  for (int fd : {wake_, reserve_}) {
    if (fd >= 0) close(fd);
  }
  wake_ = reserve_ = -1;
  for (int fd : listeners_) close(fd);
  listeners_.clear();
}

absl::Time GrpcListener::last_refused() const {
  const int64_t ns = last_refused_ns_.load();
  return ns == 0 ? absl::InfinitePast() : absl::FromUnixNanos(ns);
}

void GrpcListener::Run() {
  std::vector<pollfd> polled;
  for (int fd : listeners_) polled.push_back({fd, POLLIN, 0});
  polled.push_back({wake_, POLLIN, 0});
  while (true) {
    // Refusals not logged yet are, once the period since the last line about them is over.
    int timeout_ms = -1;
    if (refused_.load() > refused_logged_) {
      timeout_ms = static_cast<int>(std::max<int64_t>(
          0, absl::ToInt64Milliseconds(refusals_logged_at_ + kRefusalLogPeriod - absl::Now())));
    }
    const int ready = poll(polled.data(), polled.size(), timeout_ms);
    if (ready < 0) {
      if (errno != EINTR) absl::SleepFor(kRetryPause);
      continue;
    }
    if (ready == 0) {
      LogRefusals();
      continue;
    }
    if (polled.back().revents != 0) return;  // Stop
    for (size_t i = 0; i + 1 < polled.size(); ++i) {
      if (polled[i].revents != 0) AcceptAll(polled[i].fd);
    }
  }
}

void GrpcListener::AcceptAll(int listener) {
  while (true) {
    const int fd = accept4(listener, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd >= 0) {
      // Descriptors are numbered from the lowest free one: this number means nearly all
      // below it are in use.
      if (fd >= accept_below_) {
        Refuse(fd);
        continue;
      }
      const int on = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &on, sizeof(on));
      grpc::experimental::ExternalConnectionAcceptor::NewConnectionParameters connection;
      connection.listener_fd = listener;
      connection.fd = fd;
      acceptor_->HandleNewConnection(&connection);  // gRPC's from here on
      continue;
    }
    switch (errno) {
      case EAGAIN:
        return;
      // The waiting connection failed before it was taken (accept(2) lists these as to be
      // retried).
      case EINTR:
      case ECONNABORTED:
      case EPROTO:
      case ENETDOWN:
      case ENOPROTOOPT:
      case EHOSTDOWN:
      case ENONET:
      case EHOSTUNREACH:
      case EOPNOTSUPP:
      case ENETUNREACH:
        continue;
      case EMFILE:
      case ENFILE: {
        // Left waiting, the connection would wake the poll at once, for as long as the
        // descriptors last out: take it with the reserve and close it.
        if (reserve_ >= 0) close(reserve_);
        const int taken = accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
        if (taken >= 0) Refuse(taken);
        reserve_ = open("/dev/null", O_RDONLY | O_CLOEXEC);
        if (taken < 0) {
          absl::SleepFor(kRetryPause);  // another thread took the descriptor first
          return;
        }
        continue;
      }
      default:  // ENOBUFS, ENOMEM: the kernel is short; try again shortly
        if (absl::Now() - error_logged_at_ >= kRefusalLogPeriod) {
          spdlog::warn("gRPC port: accept: {}", strerror(errno));
          error_logged_at_ = absl::Now();
        }
        absl::SleepFor(kRetryPause);
        return;
    }
  }
}

void GrpcListener::Refuse(int fd) {
  close(fd);
  ++refused_;
  const absl::Time now = absl::Now();
  last_refused_ns_ = absl::ToUnixNanos(now);
  if (now - refusals_logged_at_ >= kRefusalLogPeriod) LogRefusals();
}

void GrpcListener::LogRefusals() {
  const uint64_t refused = refused_.load();
  const absl::Time now = absl::Now();
  spdlog::warn(
      "gRPC port: refused {} connection(s){}: the process is near its limit of {} open files, "
      "{} of which are kept for the rest of it; raise the limit (ulimit -Hn, systemd's "
      "LimitNOFILE, docker's --ulimit nofile)",
      refused - refused_logged_,
      now - refusals_logged_at_ > 2 * kRefusalLogPeriod
          ? ""
          : absl::StrCat(" in the last ", absl::FormatDuration(absl::Trunc(
                                              now - refusals_logged_at_, absl::Seconds(1)))),
      fd_limit_, reserved_fds_);
  refused_logged_ = refused;
  refusals_logged_at_ = now;
}

}  // namespace lathe
