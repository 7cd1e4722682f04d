// Checkpoints of a training run, written so that a restart can trust them.
//
// A checkpoint is a directory <dir>/step-<8 digits>/ holding
//   trainable.safetensors   the trainable parameters by name (LoRA A/B, or every weight)
//   optimizer.safetensors   the optimizer's state by name ("exp_avg.<name>", ...; the names of
//                           docs/training.md, "Optimizers")
// or, written by a sharded run (worker/shard, docs/sharding.md), instead of those two
//   shard-<5 digits>.safetensors   each rank's slices of every unit's flat buffers
// and
//   state.json              step, optimizer step count, data cursor, RNG state, spec fingerprint
//                           (and the sharded run's world size, the attempt that wrote it)
//   manifest.json           size and SHA-256 of each file above; written last
// It is assembled in a temporary directory (every file fsynced, the manifest last), renamed
// into place and the parent directory fsynced, so a crash leaves either the complete
// checkpoint or none. Loading takes the newest checkpoint whose manifest verifies and falls
// back to older ones: a truncated file, a flipped byte or a missing manifest skips that one.
// After each save only the newest `keep` checkpoints remain.
//
// Fencing. A store made for an attempt (a job id and a generation > 0) claims the directory
// for it (Claim: <dir>/.fence names the attempt and the newest step there), and every save,
// the pruning after it and every Fenced write first check that the claim is still its own.
// Once a later attempt of the job, or another job, has claimed the directory, the old
// attempt's writes are refused with FAILED_PRECONDITION: a trainer paused through its
// attempt's end (a zombie, SIGSTOP then SIGCONT) cannot change what the next attempt
// resumes from or exports. There is no lock to wait on (a paused holder would block the next
// attempt forever); instead a save that passed its check just before the takeover and lands
// after it is recognised by its writer (state.json's "attempt"): loaders skip it, the next
// pruning deletes it, and its writer prunes nothing. Each attempt assembles its saves in
// temporary directories of its own (".tmp-g<generation>-step-...") and removes only its
// own and older attempts' leftovers. Generation 0 is unfenced (the standalone
// `lathe-worker train --spec`).
//
// No libtorch here: tensors come in as raw bytes and go out as mapped safetensors files.
//
// Thread-safety: not thread-safe; one trainer owns the store.
#ifndef LATHE_WORKER_ENGINE_CHECKPOINT_H_
#define LATHE_WORKER_ENGINE_CHECKPOINT_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/safetensors.h"
#include "worker/engine/loss_scaler.h"
#include "worker/engine/token_dataset.h"

namespace lathe {

// The attempt a store writes for; generation 0: unfenced.
struct CheckpointFence {
  std::string job_id;
  int64_t generation = 0;
};

struct TrainingState {
  int64_t step = 0;             // optimizer steps completed (the next step is step + 1)
  int64_t optimizer_steps = 0;  // AdamW's count: steps without targets do not count
  SequenceSampler::Cursor cursor;
  std::string rng_state;  // the CPU generator's state bytes (dropout)
  std::optional<double> last_loss;
  LossScaler::State loss_scale;
  int64_t skipped_steps = 0;          // steps skipped for a non-finite loss or gradient
  int64_t consecutive_nonfinite = 0;  // of which the last ones in a row
  std::string spec_fingerprint;       // the run this checkpoint belongs to
  // 0: named tensors (trainable/optimizer.safetensors); else the number of ranks whose
  // shard files hold the slices.
  int64_t shard_world = 0;
  // The attempt that wrote it (read from state.json; a store writes its own fence there).
  CheckpointFence writer;
};

// "shard-00003.safetensors": the slices rank 3 of a sharded run wrote.
std::string ShardFileName(int64_t rank);

// One file of a checkpoint's manifest.json.
struct ManifestEntry {
  uint64_t size = 0;
  std::string sha256;  // lowercase hex
};

// The files manifest.json lists, by name. DATA_LOSS naming what is wrong: not JSON, an
// entry without an unsigned size or a string sha256, a name with '/' or "..", no
// state.json. Untrusted input: never throws.
absl::StatusOr<std::map<std::string, ManifestEntry>> ParseCheckpointManifest(
    absl::string_view text);

// state.json's contents. DATA_LOSS naming `path` and the field when it is not a format-1
// state. Untrusted input: never throws.
absl::StatusOr<TrainingState> ParseTrainingState(absl::string_view text, absl::string_view path);

struct LoadedCheckpoint {
  std::string dir;
  TrainingState state;
  // Named tensors; null in a sharded checkpoint.
  std::shared_ptr<const SafetensorsFile> trainable;
  std::shared_ptr<const SafetensorsFile> optimizer;
  // Every safetensors file of the checkpoint by file name (the two above included).
  std::map<std::string, std::shared_ptr<const SafetensorsFile>> files;
};

class CheckpointStore {
 public:
  // `dir` is created on the first save or claim. REQUIRES: keep >= 1.
  CheckpointStore(std::string dir, int64_t keep, CheckpointFence fence = {});

  // Claims the directory for this store's attempt unless a later generation of the same
  // job holds it (FAILED_PRECONDITION naming both). No-op when unfenced. INTERNAL on I/O
  // errors.
  absl::Status Claim();

  // Runs `write` when the claim is still this store's; else FAILED_PRECONDITION without
  // running it. For outputs outside the store (the adapter, the model).
  absl::Status Fenced(const std::function<absl::Status()>& write);

  // Writes a checkpoint for `state.step` as described above, then deletes the oldest beyond
  // `keep`. INTERNAL (naming the file) on I/O errors; nothing partial is left then.
  absl::Status Save(const TrainingState& state, absl::Span<const TensorToWrite> trainable,
                    absl::Span<const TensorToWrite> optimizer);

  // A save in three parts, for ranks that each write their own file: one rank calls
  // Prepare, then every rank writes its files into TempDir(step) (WriteSafetensors fsyncs),
  // then, once all have, one rank calls Commit, which writes state.json and the manifest of
  // every file in the directory and moves it into place as Save does. INTERNAL naming the
  // directory or file on I/O errors; Commit removes the temporary directory then.
  std::string TempDir(int64_t step) const;
  absl::Status Prepare(int64_t step);
  absl::Status Commit(const TrainingState& state);

  // The newest checkpoint that verifies, or nullopt when there is none. Every checkpoint
  // skipped on the way is described in `rejected` ("step-00000020: trainable.safetensors:
  // SHA-256 mismatch"). INTERNAL when the directory cannot be read.
  absl::StatusOr<std::optional<LoadedCheckpoint>> LoadNewest(
      std::vector<std::string>* rejected) const;

  const std::string& dir() const { return dir_; }
  // Where the checkpoint of `step` is (or would be) kept.
  std::string StepDir(int64_t step) const;

 private:
  absl::StatusOr<LoadedCheckpoint> Load(const std::string& step_dir) const;
  // FAILED_PRECONDITION when another attempt has claimed the directory (claims it when the
  // claim is gone).
  absl::Status CheckFence();
  // Commit's rename and pruning, after the fence check.
  absl::Status Publish(const TrainingState& state);

  std::string dir_;
  int64_t keep_;
  CheckpointFence fence_;
};

}  // namespace lathe

#endif  // LATHE_WORKER_ENGINE_CHECKPOINT_H_
