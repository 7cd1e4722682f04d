#include "worker/comm/gloo_communicator.h"

#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/status_macros.h"
#include "worker/comm/ordered_executor.h"
#include "worker/comm/prefix_kv_store.h"

#ifdef LATHE_WITH_GLOO
#include <net/if.h>

#include "gloo/allgather.h"
#include "gloo/allreduce.h"
#include "gloo/barrier.h"
#include "gloo/broadcast.h"
#include "gloo/common/error.h"
#include "gloo/common/logging.h"
#include "gloo/math.h"
#include "gloo/rendezvous/context.h"
#include "gloo/rendezvous/store.h"
#include "gloo/transport/tcp/attr.h"
#include "gloo/transport/tcp/device.h"
#endif

namespace lathe {

#ifdef LATHE_WITH_GLOO
namespace {

// gloo reports every transport failure as gloo::IoException (or its base gloo::Exception)
// and tells timeouts apart only in the message ("Timed out waiting ...", "Read timeout",
// "Connect timeout", "Wait timeout for key(s)").
absl::StatusCode CodeOfGlooError(absl::string_view message) {
  const std::string lower = absl::AsciiStrToLower(message);
  if (absl::StrContains(lower, "timeout") || absl::StrContains(lower, "timed out")) {
    return absl::StatusCode::kDeadlineExceeded;
  }
  return absl::StatusCode::kAborted;
}

// Runs `fn`, turning what gloo throws into a status.
template <typename Fn>
absl::Status CatchGloo(Fn&& fn) {
  try {
    fn();
    return absl::OkStatus();
  } catch (const gloo::EnforceNotMet& e) {
    // A broken invariant inside gloo (e.g. ranks disagreeing on a buffer size).
    return absl::InternalError(absl::StrCat("gloo: ", e.what()));
  } catch (const gloo::Exception& e) {
    return absl::Status(CodeOfGlooError(e.what()), absl::StrCat("gloo: ", e.what()));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("gloo: ", e.what()));
  }
}

std::chrono::milliseconds ToChronoMs(absl::Duration d) {
  return std::chrono::milliseconds(absl::ToInt64Milliseconds(d));
}

// gloo's view of a KvStore. gloo's Store methods cannot return errors, so a failing call
// records its status and throws; ConnectGloo then returns the recorded status rather than
// the exception's text. Every wait uses our timeout (gloo passes its context timeout, which
// ConnectGloo sets to the same value).
// Thread-safety: used by the one thread that runs connectFullMesh.
class GlooStoreAdapter final : public gloo::rendezvous::Store {
 public:
  GlooStoreAdapter(KvStore* store, absl::Duration timeout) : store_(store), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    Check(store_->Set(key, absl::string_view(data.data(), data.size())));
  }

  std::vector<char> get(const std::string& key) override {
    absl::StatusOr<std::string> value = store_->Get(key, timeout_);
    Check(value.status());
    return std::vector<char>(value->begin(), value->end());
  }

  void wait(const std::vector<std::string>& keys) override { Check(store_->Wait(keys, timeout_)); }

  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds&) override {
    Check(store_->Wait(keys, timeout_));
  }

  // The first store error seen, OK if none.
  const absl::Status& failure() const { return failure_; }

 private:
  void Check(const absl::Status& status) {
    if (status.ok()) return;
    if (failure_.ok()) failure_ = status;
    throw gloo::IoException(std::string(status.message()));
  }

  KvStore* const store_;
  const absl::Duration timeout_;
  absl::Status failure_;
};

class GlooCommunicator final : public StartedCommunicator {
 public:
  GlooCommunicator(std::shared_ptr<gloo::transport::Device> device,
                   std::shared_ptr<gloo::rendezvous::Context> context, absl::Duration timeout)
      : device_(std::move(device)), context_(std::move(context)), timeout_(ToChronoMs(timeout)) {}

  int rank() const override { return context_->rank; }
  int world_size() const override { return context_->size; }

  // Every call runs on executor_'s thread, the synchronous ones too, so that the order of
  // the calls is the order in which they were issued.
  absl::Status Broadcast(void* data, size_t bytes, int root) override {
    LATHE_RETURN_IF_ERROR(comm_internal::CheckBroadcastArgs(data, bytes, root, world_size()));
    if (bytes == 0) return absl::OkStatus();
    return executor_.Submit([=] { return DoBroadcast(data, bytes, root); })->Wait();
  }
  absl::Status Barrier() override {
    return executor_.Submit([this] { return DoBarrier(); })->Wait();
  }

