// The one place that writes and reads what crosses between a worker agent and its trainer
// process (proto/lathe/v1/trainer.proto): the TrainerTask file the agent writes and the
// trainer reads, and the TrainerEvent lines the trainer prints and the agent parses. Both
// are protobuf JSON with the proto's field names, so a person can read them too.
//
// Thread-safety: pure functions (the file functions touch only their file).
#ifndef LATHE_COMMON_PROTO_TRAINER_IO_H_
#define LATHE_COMMON_PROTO_TRAINER_IO_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "lathe/v1/trainer.pb.h"

namespace lathe {

// Writes `task` to `path` atomically (temp file, fsync, rename). INTERNAL naming the file on
// I/O errors.
absl::Status WriteTrainerTask(const std::string& path, const v1::TrainerTask& task);

// NOT_FOUND for a missing file; INVALID_ARGUMENT "<path>: ..." for one that is not a
// TrainerTask (unknown fields included: a newer agent than this trainer).
absl::StatusOr<v1::TrainerTask> ReadTrainerTask(const std::string& path);

// `event` as one line of JSON, without the newline. Numbers, booleans and strings at their
// zero value are printed too, so that every field of the event is there for a reader.
std::string TrainerEventLine(const v1::TrainerEvent& event);

// The event on `line`; INVALID_ARGUMENT when the line is not one (other output of the
// trainer, or an event with none of start, step, checkpoint, done, error set).
absl::StatusOr<v1::TrainerEvent> ParseTrainerEventLine(absl::string_view line);

// The ProfileRequest in `text`, the content of `path` (<rank dir>/profile/request.json, which
// the agent writes); INVALID_ARGUMENT "<path>: ..." when it is not one (unknown fields
// included). Its values are checked by the trainer (worker/train/profiler.h).
absl::StatusOr<v1::ProfileRequest> ParseProfileRequest(absl::string_view text,
                                                       absl::string_view path);

}  // namespace lathe

#endif  // LATHE_COMMON_PROTO_TRAINER_IO_H_
