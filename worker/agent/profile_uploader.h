// Sends the trainers' profile captures to the coordinator (`lathe profile`, issue #33): for
// each answer of a trainer to a ProfileOrder, uploads the capture's files in chunks of at
// most 1 MiB (WorkerService.UploadProfile), then reports the rank's answer with the files and
// their sizes, or the error (ReportProfile). One thread, so that uploads never hold a
// trainer's reader thread.
//
// What is uploaded is checked first: every file must be a regular file directly inside the
// capture's directory (<rank dir>/profile/<capture_id>/, where the trainer was told to write)
// with a plain name. Each is then compressed with gzip beside itself, as <name>.gz (a name
// ending in .gz is sent as it is), which is what is uploaded: Perfetto opens a .json.gz trace
// as it is, and a trace shrinks about tenfold. Each compressed file must be at most
// max_file_bytes, and the rank's files together at most max_capture_bytes; otherwise nothing
// is uploaded and the answer is an error naming the file and its size. The coordinator
// bounds the capture over all its ranks too (coordinator/logs/profile_store.h).
//
// Delivery: UNAVAILABLE and DEADLINE_EXCEEDED are retried under the retry policy until Stop;
// any other refusal (the capture ended, a bound at the coordinator) ends the upload, and the
// answer then carries that error.
//
// Thread-safety: thread-safe.
#ifndef LATHE_WORKER_AGENT_PROFILE_UPLOADER_H_
#define LATHE_WORKER_AGENT_PROFILE_UPLOADER_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/profile_limits.h"
#include "common/rpc/retry_policy.h"
#include "lathe/v1/coordinator.grpc.pb.h"
#include "lathe/v1/coordinator.pb.h"
#include "lathe/v1/trainer.pb.h"

namespace lathe {

struct ProfileUploaderOptions {
  absl::Duration rpc_timeout = absl::Seconds(30);
  RetryOptions retry;  // max_attempts is not used: retried until Stop
  std::string token;   // bearer token sent with every call; none when empty
  // The bounds docs/observability.md ("Profiling") states; the coordinator's are the same.
  int64_t max_file_bytes = kMaxProfileFileBytes;
  int64_t max_capture_bytes = kMaxProfileCaptureBytes;
  int64_t chunk_bytes = int64_t{1} << 20;  // per UploadProfile; at most 1 MiB
};

// One rank's answer to a capture, for the uploader.
struct ProfileAnswer {
  std::string worker_id;
  std::string job_id;
  int64_t generation = 0;
  int64_t rank = 0;
  std::string capture_id;
  // Where the capture's files must lie: <rank dir>/profile/<capture_id>.
  std::string capture_dir;
  // The trainer's event; capture_id is the answer's. An answer without a trainer (the rank is
  // not running here) has only `error` set.
  v1::TrainerProfile profile;
};

class ProfileUploader {
 public:
  // Starts the sending thread. REQUIRES: `stub` outlives the uploader.
  ProfileUploader(v1::WorkerService::StubInterface* stub, ProfileUploaderOptions options);
  // Stop().
  ~ProfileUploader();

  ProfileUploader(const ProfileUploader&) = delete;
  ProfileUploader& operator=(const ProfileUploader&) = delete;

  // Queues `answer`: its files are checked and uploaded, then it is reported.
  void Submit(ProfileAnswer answer);

  // Blocks until no answer of (job, generation, rank) is queued or being sent, or Stop: a
  // rank's end is reported after its capture, so that the coordinator does not end the
  // attempt (failing the capture) while its files are on the way.
  void WaitFor(const std::string& job_id, int64_t generation, int64_t rank);

  // Abandons what is queued (each is logged), lets the answer being sent end at its next
  // call, and stops the thread. Idempotent.
  void Stop();

 private:
  void Loop();
  void Send(const ProfileAnswer& answer);
  // One call under the retry policy; the last status.
  absl::Status Call(const std::function<grpc::Status(grpc::ClientContext*)>& call);
  bool stopping() const;

  v1::WorkerService::StubInterface* const stub_;
  const ProfileUploaderOptions options_;

  mutable absl::Mutex mu_;
  std::deque<ProfileAnswer> queue_ ABSL_GUARDED_BY(mu_);
  const ProfileAnswer* sending_ ABSL_GUARDED_BY(mu_) = nullptr;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace lathe

#endif  // LATHE_WORKER_AGENT_PROFILE_UPLOADER_H_
