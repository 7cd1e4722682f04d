#include "common/proto/trainer_io.h"

#include <google/protobuf/util/json_util.h>

#include "absl/strings/str_cat.h"
#include "common/file_util.h"
#include "common/status_macros.h"

namespace lathe {
namespace {

google::protobuf::util::JsonPrintOptions PrintOptions() {
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = true;
  return options;
}

}  // namespace

absl::Status WriteTrainerTask(const std::string& path, const v1::TrainerTask& task) {
  google::protobuf::util::JsonPrintOptions options = PrintOptions();
  options.add_whitespace = true;
  std::string json;
  if (!google::protobuf::util::MessageToJsonString(task, &json, options).ok()) {
    return absl::InternalError(absl::StrCat(path, ": the task cannot be written as JSON"));
  }
  return WriteFileAtomically(path, json);
}

absl::StatusOr<v1::TrainerTask> ReadTrainerTask(const std::string& path) {
  LATHE_ASSIGN_OR_RETURN(std::string text, ReadFile(path));
  v1::TrainerTask task;
  const auto status = google::protobuf::util::JsonStringToMessage(text, &task);
  if (!status.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": not a trainer task: ", std::string(status.message())));
  }
  return task;
}

std::string TrainerEventLine(const v1::TrainerEvent& event) {
  std::string json;
  // Cannot fail: the event holds no Any and no map with non-string keys.
  (void)google::protobuf::util::MessageToJsonString(event, &json, PrintOptions());
  return json;
}

absl::StatusOr<v1::TrainerEvent> ParseTrainerEventLine(absl::string_view line) {
  v1::TrainerEvent event;
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = true;  // an older agent reads a newer trainer's events
  if (line.empty() || line.front() != '{' ||
      !google::protobuf::util::JsonStringToMessage(std::string(line), &event, options).ok() ||
      event.event_case() == v1::TrainerEvent::EVENT_NOT_SET) {
    return absl::InvalidArgumentError("not a trainer event");
  }
  return event;
}

absl::StatusOr<v1::ProfileRequest> ParseProfileRequest(absl::string_view text,
                                                       absl::string_view path) {
  v1::ProfileRequest request;
  const auto status = google::protobuf::util::JsonStringToMessage(std::string(text), &request);
  if (!status.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": not a profile request: ", std::string(status.message())));
  }
  return request;
}

}  // namespace lathe
