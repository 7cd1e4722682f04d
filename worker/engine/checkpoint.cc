#include "worker/engine/checkpoint.h"

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <limits>
#include <stdexcept>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "common/file_util.h"
#include "common/sha256.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

namespace lathe {
namespace {

namespace fs = std::filesystem;

constexpr char kTrainable[] = "trainable.safetensors";
constexpr char kOptimizer[] = "optimizer.safetensors";
constexpr char kState[] = "state.json";
constexpr char kManifest[] = "manifest.json";
constexpr char kStepPrefix[] = "step-";
constexpr char kFence[] = ".fence";

// What <dir>/.fence holds: the attempt that claimed the directory, and the newest step
// directory there when it did (checkpoints of older attempts up to that step are legitimate;
// beyond it they were committed late by a stale attempt).
struct FenceRecord {
  CheckpointFence holder;
  int64_t claimed_step = -1;
};

// The record of `dir`, or nullopt when no attempt has claimed it (or .fence is unreadable).
std::optional<FenceRecord> ReadFence(const std::string& dir) {
  absl::StatusOr<std::string> text = ReadFile(dir + "/" + kFence);
  if (!text.ok()) return std::nullopt;
  nlohmann::json json = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
  if (!json.is_object() || !json.contains("job_id") || !json["job_id"].is_string() ||
      !json.contains("generation") || !json["generation"].is_number_integer() ||
      !json.contains("claimed_step") || !json["claimed_step"].is_number_integer()) {
    return std::nullopt;
  }
  return FenceRecord{{json["job_id"].get<std::string>(), json["generation"].get<int64_t>()},
                     json["claimed_step"].get<int64_t>()};
}

// Step number of a "step-00000010" directory name, or -1.
int64_t StepOf(const std::string& name) {
  int64_t step = -1;
  if (!absl::StartsWith(name, kStepPrefix) ||
      !absl::SimpleAtoi(name.substr(sizeof(kStepPrefix) - 1), &step)) {
    return -1;
  }
  return step;
}

// The step directories of `dir` by step, newest first; `error` is set when `dir` cannot
// be read.
std::vector<std::pair<int64_t, fs::path>> StepDirs(const std::string& dir, std::error_code& error) {
  std::vector<std::pair<int64_t, fs::path>> steps;
  for (const fs::directory_entry& entry : fs::directory_iterator(dir, error)) {
    if (int64_t step = StepOf(entry.path().filename().string());
        step >= 0 && entry.is_directory()) {
      steps.emplace_back(step, entry.path());
    }
  }
  std::sort(steps.rbegin(), steps.rend());
  return steps;
}

// The generation whose save left the temporary directory `name` (".tmp-g3-step-..." 3,
// ".tmp-step-..." 0), or -1 when it is none.
int64_t TempDirGeneration(absl::string_view name) {
  if (!absl::ConsumePrefix(&name, ".tmp-")) return -1;
  int64_t generation = 0;
  if (absl::ConsumePrefix(&name, "g") &&
      !absl::SimpleAtoi(name.substr(0, name.find('-')), &generation)) {
    return -1;
  }
  return generation;
}

absl::Status WriteFence(const std::string& dir, const CheckpointFence& fence) {
  std::error_code error;
  const std::vector<std::pair<int64_t, fs::path>> steps = StepDirs(dir, error);
  nlohmann::ordered_json json;
  json["job_id"] = fence.job_id;
  json["generation"] = fence.generation;
  json["claimed_step"] = steps.empty() ? int64_t{0} : steps.front().first;
  return WriteFileAtomically(dir + "/" + kFence, json.dump() + "\n");
}

// True when `writer` committed a checkpoint of `step` after `record`'s attempt took over.
bool CommittedLate(const CheckpointFence& writer, int64_t step,
                   const std::optional<FenceRecord>& record) {
  return record && writer.generation > 0 && writer.job_id == record->holder.job_id &&
         writer.generation < record->holder.generation && step > record->claimed_step;
}

std::string Describe(const CheckpointFence& fence) {
  return absl::StrCat("job ", fence.job_id, " attempt ", fence.generation);
}

std::string StateJson(const TrainingState& state, const CheckpointFence& writer) {
  nlohmann::ordered_json json;
  json["format"] = 1;
  json["step"] = state.step;
  json["optimizer_steps"] = state.optimizer_steps;
  json["cursor"] = {{"epoch", state.cursor.epoch},
                    {"next_document", state.cursor.next_document},
                    {"offset_in_document", state.cursor.offset_in_document}};
  json["rng_state"] = absl::Base64Escape(state.rng_state);
  json["last_loss"] = state.last_loss ? nlohmann::json(*state.last_loss) : nlohmann::json(nullptr);
  json["loss_scale"] = {{"scale", state.loss_scale.scale},
                        {"clean_steps", state.loss_scale.clean_steps}};
  json["nonfinite_steps"] = {{"skipped", state.skipped_steps},
                             {"consecutive", state.consecutive_nonfinite}};
  json["spec_fingerprint"] = state.spec_fingerprint;
  if (state.shard_world > 0) json["shards"] = {{"world_size", state.shard_world}};
  if (writer.generation > 0) {  // which attempt wrote it (fencing; and for people)
    json["attempt"] = {{"job_id", writer.job_id}, {"generation", writer.generation}};
  }
  return json.dump(2) + "\n";
}

// json[key] as an int64; throws std::out_of_range (caught by the parser) for a value that
// is no integer or does not fit (a double such as 1e300 would overflow the conversion).
int64_t IntAt(const nlohmann::json& json, const char* key) {
  const nlohmann::json& value = json.at(key);
  if (!value.is_number_integer() ||
      (value.is_number_unsigned() &&
       value.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))) {
    throw std::out_of_range(absl::StrCat(key, " is not a 64-bit integer"));
  }
  return value.get<int64_t>();
}

}  // namespace