  std::unique_ptr<CommWork> StartAllReduceSum(void* data, size_t count, CommDType dtype) override {
    absl::Status args = comm_internal::CheckAllReduceArgs(data, count, dtype);
    if (!args.ok() || count == 0) return FinishedWork(args);
    return executor_.Submit([=] { return DoAllReduceSum(data, count, dtype); });
  }
  std::unique_ptr<CommWork> StartAllGather(const void* in, void* out,
                                           size_t bytes_per_rank) override {
    absl::Status args =
        comm_internal::CheckAllGatherArgs(in, out, bytes_per_rank, rank(), world_size());
    if (!args.ok() || bytes_per_rank == 0) return FinishedWork(args);
    return executor_.Submit([=] { return DoAllGather(in, out, bytes_per_rank); });
  }
  std::unique_ptr<CommWork> StartReduceScatterSum(const void* in, void* out, size_t count_per_rank,
                                                  CommDType dtype) override {
    absl::Status args =
        comm_internal::CheckReduceScatterArgs(in, out, count_per_rank, dtype, rank(), world_size());
    if (!args.ok() || count_per_rank == 0) return FinishedWork(args);
    return executor_.Submit([=] { return DoReduceScatterSum(in, out, count_per_rank, dtype); });
  }

 private:
  absl::Status DoAllReduceSum(void* data, size_t count, CommDType dtype) {
    return Run("all-reduce", [&] {
      gloo::AllreduceOptions opts(context_);
      opts.setTimeout(timeout_);
      opts.setAlgorithm(gloo::AllreduceOptions::Algorithm::RING);
      switch (dtype) {
        case CommDType::kFloat32:
          SetSum(opts, static_cast<float*>(data), count);
          break;
        case CommDType::kFloat64:
          SetSum(opts, static_cast<double*>(data), count);
          break;
        case CommDType::kInt64:
          SetSum(opts, static_cast<int64_t*>(data), count);
          break;
      }
      gloo::allreduce(opts);
    });
  }

  absl::Status DoBroadcast(void* data, size_t bytes, int root) {
    return Run("broadcast", [&] {
      gloo::BroadcastOptions opts(context_);
      opts.setTimeout(timeout_);
      opts.setRoot(root);
      // Without an input buffer the root sends from its output buffer: in place.
      opts.setOutput(static_cast<uint8_t*>(data), bytes);
      gloo::broadcast(opts);
    });
  }

  absl::Status DoAllGather(const void* in, void* out, size_t bytes_per_rank) {
    return Run("all-gather", [&] {
      gloo::AllgatherOptions opts(context_);
      opts.setTimeout(timeout_);
      auto* out_bytes = static_cast<uint8_t*>(out);
      // Without an input buffer gloo takes this rank's part from its slot of the output.
      if (in != out_bytes + static_cast<size_t>(rank()) * bytes_per_rank) {
        // gloo's API takes non-const pointers but only reads the input.
        opts.setInput(static_cast<uint8_t*>(const_cast<void*>(in)), bytes_per_rank);
      }
      opts.setOutput(out_bytes, bytes_per_rank * static_cast<size_t>(world_size()));
      gloo::allgather(opts);
    });
  }

  // A ring: in step s of n - 1, each rank sends its running sum of block (rank - s - 1) to
  // the next rank and adds the previous rank's into block (rank - s - 2); after the last
  // step it holds the whole sum of its own block. Every rank sends and receives
  // (n - 1) / n of the buffer, as in an all-reduce's first half.
  absl::Status DoReduceScatterSum(const void* in, void* out, size_t count, CommDType dtype) {
    return Run("reduce-scatter", [&] {
      const int n = world_size();
      const int me = rank();
      const size_t block = count * CommDTypeSize(dtype);
      std::vector<char> work(static_cast<const char*>(in),
                             static_cast<const char*>(in) + block * static_cast<size_t>(n));
      std::vector<char> incoming(block);
      auto work_buffer = context_->createUnboundBuffer(work.data(), work.size());
      auto incoming_buffer = context_->createUnboundBuffer(incoming.data(), incoming.size());
      const int next = (me + 1) % n;
      const int previous = (me + n - 1) % n;
      for (int step = 0; step < n - 1; ++step) {
        const size_t sent = static_cast<size_t>((me - step - 1 + 2 * n) % n);
        const size_t received = static_cast<size_t>((me - step - 2 + 2 * n) % n);
        const uint64_t slot = static_cast<uint64_t>(context_->nextSlot());
        work_buffer->send(next, slot, sent * block, block);
        incoming_buffer->recv(previous, slot, 0, block);
        if (!incoming_buffer->waitRecv(timeout_) || !work_buffer->waitSend(timeout_)) {
          throw gloo::IoException("reduce-scatter: a transfer was aborted");
        }
        char* acc = work.data() + received * block;
        switch (dtype) {
          case CommDType::kFloat32:
            AddInto<float>(acc, incoming.data(), count);
            break;
          case CommDType::kFloat64:
            AddInto<double>(acc, incoming.data(), count);
            break;
          case CommDType::kInt64:
            AddInto<int64_t>(acc, incoming.data(), count);
            break;
        }
      }
      std::memcpy(out, work.data() + static_cast<size_t>(me) * block, block);
    });
  }

