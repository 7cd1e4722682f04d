#include "worker/agent/profile_uploader.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/rpc/auth.h"
#include "common/rpc/grpc_status.h"
#include "common/status_macros.h"
#include "grpcpp/client_context.h"
#include "spdlog/spdlog.h"
#include "zlib.h"

namespace lathe {
namespace {

std::string MiB(int64_t bytes) { return absl::StrCat(bytes >> 20, " MiB"); }

struct CheckedFile {
  std::string path;
  std::string name;
  int64_t size = 0;
};

// Writes `from` gzip-compressed to `to` (zlib's fastest level: a JSON trace shrinks about
// tenfold even so) and returns the bytes written.
absl::StatusOr<int64_t> Gzip(const std::string& from, const std::string& to) {
  std::ifstream in(from, std::ios::binary);
  if (!in) return absl::InternalError(absl::StrCat("file ", from, ": cannot be read"));
  gzFile out = gzopen(to.c_str(), "wb1");
  if (out == nullptr) return absl::InternalError(absl::StrCat("file ", to, ": cannot be written"));
  std::string buffer(size_t{1} << 20, '\0');
  bool ok = true;
  while (ok && in) {
    in.read(buffer.data(), static_cast<std::streamsize>(buffer.size()));
    const auto n = static_cast<unsigned>(in.gcount());
    if (n > 0) ok = gzwrite(out, buffer.data(), n) == static_cast<int>(n);
  }
  ok = gzclose(out) == Z_OK && ok && !in.bad();
  std::error_code error;
  const uintmax_t size = std::filesystem::file_size(to, error);
  if (!ok || error) {
    std::filesystem::remove(to, error);
    return absl::InternalError(absl::StrCat("file ", from, ": compressing it failed"));
  }
  return static_cast<int64_t>(size);
}

// The answer's files, checked against the capture's directory, compressed beside themselves
// (<name>.gz, unless the name ends in .gz already) and checked against the bounds; an error
// naming the file otherwise.
absl::StatusOr<std::vector<CheckedFile>> PrepareFiles(const ProfileAnswer& answer,
                                                      const ProfileUploaderOptions& options) {
  // The id names the capture's directory: a trainer's answer must not point it elsewhere.
  const std::string& id = answer.capture_id;
  if (!answer.profile.files().empty()) LATHE_RETURN_IF_ERROR(CheckCaptureId(id));
  const std::filesystem::path dir = std::filesystem::path(answer.capture_dir).lexically_normal();
  std::vector<CheckedFile> files;
  int64_t total = 0;
  for (const std::string& listed : answer.profile.files()) {
    const std::filesystem::path path = std::filesystem::path(listed).lexically_normal();
    CheckedFile file{path.string(), path.filename().string(), 0};
    if (!path.is_absolute() || path.parent_path() != dir || !CheckProfileFileName(file.name).ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("file ", listed, ": not a plain file name directly in ", dir.string()));
    }
    std::error_code error;
    const std::filesystem::file_status status = std::filesystem::symlink_status(path, error);
    if (error || !std::filesystem::is_regular_file(status)) {
      return absl::InvalidArgumentError(absl::StrCat("file ", listed, ": not a regular file"));
    }
    if (!absl::EndsWith(file.name, ".gz")) {
      file.path += ".gz";
      file.name += ".gz";
      LATHE_RETURN_IF_ERROR(CheckProfileFileName(file.name, "file"));
      LATHE_ASSIGN_OR_RETURN(file.size, Gzip(path.string(), file.path));
    } else {
      file.size = static_cast<int64_t>(std::filesystem::file_size(path, error));
      if (error) return absl::InternalError(absl::StrCat("file ", listed, ": ", error.message()));
    }
    if (file.size > options.max_file_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat("file ", file.name, " is ", file.size,
                                                       " bytes, past the bound of ",
                                                       MiB(options.max_file_bytes), " a file"));
    }
    total += file.size;
    if (total > options.max_capture_bytes) {
      return absl::ResourceExhaustedError(
          absl::StrCat("the capture's files reach ", total, " bytes at ", file.name,
                       ", past the bound of ", MiB(options.max_capture_bytes), " a capture"));
    }
    files.push_back(std::move(file));
  }
  return files;
}

}  // namespace

ProfileUploader::ProfileUploader(v1::WorkerService::StubInterface* stub,
                                 ProfileUploaderOptions options)
    : stub_(stub), options_(std::move(options)) {
  thread_ = std::thread([this] { Loop(); });
}

ProfileUploader::~ProfileUploader() { Stop(); }

void ProfileUploader::Submit(ProfileAnswer answer) {
  absl::MutexLock lock(&mu_);
  if (stopping_) {
    spdlog::warn("job={} attempt={} rank={} capture {} not sent: the agent is stopping",
                 answer.job_id, answer.generation, answer.rank, answer.capture_id);
    return;
  }
  queue_.push_back(std::move(answer));
}