absl::StatusOr<TrainingState> ParseTrainingState(absl::string_view text, absl::string_view path) {
  nlohmann::json json = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  auto bad = [&path](absl::string_view what) {
    return absl::DataLossError(absl::StrCat(path, ": ", what));
  };
  if (!json.is_object() || !json.contains("format") || json["format"] != 1) {
    return bad("not a format-1 state");
  }
  TrainingState state;
  try {
    state.step = IntAt(json, "step");
    state.optimizer_steps = IntAt(json, "optimizer_steps");
    const nlohmann::json& cursor = json.at("cursor");
    state.cursor.epoch = IntAt(cursor, "epoch");
    state.cursor.next_document = IntAt(cursor, "next_document");
    state.cursor.offset_in_document = IntAt(cursor, "offset_in_document");
    if (!absl::Base64Unescape(json.at("rng_state").get<std::string>(), &state.rng_state)) {
      return bad("rng_state is not base64");
    }
    if (json.at("last_loss").is_number()) state.last_loss = json["last_loss"].get<double>();
    state.spec_fingerprint = json.at("spec_fingerprint").get<std::string>();
    // Absent from checkpoints written before precision support (fp32: scale 1).
    if (json.contains("loss_scale")) {
      state.loss_scale.scale = json["loss_scale"].at("scale").get<double>();
      state.loss_scale.clean_steps = IntAt(json["loss_scale"], "clean_steps");
    }
    if (json.contains("shards")) {
      state.shard_world = IntAt(json["shards"], "world_size");
      if (state.shard_world < 1) return bad("shards.world_size is below 1");
    }
    if (json.contains("attempt")) {
      state.writer.job_id = json["attempt"].at("job_id").get<std::string>();
      state.writer.generation = IntAt(json["attempt"], "generation");
    }
    if (json.contains("nonfinite_steps")) {
      state.skipped_steps = IntAt(json["nonfinite_steps"], "skipped");
      state.consecutive_nonfinite = IntAt(json["nonfinite_steps"], "consecutive");
    }
  } catch (const std::exception& e) {  // json's exceptions and IntAt's
    return bad(e.what());
  }
  return state;
}