  absl::Status DoBarrier() {
    return Run("barrier", [&] {
      gloo::BarrierOptions opts(context_);
      opts.setTimeout(timeout_);
      gloo::barrier(opts);
    });
  }

  // acc[i] += in[i]; the buffers are vectors of char, so go through memcpy.
  template <typename T>
  static void AddInto(char* acc, const char* in, size_t count) {
    for (size_t i = 0; i < count; ++i) {
      T a, b;
      std::memcpy(&a, acc + i * sizeof(T), sizeof(T));
      std::memcpy(&b, in + i * sizeof(T), sizeof(T));
      a += b;
      std::memcpy(acc + i * sizeof(T), &a, sizeof(T));
    }
  }

  template <typename T>
  static void SetSum(gloo::AllreduceOptions& opts, T* data, size_t count) {
    opts.setOutput(data, count);
    // gloo::sum is overloaded; take the (out, in1, in2, n) form.
    void (*sum)(void*, const void*, const void*, size_t) = &gloo::sum<T>;
    opts.setReduceFunction(sum);
  }

  // Runs one collective. After any failure gloo's pairs are in an unknown state (gloo's
  // docs/errors.md), so the communicator stays broken and refuses later calls.
  template <typename Fn>
  absl::Status Run(absl::string_view op, Fn&& fn) {
    absl::MutexLock lock(&mu_);
    if (!broken_.ok()) {
      return absl::AbortedError(
          absl::StrCat(op, " on rank ", rank(), " of ", world_size(),
                       ": the communicator broke earlier: ", broken_.message()));
    }
    absl::Status status = CatchGloo(std::forward<Fn>(fn));
    if (!status.ok()) {
      broken_ = Annotate(status, absl::StrCat(op, " on rank ", rank(), " of ", world_size()));
      return broken_;
    }
    return absl::OkStatus();
  }

  // Destroyed in reverse order: the context (its pairs) before the device.
  const std::shared_ptr<gloo::transport::Device> device_;
  const std::shared_ptr<gloo::rendezvous::Context> context_;
  const std::chrono::milliseconds timeout_;
  absl::Mutex mu_;
  absl::Status broken_ ABSL_GUARDED_BY(mu_);
  OrderedExecutor executor_;  // last: stops before the members its collectives use
};

}  // namespace
#endif  // LATHE_WITH_GLOO

absl::StatusOr<std::unique_ptr<Communicator>> ConnectGloo(KvStore* store, int rank, int world_size,
                                                          const GlooOptions& options) {
  LATHE_RETURN_IF_ERROR(comm_internal::CheckConnectArgs("gloo", rank, world_size, options.timeout));
  if (world_size == 1) return MakeSingleRankCommunicator();
  if (store == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("gloo: a group of ", world_size, " needs a rendezvous store"));
  }
#ifdef LATHE_WITH_GLOO
  const std::string where = absl::StrCat("gloo connect, rank ", rank, " of ", world_size);

  gloo::transport::tcp::attr attr;
  if (options.interface.empty()) {
    attr.hostname = options.hostname;
  } else {
    // Checked here because gloo leaks its getifaddrs() list when it finds no such interface.
    if (if_nametoindex(options.interface.c_str()) == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": no network interface named \"", options.interface, "\""));
    }
    attr.iface = options.interface;
  }
  std::shared_ptr<gloo::transport::Device> device;
  absl::Status status = CatchGloo([&] { device = gloo::transport::tcp::CreateDevice(attr); });
  if (!status.ok()) {
    // A wrong address or interface name does not fix itself on retry.
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": creating the TCP device on ",
        options.interface.empty() ? "host " + options.hostname : "interface " + options.interface,
        ": ", status.message()));
  }

  PrefixKvStore prefixed(store, options.key_prefix);
  GlooStoreAdapter adapter(&prefixed, options.timeout);
  auto context = std::make_shared<gloo::rendezvous::Context>(rank, world_size);
  context->setTimeout(ToChronoMs(options.timeout));
  status = CatchGloo([&] { context->connectFullMesh(adapter, device); });
  if (!adapter.failure().ok()) return Annotate(adapter.failure(), where);
  if (!status.ok()) return Annotate(status, where);
  return std::make_unique<GlooCommunicator>(std::move(device), std::move(context), options.timeout);
#else
  return absl::FailedPreconditionError(
      absl::StrCat("gloo: this build of Lathe has no gloo (libgloo-dev), so a group of ",
                   world_size, " cannot connect"));
#endif
}

}  // namespace lathe