void ProfileUploader::WaitFor(const std::string& job_id, int64_t generation, int64_t rank) {
  auto of_rank = [&](const ProfileAnswer& a) {
    return a.job_id == job_id && a.generation == generation && a.rank == rank;
  };
  absl::MutexLock lock(&mu_);
  auto idle = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stopping_ || ((sending_ == nullptr || !of_rank(*sending_)) &&
                         std::none_of(queue_.begin(), queue_.end(), of_rank));
  };
  mu_.Await(absl::Condition(&idle));
}

void ProfileUploader::Stop() {
  {
    absl::MutexLock lock(&mu_);
    if (stopped_) return;
    stopping_ = true;
    stopped_ = true;
    for (const ProfileAnswer& a : queue_) {
      spdlog::warn("job={} attempt={} rank={} capture {} not sent: the agent is stopping", a.job_id,
                   a.generation, a.rank, a.capture_id);
    }
    queue_.clear();
  }
  if (thread_.joinable()) thread_.join();
}

bool ProfileUploader::stopping() const {
  absl::MutexLock lock(&mu_);
  return stopping_;
}

void ProfileUploader::Loop() {
  while (true) {
    ProfileAnswer answer;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]()
                       ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || !queue_.empty(); };
      mu_.Await(absl::Condition(&ready));
      if (stopping_) return;
      answer = std::move(queue_.front());
      queue_.pop_front();
      sending_ = &answer;
    }
    Send(answer);
    absl::MutexLock lock(&mu_);
    sending_ = nullptr;
  }
}

absl::Status ProfileUploader::Call(const std::function<grpc::Status(grpc::ClientContext*)>& call) {
  Backoff backoff(options_.retry);
  while (true) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + options_.rpc_timeout));
    AttachToken(&context, options_.token);
    const absl::Status status = FromGrpcStatus(call(&context));
    if (status.ok() || !IsRetryable(status.code()) || stopping()) return status;
    absl::MutexLock lock(&mu_);
    mu_.AwaitWithTimeout(absl::Condition(&stopping_), backoff.Next());
  }
}

void ProfileUploader::Send(const ProfileAnswer& answer) {
  v1::ReportProfileRequest report;
  report.set_worker_id(answer.worker_id);
  report.set_job_id(answer.job_id);
  report.set_generation(answer.generation);
  report.set_rank(answer.rank);
  report.set_capture_id(answer.capture_id);
  report.set_first_step(answer.profile.first_step());
  report.set_last_step(answer.profile.last_step());
  std::string error = answer.profile.error();
  absl::StatusOr<std::vector<CheckedFile>> files = PrepareFiles(answer, options_);
  if (!files.ok()) {
    error = std::string(files.status().message());
    files = std::vector<CheckedFile>();
  }
  std::string buffer;
  for (const CheckedFile& file : *files) {
    std::ifstream in(file.path, std::ios::binary);
    absl::Status uploaded;
    for (int64_t offset = 0; uploaded.ok() && offset < file.size;) {
      v1::UploadProfileRequest chunk;
      chunk.set_worker_id(answer.worker_id);
      chunk.set_job_id(answer.job_id);
      chunk.set_generation(answer.generation);
      chunk.set_rank(answer.rank);
      chunk.set_capture_id(answer.capture_id);
      chunk.set_name(file.name);
      chunk.set_offset(offset);
      buffer.resize(static_cast<size_t>(std::min(options_.chunk_bytes, file.size - offset)));
      in.read(buffer.data(), static_cast<std::streamsize>(buffer.size()));
      if (in.gcount() != static_cast<std::streamsize>(buffer.size())) {
        uploaded = absl::InternalError(absl::StrCat(
            "file ", file.name, ": read ", offset + in.gcount(), " of its ", file.size, " bytes"));
        break;
      }
      chunk.set_data(buffer);
      v1::UploadProfileResponse response;
      uploaded = Call([&](grpc::ClientContext* context) {
        return stub_->UploadProfile(context, chunk, &response);
      });
      offset += static_cast<int64_t>(buffer.size());
    }
    if (!uploaded.ok()) {
      error = absl::StrCat("uploading ", file.name, ": ", uploaded.message());
      break;
    }
    v1::ProfileFile* sent = report.add_files();
    sent->set_rank(answer.rank);
    sent->set_name(file.name);
    sent->set_size(static_cast<uint64_t>(file.size));
  }
  report.set_error(error);
  const absl::Status reported = Call([&](grpc::ClientContext* context) {
    v1::ReportProfileResponse response;
    return stub_->ReportProfile(context, report, &response);
  });
  if (reported.ok()) {
    spdlog::info("job={} attempt={} rank={} capture {}: {} file(s) sent{}{}", answer.job_id,
                 answer.generation, answer.rank, answer.capture_id, report.files_size(),
                 error.empty() ? "" : "; ", error);
  } else {
    spdlog::warn("job={} attempt={} rank={} capture {}: the answer was refused: {}", answer.job_id,
                 answer.generation, answer.rank, answer.capture_id, reported.ToString());
  }
}

}  // namespace lathe