absl::StatusOr<std::map<std::string, ManifestEntry>> ParseCheckpointManifest(
    absl::string_view text) {
  nlohmann::json manifest = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!manifest.is_object() || !manifest.contains("files") || !manifest["files"].is_object()) {
    return absl::DataLossError("manifest.json is malformed");
  }
  std::map<std::string, ManifestEntry> entries;
  for (const auto& [file, entry] : manifest["files"].items()) {
    if (file.empty() || file.find('/') != std::string::npos || file == "." || file == "..") {
      return absl::DataLossError(
          absl::StrCat("manifest.json names \"", absl::CHexEscape(file), "\""));
    }
    if (!entry.is_object() || !entry.contains("size") || !entry["size"].is_number_unsigned() ||
        !entry.contains("sha256") || !entry["sha256"].is_string()) {
      return absl::DataLossError(absl::StrCat(file, ": malformed manifest entry"));
    }
    entries[file] = {entry["size"].get<uint64_t>(), entry["sha256"].get<std::string>()};
  }
  if (!entries.count(kState)) return absl::DataLossError("state.json: not in the manifest");
  return entries;
}

CheckpointStore::CheckpointStore(std::string dir, int64_t keep, CheckpointFence fence)
    : dir_(std::move(dir)), keep_(keep), fence_(std::move(fence)) {}

absl::Status CheckpointStore::Claim() {
  if (fence_.generation == 0) return absl::OkStatus();
  std::error_code error;
  fs::create_directories(dir_, error);
  if (error) return absl::InternalError(absl::StrCat(dir_, ": ", error.message()));
  const std::optional<FenceRecord> record = ReadFence(dir_);
  if (record && record->holder.job_id == fence_.job_id) {
    if (record->holder.generation > fence_.generation) {
      return absl::FailedPreconditionError(
          absl::StrCat("checkpoints ", dir_, ": ", Describe(record->holder),
                       " has taken over from ", Describe(fence_), " (a stale attempt)"));
    }
    if (record->holder.generation == fence_.generation) return absl::OkStatus();
  }
  return WriteFence(dir_, fence_);
}

absl::Status CheckpointStore::CheckFence() {
  if (fence_.generation == 0) return absl::OkStatus();
  const std::optional<FenceRecord> record = ReadFence(dir_);
  if (!record) {
    std::error_code error;
    fs::create_directories(dir_, error);  // the directory was emptied: claim it again
    return WriteFence(dir_, fence_);
  }
  if (record->holder.job_id != fence_.job_id || record->holder.generation != fence_.generation) {
    return absl::FailedPreconditionError(absl::StrCat("checkpoints ", dir_, ": ",
                                                      Describe(record->holder), " has taken over; ",
                                                      Describe(fence_), " may no longer write"));
  }
  return absl::OkStatus();
}

absl::Status CheckpointStore::Fenced(const std::function<absl::Status()>& write) {
  LATHE_RETURN_IF_ERROR(CheckFence());
  return write();
}

std::string CheckpointStore::StepDir(int64_t step) const {
  return (fs::path(dir_) / absl::StrFormat("%s%08d", kStepPrefix, step)).string();
}

std::string ShardFileName(int64_t rank) { return absl::StrFormat("shard-%05d.safetensors", rank); }

std::string CheckpointStore::TempDir(int64_t step) const {
  const std::string attempt =
      fence_.generation > 0 ? absl::StrCat("g", fence_.generation, "-") : std::string();
  return (fs::path(dir_) /
          absl::StrCat(".tmp-", attempt, fs::path(StepDir(step)).filename().string()))
      .string();
}

