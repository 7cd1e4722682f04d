// The job spec: what a user asks Lathe to do (docs/job-spec.md). Written in YAML or
// JSON; the proto JobSpec mirrors it. This module parses and validates the spec on its own
// (field types, ranges, required fields, unknown fields). Checks that need the model or
// the data (targets present, seq_len within max_position_embeddings, token ids within the
// vocabulary) belong to whoever opens those.
//
// Thread-safety: plain values and pure functions.
#ifndef LATHE_COMMON_JOB_SPEC_H_
#define LATHE_COMMON_JOB_SPEC_H_

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/strategy.h"

namespace lathe {

enum class Method { kLora, kFull, kQLora, kMezo };
enum class ScheduleKind { kCosine, kLinear, kConstant };
enum class OptimizerKind { kAdamW, kAdamW8bit, kAdafactor, kSgd };
enum class Precision { kFp32, kBf16, kFp16 };
enum class DeviceKind { kCpu, kCuda };

absl::string_view MethodName(Method method);
absl::string_view ScheduleKindName(ScheduleKind kind);
absl::string_view OptimizerKindName(OptimizerKind kind);
absl::string_view PrecisionName(Precision precision);
absl::string_view DeviceKindName(DeviceKind device);

struct ModelSpec {
  std::string path;  // Hugging Face model directory; required
};

struct DataSpec {
  std::string train;  // JSONL file; required
  std::string eval;   // optional JSONL file
  int64_t seq_len = 1024;
  bool pack = true;
};

struct LoraSpec {
  int64_t rank = 16;
  double alpha = 32.0;
  double dropout = 0.0;
  // PEFT's target_modules, as a list: a module is targeted when its full name
  // (model.layers.0.self_attn.q_proj) is an entry or ends with "." + entry; each entry names
  // a projection (IsProjectionModule) or ends with one. Empty, the default (with
  // targets_pattern empty too): every projection of the model (ProjectionModules, resolved
  // where the model is read). Unused when targets_pattern is set.
  std::vector<std::string> targets;
  // PEFT's target_modules, as a string (the spec's `targets: <string>`): "all-linear" (any
  // case; every linear layer but the output layer, i.e. every projection) or a regular
  // expression (ECMAScript) that a module's full name must match entirely. Empty: `targets`.
  std::string targets_pattern;
  // PEFT's rank_pattern and alpha_pattern, in the spec's order: a module whose full name
  // matches (.*\.)?(<pattern>) entirely takes the first matching entry's rank or alpha instead
  // of `rank` / `alpha` (peft.utils.other.get_pattern_key).
  std::vector<std::pair<std::string, int64_t>> rank_pattern;
  std::vector<std::pair<std::string, double>> alpha_pattern;
  bool use_rslora = false;  // scaling alpha/sqrt(rank) instead of alpha/rank
  // PEFT's modules_to_save: whole modules trained beside the adapters as float32 copies, the
  // base frozen (ResolveModulesToSave: embed_tokens / model.embed_tokens, lm_head), in the
  // spec's order, as adapter_config.json writes them. Methods lora and qlora only.
  std::vector<std::string> modules_to_save;
  // Optional PEFT adapter directory to start from instead of the random/zero init.
  std::string init_from;
};

// method: mezo (zeroth-order training, docs/training.md "MeZO"): what it trains and the
// perturbation's scale.
struct MezoSpec {
  Method trainable = Method::kLora;  // kLora (the lora: settings) or kFull
  double eps = 1e-3;
};

struct ScheduleSpec {
  ScheduleKind kind = ScheduleKind::kCosine;
  int64_t warmup_steps = 0;
};

struct TrainSpec {
  int64_t steps = 0;  // optimizer steps; exactly one of steps and epochs is > 0
  int64_t epochs = 0;
  int64_t global_batch = 8;  // sequences per optimizer step, over all ranks
  // train.micro_batch is the strategy's (JobSpec::strategy.micro_batch).
  double lr = 2.0e-4;
  ScheduleSpec schedule;
  OptimizerKind optimizer = OptimizerKind::kAdamW;
  double adam_beta1 = 0.9;
  double adam_beta2 = 0.999;
  double adam_eps = 1e-8;
  double weight_decay = 0.0;
  // sgd: momentum (0 = plain SGD) and Nesterov's variant (needs momentum > 0).
  double sgd_momentum = 0.0;
  bool sgd_nesterov = false;
  // adafactor: first moment (0 = none), the second moment's decay exponent (beta2 at step t
  // is 1 - t^decay_rate) and the update clipping threshold d.
  double adafactor_beta1 = 0.0;
  double adafactor_decay_rate = -0.8;
  double adafactor_clip_threshold = 1.0;
  // adafactor: the paper's relative step size instead of the schedule's lr: at step t,
  // max(1e-3, RMS(parameter)) * min(1e-2, 1 / sqrt(t)).
  bool adafactor_relative_step = false;
  // Optimizer state in host memory, paged to the device one tensor at a time for the step
  // (on the CPU the same copies stay within host memory).
  bool paged_optimizer = false;
  double max_grad_norm = 1.0;  // 0 disables clipping
  Precision precision = Precision::kFp32;
  uint64_t seed = 0;
  int64_t checkpoint_every = 0;  // 0 = no periodic checkpoints
  int64_t keep_checkpoints = 3;  // newest complete checkpoints kept; >= 1
  int64_t eval_every = 0;        // steps between eval-loss reports (data.eval); 0 = at the end
  // Consecutive steps with a non-finite loss or gradient (each one skipped) after which the
  // job fails; >= 1.
  int64_t max_nonfinite_steps = 10;
};

struct ResourcesSpec {
  int64_t ranks = 1;
  DeviceKind device = DeviceKind::kCpu;
  uint64_t memory_per_rank = 0;  // bytes; 0 = not given
};

struct JobSpec {
  std::string name;  // required; [A-Za-z0-9._-]{1,63}
  ModelSpec model;
  DataSpec data;
  Method method = Method::kLora;
  LoraSpec lora;
  MezoSpec mezo;  // method: mezo only
  TrainSpec train;
  ResourcesSpec resources;
  // The `strategy` section and train.micro_batch: each field fixed, or empty for the planner
  // ("auto"); all empty by default ("strategy: auto", "micro_batch: auto").
  StrategySpec strategy;
  int64_t priority = 0;
  int64_t max_restarts = 3;
  std::string output;  // required; directory for checkpoints and the adapter
};

// What a job trains: LoRA adapters (method lora or qlora, or mezo over lora) or every weight
// (method full, or mezo over full).
bool TrainsLora(const JobSpec& spec);
bool TrainsFullWeights(const JobSpec& spec);

// Parses and validates a spec in YAML or JSON. `source` names the file in messages.
// INVALID_ARGUMENT with a one-line message "<source>: <field.path>: <problem>" for:
// malformed YAML/JSON, a value of the wrong type, an unknown field (typos must not pass
// silently), an unknown enum value, and everything ValidateJobSpec refuses.
absl::StatusOr<JobSpec> ParseJobSpec(absl::string_view text, absl::string_view source);

// The value checks every spec passes, however it arrived (a file, or a proto through
// common/proto/job_spec_proto.h): INVALID_ARGUMENT "<source>: <field.path>: <problem>" for a
// missing required field, an out-of-range value (rank <= 0, lr <= 0, seq_len < 2, ranks < 1,
// dropout outside [0, 1), a non-finite number, an unknown LoRA target, ...) and fields that
// disagree (global_batch not divisible by micro_batch x ranks, both or neither of
// steps/epochs, and every other rule of ValidateStrategy). The first problem is reported.
absl::Status ValidateJobSpec(const JobSpec& spec, absl::string_view source);

// What ValidateStrategy needs of `spec` (its ranks, global batch and method), with `limits`.
StrategyContext StrategyContextOf(const JobSpec& spec, const StrategyLimits& limits = {});

// Reads and parses the file at `path`. NOT_FOUND naming the file when it is missing.
absl::StatusOr<JobSpec> LoadJobSpec(const std::string& path);

// The spec as one line of JSON in its own schema (docs/job-spec.md), every field present
// with its value (defaults filled in, enums in their lowercase words, a strategy field the
// planner chooses as "auto", memory_per_rank in bytes or null). ParseJobSpec reads it back to an
// equal spec.
std::string JobSpecToJson(const JobSpec& spec);

// Parses a byte size: a plain integer, or a number with a unit B, KB, MB, GB, TB (powers of
// 1000) or KiB, MiB, GiB, TiB (powers of 1024), e.g. "80GiB", "1.5GB". INVALID_ARGUMENT
// otherwise.
absl::StatusOr<uint64_t> ParseByteSize(absl::string_view text);

// "512 B", "1.50 KiB", "80.0 GiB" (powers of 1024, three significant digits).
std::string FormatBytes(uint64_t bytes);

}  // namespace lathe

#endif  // LATHE_COMMON_JOB_SPEC_H_