absl::Status CheckpointStore::Prepare(int64_t step) {
  // A stale attempt learns it before writing anything (Commit checks again).
  LATHE_RETURN_IF_ERROR(CheckFence());
  std::error_code error;
  fs::create_directories(dir_, error);
  if (error) return absl::InternalError(absl::StrCat(dir_, ": ", error.message()));
  const std::string temp_dir = TempDir(step);
  fs::remove_all(temp_dir, error);
  fs::create_directory(temp_dir, error);
  if (error) return absl::InternalError(absl::StrCat(temp_dir, ": ", error.message()));
  return absl::OkStatus();
}

absl::Status CheckpointStore::Save(const TrainingState& state,
                                   absl::Span<const TensorToWrite> trainable,
                                   absl::Span<const TensorToWrite> optimizer) {
  LATHE_RETURN_IF_ERROR(Prepare(state.step));
  const std::string temp_dir = TempDir(state.step);
  absl::Status status = WriteSafetensors(temp_dir + "/" + kTrainable, trainable);
  if (status.ok()) status = WriteSafetensors(temp_dir + "/" + kOptimizer, optimizer);
  if (!status.ok()) {
    std::error_code error;
    fs::remove_all(temp_dir, error);
    return status;
  }
  return Commit(state);
}

absl::Status CheckpointStore::Commit(const TrainingState& state) {
  const std::string final_dir = StepDir(state.step);
  const std::string temp_dir = TempDir(state.step);
  auto write_all = [&]() -> absl::Status {
    LATHE_RETURN_IF_ERROR(WriteFileAtomically(temp_dir + "/" + kState, StateJson(state, fence_)));
    nlohmann::ordered_json manifest;
    manifest["format"] = 1;
    manifest["step"] = state.step;
    std::vector<std::string> files;
    for (const fs::directory_entry& entry : fs::directory_iterator(temp_dir)) {
      files.push_back(entry.path().filename().string());
    }
    std::sort(files.begin(), files.end());
    for (const std::string& file : files) {
      const std::string path = temp_dir + "/" + file;
      LATHE_ASSIGN_OR_RETURN(std::string sha, Sha256File(path));
      manifest["files"][file] = {{"size", fs::file_size(path)}, {"sha256", sha}};
    }
    LATHE_RETURN_IF_ERROR(WriteFileAtomically(temp_dir + "/" + kManifest, manifest.dump(2) + "\n"));
    LATHE_RETURN_IF_ERROR(CheckFence());
    return Publish(state);
  };
  absl::Status status;
  try {
    status = write_all();
  } catch (const fs::filesystem_error& e) {
    status = absl::InternalError(absl::StrCat("writing checkpoint ", final_dir, ": ", e.what()));
  }
  if (!status.ok()) {
    std::error_code error;
    fs::remove_all(temp_dir, error);
  }
  return status;
}

absl::Status CheckpointStore::Publish(const TrainingState& state) {
  const std::string final_dir = StepDir(state.step);
  fs::remove_all(final_dir);  // a checkpoint of the same step from before a resume
  fs::rename(TempDir(state.step), final_dir);
  LATHE_RETURN_IF_ERROR(SyncDirectory(dir_));
  // Taken over since the check (this process was paused in between): what landed is
  // ignored by loaders (CommittedLate), and nothing is pruned.
  LATHE_RETURN_IF_ERROR(CheckFence());
  // Keep the newest `keep_` complete checkpoints; drop late commits of stale attempts and
  // leftovers of interrupted saves of this attempt and older ones.
  const std::optional<FenceRecord> record =
      fence_.generation > 0 ? ReadFence(dir_) : std::optional<FenceRecord>();
  std::error_code error;
  for (const fs::directory_entry& entry : fs::directory_iterator(dir_, error)) {
    const int64_t generation = TempDirGeneration(entry.path().filename().string());
    if (generation >= 0 && generation <= fence_.generation) fs::remove_all(entry.path(), error);
  }
  auto committed_late = [&](int64_t step, const fs::path& path) {
    if (!record) return false;  // unfenced: nothing is late
    absl::StatusOr<std::string> text = ReadFile((path / kState).string());
    absl::StatusOr<TrainingState> written =
        text.ok() ? ParseTrainingState(*text, path.string()) : text.status();
    return written.ok() && CommittedLate(written->writer, step, record);
  };
  int64_t kept = 0;
  for (const auto& [step, path] : StepDirs(dir_, error)) {
    if (committed_late(step, path) || ++kept > keep_) fs::remove_all(path, error);
  }
  return absl::OkStatus();
}

absl::StatusOr<LoadedCheckpoint> CheckpointStore::Load(const std::string& step_dir) const {
  const std::string manifest_path = step_dir + "/" + kManifest;
  absl::StatusOr<std::string> manifest_text = ReadFile(manifest_path);
  if (!manifest_text.ok()) return absl::DataLossError("no manifest (an interrupted save)");
  LATHE_ASSIGN_OR_RETURN(auto manifest, ParseCheckpointManifest(*manifest_text));
  for (const auto& [file, entry] : manifest) {
    const std::string path = step_dir + "/" + file;
    std::error_code error;
    const uintmax_t size = fs::file_size(path, error);
    if (error) return absl::DataLossError(absl::StrCat(file, ": missing"));
    if (size != entry.size) {
      return absl::DataLossError(
          absl::StrCat(file, ": ", size, " bytes, the manifest says ", entry.size));
    }
    LATHE_ASSIGN_OR_RETURN(std::string sha, Sha256File(path));
    if (sha != entry.sha256) return absl::DataLossError(absl::StrCat(file, ": SHA-256 mismatch"));
  }
  LoadedCheckpoint loaded;
  loaded.dir = step_dir;
  LATHE_ASSIGN_OR_RETURN(std::string state_text, ReadFile(step_dir + "/" + kState));
  LATHE_ASSIGN_OR_RETURN(loaded.state, ParseTrainingState(state_text, step_dir + "/" + kState));
  if (CommittedLate(loaded.state.writer, loaded.state.step, ReadFence(dir_))) {
    return absl::DataLossError(absl::StrCat("committed by ", Describe(loaded.state.writer),
                                            " after a later attempt took over"));
  }
  for (const auto& [file, entry] : manifest) {
    if (!absl::EndsWith(file, ".safetensors")) continue;
    LATHE_ASSIGN_OR_RETURN(loaded.files[file], SafetensorsFile::Open(step_dir + "/" + file));
  }
  auto find = [&loaded](const char* file) -> std::shared_ptr<const SafetensorsFile> {
    auto it = loaded.files.find(file);
    return it == loaded.files.end() ? nullptr : it->second;
  };
  loaded.trainable = find(kTrainable);
  loaded.optimizer = find(kOptimizer);
  if (loaded.state.shard_world == 0 && (!loaded.trainable || !loaded.optimizer)) {
    return absl::DataLossError(
        "trainable.safetensors or optimizer.safetensors: not in the manifest");
  }
  for (int64_t r = 0; r < loaded.state.shard_world; ++r) {
    if (!loaded.files.count(ShardFileName(r))) {
      return absl::DataLossError(absl::StrCat(ShardFileName(r), ": not in the manifest"));
    }
  }
  return loaded;
}

absl::StatusOr<std::optional<LoadedCheckpoint>> CheckpointStore::LoadNewest(
    std::vector<std::string>* rejected) const {
  std::error_code error;
  if (!fs::exists(dir_, error)) return std::optional<LoadedCheckpoint>();
  const std::vector<std::pair<int64_t, fs::path>> steps = StepDirs(dir_, error);
  if (error) return absl::InternalError(absl::StrCat(dir_, ": ", error.message()));
  for (const auto& [step, path] : steps) {
    absl::StatusOr<LoadedCheckpoint> loaded = Load(path.string());
    if (loaded.ok()) return std::optional<LoadedCheckpoint>(*std::move(loaded));
    if (rejected != nullptr) {
      rejected->push_back(absl::StrCat(path.filename().string(), ": ", loaded.status().message()));
    }
  }
  return std::optional<LoadedCheckpoint>();
}

}  // namespace lathe
