#include "common/job_spec.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/file_util.h"
#include "common/json_fields.h"
#include "common/lora_targets.h"
#include "common/model_config.h"
#include "common/peft.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

namespace lathe {

absl::string_view MethodName(Method method) {
  switch (method) {
    case Method::kLora:
      return "lora";
    case Method::kFull:
      return "full";
    case Method::kQLora:
      return "qlora";
    case Method::kMezo:
      return "mezo";
  }
  return "unknown";
}

absl::string_view ScheduleKindName(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::kCosine:
      return "cosine";
    case ScheduleKind::kLinear:
      return "linear";
    case ScheduleKind::kConstant:
      return "constant";
  }
  return "unknown";
}

absl::string_view OptimizerKindName(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kAdamW:
      return "adamw";
    case OptimizerKind::kAdamW8bit:
      return "adamw8bit";
    case OptimizerKind::kAdafactor:
      return "adafactor";
    case OptimizerKind::kSgd:
      return "sgd";
  }
  return "unknown";
}

absl::string_view PrecisionName(Precision precision) {
  switch (precision) {
    case Precision::kFp32:
      return "fp32";
    case Precision::kBf16:
      return "bf16";
    case Precision::kFp16:
      return "fp16";
  }
  return "unknown";
}

absl::string_view DeviceKindName(DeviceKind device) {
  switch (device) {
    case DeviceKind::kCpu:
      return "cpu";
    case DeviceKind::kCuda:
      return "cuda";
  }
  return "unknown";
}

namespace {

// True for a scalar the author quoted (or tagged !!str): a string even when it reads like
// a number. JSON strings arrive this way, so "lr": "2e-4" is refused like lr: "2e-4".
bool IsStringScalar(const YAML::Node& node) {
  return node.Tag() == "!" || node.Tag() == "tag:yaml.org,2002:str";
}

bool IsDigits(absl::string_view text) {
  if (text.empty()) return false;
  for (char c : text) {
    if (!absl::ascii_isdigit(static_cast<unsigned char>(c))) return false;
  }
  return true;
}

// YAML 1.2 core-schema integer (decimal only): [-+]?[0-9]+.
bool LooksLikeInteger(absl::string_view text) {
  if (!text.empty() && (text[0] == '-' || text[0] == '+')) text.remove_prefix(1);
  return IsDigits(text);
}

// YAML 1.2 core-schema float without the special values:
// [-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?
bool LooksLikeFiniteNumber(absl::string_view text) {
  if (!text.empty() && (text[0] == '-' || text[0] == '+')) text.remove_prefix(1);
  size_t exponent = text.find_first_of("eE");
  absl::string_view mantissa = text.substr(0, exponent);
  if (exponent != absl::string_view::npos) {
    absl::string_view power = text.substr(exponent + 1);
    if (!power.empty() && (power[0] == '-' || power[0] == '+')) power.remove_prefix(1);
    if (!IsDigits(power)) return false;
  }
  size_t dot = mantissa.find('.');
  if (dot == absl::string_view::npos) return IsDigits(mantissa);
  absl::string_view whole = mantissa.substr(0, dot);
  absl::string_view fraction = mantissa.substr(dot + 1);
  if (whole.empty()) return IsDigits(fraction);
  return IsDigits(whole) && (fraction.empty() || IsDigits(fraction));
}

bool LooksLikeSpecialFloat(absl::string_view text) {
  if (!text.empty() && (text[0] == '-' || text[0] == '+')) text.remove_prefix(1);
  for (absl::string_view special : {".inf", ".Inf", ".INF", ".nan", ".NaN", ".NAN"}) {
    if (text == special) return true;
  }
  return false;
}

bool IsBoolText(absl::string_view text) {
  for (absl::string_view word : {"true", "True", "TRUE", "false", "False", "FALSE"}) {
    if (text == word) return true;
  }
  return false;
}

constexpr size_t kMaxShownChars = 40;

// `text` for an error message: escaped, and cut to one short line.
std::string Shown(absl::string_view text) {
  if (text.size() <= kMaxShownChars) return absl::CHexEscape(text);
  return absl::StrCat(absl::CHexEscape(text.substr(0, kMaxShownChars)), "...");
}

std::string Quoted(absl::string_view text) { return absl::StrCat("\"", Shown(text), "\""); }

// A map key for a field path: as it is when it is a short run of printable ASCII, else
// quoted and escaped ("\"\"" for the empty key).
std::string ShownKey(absl::string_view key) {
  bool plain = !key.empty() && key.size() <= kMaxShownChars;
  for (char c : key) plain = plain && absl::ascii_isprint(static_cast<unsigned char>(c));
  return plain ? std::string(key) : Quoted(key);
}

// Renders a value for an error message, kept to one short line.
std::string Describe(const YAML::Node& node) {
  switch (node.Type()) {
    case YAML::NodeType::Undefined:
    case YAML::NodeType::Null:
      return "null";
    case YAML::NodeType::Sequence:
      return "a list";
    case YAML::NodeType::Map:
      return "a map";
    case YAML::NodeType::Scalar:
      break;
  }
  const std::string& raw = node.Scalar();
  if (!IsStringScalar(node) &&
      (LooksLikeFiniteNumber(raw) || LooksLikeSpecialFloat(raw) || IsBoolText(raw))) {
    return Shown(raw);
  }
  return Quoted(raw);
}

template <typename T>
struct EnumValue {
  absl::string_view name;
  T value;
};

// Reads the fields of one spec. Every error is INVALID_ARGUMENT (but Prefixed's)
// "<source>: <field>: <problem>".
class SpecReader {
 public:
  explicit SpecReader(absl::string_view source) : source_(source) {}

  // An empty `field` is the document itself.
  absl::Status Error(absl::string_view field, absl::string_view problem) const {
    if (field.empty()) return absl::InvalidArgumentError(absl::StrCat(source_, ": ", problem));
    return absl::InvalidArgumentError(absl::StrCat(source_, ": ", field, ": ", problem));
  }

  // `status` (code kept) with the source before its message.
  absl::Status Prefixed(const absl::Status& status) const {
    return absl::Status(status.code(), absl::StrCat(source_, ": ", status.message()));
  }

  absl::Status Missing(absl::string_view field) const {
    return Error(field, "required field is missing");
  }

  // Checks that `node` is a map whose keys are scalars, unique and among `known`, so that
  // the caller can then look values up by key.
  absl::Status ExpectMap(const YAML::Node& node, absl::string_view field,
                         absl::Span<const absl::string_view> known) const {
    if (!node.IsMap()) return Error(field, absl::StrCat("expected a map, got ", Describe(node)));
    std::set<std::string> seen;
    for (const auto& entry : node) {
      if (!entry.first.IsScalar()) {
        return Error(field,
                     absl::StrCat("field names must be strings, got ", Describe(entry.first)));
      }
      const std::string& key = entry.first.Scalar();
      const std::string path = Join(field, ShownKey(key));
      bool is_known = false;
      for (absl::string_view name : known) is_known = is_known || name == key;
      if (!is_known) return Error(path, "unknown field");
      if (!seen.insert(key).second) return Error(path, "given more than once");
    }
    return absl::OkStatus();
  }

  static std::string Join(absl::string_view parent, absl::string_view key) {
    return parent.empty() ? std::string(key) : absl::StrCat(parent, ".", key);
  }

  absl::Status ReadString(const YAML::Node& node, absl::string_view field, std::string* out) const {
    if (!node.IsScalar()) {
      return Error(field, absl::StrCat("expected a string, got ", Describe(node)));
    }
    *out = node.Scalar();
    return absl::OkStatus();
  }

  absl::Status ReadNonEmptyString(const YAML::Node& node, absl::string_view field,
                                  std::string* out) const {
    LATHE_RETURN_IF_ERROR(ReadString(node, field, out));
    if (out->empty()) return Error(field, "must not be empty");
    return absl::OkStatus();
  }

  absl::Status ReadInt(const YAML::Node& node, absl::string_view field, int64_t* out) const {
    if (!node.IsScalar() || IsStringScalar(node) || !LooksLikeInteger(node.Scalar())) {
      return Error(field, absl::StrCat("expected an integer, got ", Describe(node)));
    }
    if (!absl::SimpleAtoi(node.Scalar(), out)) {
      return Error(field, absl::StrCat(node.Scalar(), " is out of range"));
    }
    return absl::OkStatus();
  }

  absl::Status ReadIntAtLeast(const YAML::Node& node, absl::string_view field, int64_t min,
                              int64_t* out) const {
    LATHE_RETURN_IF_ERROR(ReadInt(node, field, out));
    if (*out < min) return Error(field, absl::StrCat("must be >= ", min, ", got ", *out));
    return absl::OkStatus();
  }

  absl::Status ReadUint(const YAML::Node& node, absl::string_view field, uint64_t* out) const {
    if (!node.IsScalar() || IsStringScalar(node) || !LooksLikeInteger(node.Scalar())) {
      return Error(field, absl::StrCat("expected a non-negative integer, got ", Describe(node)));
    }
    if (node.Scalar()[0] == '-') {
      return Error(field, absl::StrCat("must be a non-negative integer, got ", node.Scalar()));
    }
    if (!absl::SimpleAtoi(node.Scalar(), out)) {
      return Error(field, absl::StrCat(node.Scalar(), " is out of range"));
    }
    return absl::OkStatus();
  }

  absl::Status ReadDouble(const YAML::Node& node, absl::string_view field, double* out) const {
    if (node.IsScalar() && !IsStringScalar(node) && LooksLikeSpecialFloat(node.Scalar())) {
      return Error(field, absl::StrCat("must be finite, got ", node.Scalar()));
    }
    if (!node.IsScalar() || IsStringScalar(node) || !LooksLikeFiniteNumber(node.Scalar()) ||
        !absl::SimpleAtod(node.Scalar(), out)) {
      return Error(field, absl::StrCat("expected a number, got ", Describe(node)));
    }
    if (!std::isfinite(*out)) {
      return Error(field, absl::StrCat(node.Scalar(), " is out of range"));
    }
    return absl::OkStatus();
  }

  absl::Status ReadBool(const YAML::Node& node, absl::string_view field, bool* out) const {
    if (node.IsScalar() && !IsStringScalar(node)) {
      const std::string& text = node.Scalar();
      if (text == "true" || text == "True" || text == "TRUE") {
        *out = true;
        return absl::OkStatus();
      }
      if (text == "false" || text == "False" || text == "FALSE") {
        *out = false;
        return absl::OkStatus();
      }
    }
    return Error(field, absl::StrCat("expected true or false, got ", Describe(node)));
  }

  template <typename T>
  absl::Status ReadEnum(const YAML::Node& node, absl::string_view field,
                        std::initializer_list<EnumValue<T>> values, T* out) const {
    std::vector<absl::string_view> names;
    for (const EnumValue<T>& value : values) {
      if (node.IsScalar() && node.Scalar() == value.name) {
        *out = value.value;
        return absl::OkStatus();
      }
      names.push_back(value.name);
    }
    return Error(field, absl::StrCat("unknown value ", Describe(node),
                                     " (expected one of: ", absl::StrJoin(names, ", "), ")"));
  }

 private:
  absl::string_view source_;
};

absl::Status ParseModel(const SpecReader& r, const YAML::Node& node, ModelSpec* model) {
  LATHE_RETURN_IF_ERROR(r.ExpectMap(node, "model", {"path"}));
  if (const YAML::Node v = node["path"]) {
    LATHE_RETURN_IF_ERROR(r.ReadNonEmptyString(v, "model.path", &model->path));
  }
  return absl::OkStatus();
}

absl::Status ParseData(const SpecReader& r, const YAML::Node& node, DataSpec* data) {
  LATHE_RETURN_IF_ERROR(r.ExpectMap(node, "data", {"train", "eval", "seq_len", "pack"}));
  if (const YAML::Node v = node["train"]) {
    LATHE_RETURN_IF_ERROR(r.ReadNonEmptyString(v, "data.train", &data->train));
  }
  if (const YAML::Node v = node["eval"]) {
    LATHE_RETURN_IF_ERROR(r.ReadString(v, "data.eval", &data->eval));
  }
  if (const YAML::Node v = node["seq_len"]) {
    LATHE_RETURN_IF_ERROR(r.ReadInt(v, "data.seq_len", &data->seq_len));
  }
  if (const YAML::Node v = node["pack"]) {
    LATHE_RETURN_IF_ERROR(r.ReadBool(v, "data.pack", &data->pack));
  }
  return absl::OkStatus();
}

// A list of module names, or a string: "all-linear" or a regular expression (PEFT's
// target_modules).
absl::Status ParseLoraTargets(const SpecReader& r, const YAML::Node& node, LoraSpec* lora) {
  constexpr absl::string_view kField = "lora.targets";
  std::vector<std::string>* targets = &lora->targets;
  if (node.IsScalar() && !node.IsNull()) {
    LATHE_RETURN_IF_ERROR(r.ReadString(node, kField, &lora->targets_pattern));
    if (lora->targets_pattern.empty()) return r.Error(kField, "must not be empty");
    targets->clear();
    return absl::OkStatus();
  }
  if (!node.IsSequence()) {
    return r.Error(kField, absl::StrCat("expected a list or a string (all-linear or a regular "
                                        "expression), got ",
                                        Describe(node)));
  }
  lora->targets_pattern.clear();
  if (node.size() == 0) return r.Error(kField, "must not be empty");
  targets->clear();
  for (size_t i = 0; i < node.size(); ++i) {
    std::string target;
    LATHE_RETURN_IF_ERROR(r.ReadString(node[i], absl::StrCat(kField, "[", i, "]"), &target));
    targets->push_back(std::move(target));
  }
  return absl::OkStatus();
}

// Whether `node` leaves PEFT's `option` off: null, or its default (false or empty where it
// has no other).
bool IsOff(const UnsupportedPeftOption& option, const YAML::Node& node) {
  if (node.IsNull()) return true;
  if (option.also_off.empty() && (node.IsMap() || node.IsSequence()) && node.size() == 0) {
    return true;
  }
  if (!node.IsScalar()) return false;
  if (option.also_off.empty()) return node.Scalar() == "false" && !IsStringScalar(node);
  const nlohmann::json also_off = nlohmann::json::parse(option.also_off);
  if (also_off.is_boolean()) {
    return !IsStringScalar(node) && node.Scalar() == (also_off.get<bool>() ? "true" : "false");
  }
  return also_off.is_string() && node.Scalar() == also_off.get<std::string>();
}

// A map from a pattern (a string) to a value that `read` reads, in the spec's order.
template <typename T, typename Read>
absl::Status ParsePatternMap(const SpecReader& r, const YAML::Node& node, absl::string_view field,
                             Read read, std::vector<std::pair<std::string, T>>* out) {
  if (!node.IsMap()) return r.Error(field, absl::StrCat("expected a map, got ", Describe(node)));
  out->clear();
  for (const auto& entry : node) {
    if (!entry.first.IsScalar()) {
      return r.Error(field, absl::StrCat("keys must be strings, got ", Describe(entry.first)));
    }
    const std::string& key = entry.first.Scalar();
    const std::string path = SpecReader::Join(field, ShownKey(key));
    for (const auto& seen : *out) {
      if (seen.first == key) return r.Error(path, "given more than once");
    }
    T value{};
    LATHE_RETURN_IF_ERROR(read(entry.second, path, &value));
    out->emplace_back(key, value);
  }
  return absl::OkStatus();
}

absl::Status ParseLora(const SpecReader& r, const YAML::Node& node, LoraSpec* lora) {
  std::vector<absl::string_view> known = {"rank",         "alpha",         "dropout",
                                          "targets",      "use_rslora",    "init_from",
                                          "rank_pattern", "alpha_pattern", "modules_to_save"};
  // PEFT's options that Lathe lacks: "not supported" rather than "unknown field"; written at
  // their default they say what Lathe does anyway.
  if (node.IsMap()) {
    for (const UnsupportedPeftOption& option : UnsupportedPeftOptions()) {
      const YAML::Node v = node[std::string(option.name)];
      if (!v) continue;
      if (!IsOff(option, v)) {
        return r.Error(
            absl::StrCat("lora.", option.name),
            absl::StrCat("PEFT's ", option.name, " is not supported by Lathe, got ", Describe(v)));
      }
      known.push_back(option.name);
    }
  }
  LATHE_RETURN_IF_ERROR(r.ExpectMap(node, "lora", known));
  if (const YAML::Node v = node["rank"]) {
    LATHE_RETURN_IF_ERROR(r.ReadInt(v, "lora.rank", &lora->rank));
  }
  if (const YAML::Node v = node["alpha"]) {
    LATHE_RETURN_IF_ERROR(r.ReadDouble(v, "lora.alpha", &lora->alpha));
  }
  if (const YAML::Node v = node["dropout"]) {
    LATHE_RETURN_IF_ERROR(r.ReadDouble(v, "lora.dropout", &lora->dropout));
  }
  // null: not given (every projection of the model), as JobSpecToJson writes it.
  if (const YAML::Node v = node["targets"]; v && !v.IsNull()) {
    LATHE_RETURN_IF_ERROR(ParseLoraTargets(r, v, lora));
  }
  if (const YAML::Node v = node["use_rslora"]) {
    LATHE_RETURN_IF_ERROR(r.ReadBool(v, "lora.use_rslora", &lora->use_rslora));
  }
  if (const YAML::Node v = node["modules_to_save"]) {
    constexpr absl::string_view kField = "lora.modules_to_save";
    if (!v.IsSequence()) {
      return r.Error(kField, absl::StrCat("expected a list, got ", Describe(v)));
    }
    lora->modules_to_save.clear();
    for (size_t i = 0; i < v.size(); ++i) {
      std::string module;
      LATHE_RETURN_IF_ERROR(r.ReadString(v[i], absl::StrCat(kField, "[", i, "]"), &module));
      lora->modules_to_save.push_back(std::move(module));
    }
  }
  if (const YAML::Node v = node["rank_pattern"]) {
    LATHE_RETURN_IF_ERROR(ParsePatternMap<int64_t>(
        r, v, "lora.rank_pattern",
        [&r](const YAML::Node& n, absl::string_view f, int64_t* out) {
          return r.ReadInt(n, f, out);
        },
        &lora->rank_pattern));
  }
  if (const YAML::Node v = node["alpha_pattern"]) {
    LATHE_RETURN_IF_ERROR(ParsePatternMap<double>(
        r, v, "lora.alpha_pattern",
        [&r](const YAML::Node& n, absl::string_view f, double* out) {
          return r.ReadDouble(n, f, out);
        },
        &lora->alpha_pattern));
  }
  if (const YAML::Node v = node["init_from"]) {
    LATHE_RETURN_IF_ERROR(r.ReadNonEmptyString(v, "lora.init_from", &lora->init_from));
  }
  return absl::OkStatus();
}

absl::Status ParseSchedule(const SpecReader& r, const YAML::Node& node, ScheduleSpec* schedule) {
  LATHE_RETURN_IF_ERROR(r.ExpectMap(node, "train.schedule", {"kind", "warmup_steps"}));
  if (const YAML::Node v = node["kind"]) {
    LATHE_RETURN_IF_ERROR(r.ReadEnum<ScheduleKind>(v, "train.schedule.kind",
                                                   {{"cosine", ScheduleKind::kCosine},
                                                    {"linear", ScheduleKind::kLinear},
                                                    {"constant", ScheduleKind::kConstant}},
                                                   &schedule->kind));
  }
  if (const YAML::Node v = node["warmup_steps"]) {
    LATHE_RETURN_IF_ERROR(r.ReadInt(v, "train.schedule.warmup_steps", &schedule->warmup_steps));
  }
  return absl::OkStatus();
}

// `micro_batch`: the strategy's (train.micro_batch); empty for "auto".
absl::Status ParseTrain(const SpecReader& r, const YAML::Node& node, TrainSpec* train,
                        std::optional<int64_t>* micro_batch) {
  LATHE_RETURN_IF_ERROR(r.ExpectMap(node, "train",
                                    {"steps",
                                     "epochs",
                                     "global_batch",
                                     "micro_batch",
                                     "lr",
                                     "schedule",
                                     "optimizer",
                                     "adam_beta1",
                                     "adam_beta2",
                                     "adam_eps",
                                     "weight_decay",
                                     "sgd_momentum",
                                     "sgd_nesterov",
                                     "adafactor_beta1",
                                     "adafactor_decay_rate",
                                     "adafactor_clip_threshold",
                                     "adafactor_relative_step",
                                     "paged_optimizer",
                                     "max_grad_norm",
                                     "precision",
                                     "seed",
                                     "checkpoint_every",
                                     "keep_checkpoints",
                                     "eval_every",
                                     "max_nonfinite_steps"}));
  if (const YAML::Node v = node["steps"]) {
    LATHE_RETURN_IF_ERROR(r.ReadInt(v, "train.steps", &train->steps));
  }
  if (const YAML::Node v = node["epochs"]) {
    LATHE_RETURN_IF_ERROR(r.ReadInt(v, "train.epochs", &train->epochs));
  }
  if (const YAML::Node v = node["global_batch"]) {
    LATHE_RETURN_IF_ERROR(r.ReadInt(v, "train.global_batch", &train->global_batch));
  }
  if (const YAML::Node v = node["micro_batch"]) {
    if (v.IsScalar() && v.Scalar() == "auto") {
      micro_batch->reset();
    } else if (!v.IsScalar() || IsStringScalar(v) || !LooksLikeInteger(v.Scalar())) {
      return r.Error("train.micro_batch",
                     absl::StrCat("expected an integer or \"auto\", got ", Describe(v)));
    } else {
      int64_t value = 0;
      LATHE_RETURN_IF_ERROR(r.ReadIntAtLeast(v, "train.micro_batch", 1, &value));
      *micro_batch = value;
    }
  }
  if (const YAML::Node v = node["lr"]) {
    LATHE_RETURN_IF_ERROR(r.ReadDouble(v, "train.lr", &train->lr));
  }
  if (const YAML::Node v = node["schedule"]) {
    LATHE_RETURN_IF_ERROR(ParseSchedule(r, v, &train->schedule));
  }
  if (const YAML::Node v = node["optimizer"]) {
    LATHE_RETURN_IF_ERROR(r.ReadEnum<OptimizerKind>(v, "train.optimizer",
                                                    {{"adamw", OptimizerKind::kAdamW},
                                                     {"adamw8bit", OptimizerKind::kAdamW8bit},
                                                     {"adafactor", OptimizerKind::kAdafactor},
                                                     {"sgd", OptimizerKind::kSgd}},
                                                    &train->optimizer));
  }
  if (const YAML::Node v = node["adam_beta1"]) {
    LATHE_RETURN_IF_ERROR(r.ReadDouble(v, "train.adam_beta1", &train->adam_beta1));
  }
  if (const YAML::Node v = node["adam_beta2"]) {
    LATHE_RETURN_IF_ERROR(r.ReadDouble(v, "train.adam_beta2", &train->adam_beta2));
  }
  if (const YAML::Node v = node["adam_eps"]) {
    LATHE_RETURN_IF_ERROR(r.ReadDouble(v, "train.adam_eps", &train->adam_eps));
  }
  if (const YAML::Node v = node["weight_decay"]) {
    LATHE_RETURN_IF_ERROR(r.ReadDouble(v, "train.weight_decay", &train->weight_decay));
  }
  if (const YAML::Node v = node["sgd_momentum"]) {
    LATHE_RETURN_IF_ERROR(r.ReadDouble(v, "train.sgd_momentum", &train->sgd_momentum));
  }
  if (const YAML::Node v = node["sgd_nesterov"]) {
    LATHE_RETURN_IF_ERROR(r.ReadBool(v, "train.sgd_nesterov", &train->sgd_nesterov));
  }
  if (const YAML::Node v = node["adafactor_beta1"]) {
    LATHE_RETURN_IF_ERROR(r.ReadDouble(v, "train.adafactor_beta1", &train->adafactor_beta1));
  }
  if (const YAML::Node v = node["adafactor_decay_rate"]) {
    LATHE_RETURN_IF_ERROR(
        r.ReadDouble(v, "train.adafactor_decay_rate", &train->adafactor_decay_rate));
  }
  if (const YAML::Node v = node["adafactor_clip_threshold"]) {
    LATHE_RETURN_IF_ERROR(
        r.ReadDouble(v, "train.adafactor_clip_threshold", &train->adafactor_clip_threshold));
  }
  if (const YAML::Node v = node["adafactor_relative_step"]) {
    LATHE_RETURN_IF_ERROR(
        r.ReadBool(v, "train.adafactor_relative_step", &train->adafactor_relative_step));
  }
  if (const YAML::Node v = node["paged_optimizer"]) {
    LATHE_RETURN_IF_ERROR(r.ReadBool(v, "train.paged_optimizer", &train->paged_optimizer));
  }
  if (const YAML::Node v = node["max_grad_norm"]) {
    LATHE_RETURN_IF_ERROR(r.ReadDouble(v, "train.max_grad_norm", &train->max_grad_norm));
  }
  if (const YAML::Node v = node["precision"]) {
    LATHE_RETURN_IF_ERROR(r.ReadEnum<Precision>(
        v, "train.precision",
        {{"fp32", Precision::kFp32}, {"bf16", Precision::kBf16}, {"fp16", Precision::kFp16}},
        &train->precision));
  }
  if (const YAML::Node v = node["seed"]) {
    LATHE_RETURN_IF_ERROR(r.ReadUint(v, "train.seed", &train->seed));
  }
  if (const YAML::Node v = node["checkpoint_every"]) {
    LATHE_RETURN_IF_ERROR(r.ReadInt(v, "train.checkpoint_every", &train->checkpoint_every));
  }
  if (const YAML::Node v = node["keep_checkpoints"]) {
    LATHE_RETURN_IF_ERROR(r.ReadInt(v, "train.keep_checkpoints", &train->keep_checkpoints));
  }
  if (const YAML::Node v = node["eval_every"]) {
    LATHE_RETURN_IF_ERROR(r.ReadInt(v, "train.eval_every", &train->eval_every));
  }
  if (const YAML::Node v = node["max_nonfinite_steps"]) {
    LATHE_RETURN_IF_ERROR(r.ReadInt(v, "train.max_nonfinite_steps", &train->max_nonfinite_steps));
  }
  return absl::OkStatus();
}

absl::Status ParseResources(const SpecReader& r, const YAML::Node& node, ResourcesSpec* resources) {
  LATHE_RETURN_IF_ERROR(r.ExpectMap(node, "resources", {"ranks", "device", "memory_per_rank"}));
  if (const YAML::Node v = node["ranks"]) {
    LATHE_RETURN_IF_ERROR(r.ReadInt(v, "resources.ranks", &resources->ranks));
  }
  if (const YAML::Node v = node["device"]) {
    LATHE_RETURN_IF_ERROR(r.ReadEnum<DeviceKind>(
        v, "resources.device", {{"cpu", DeviceKind::kCpu}, {"cuda", DeviceKind::kCuda}},
        &resources->device));
  }
  // null: not given, as JobSpecToJson writes it.
  if (const YAML::Node v = node["memory_per_rank"]; v && !v.IsNull()) {
    constexpr absl::string_view kField = "resources.memory_per_rank";
    if (!v.IsScalar()) {
      return r.Error(kField, absl::StrCat("expected a byte size such as 80GiB, got ", Describe(v)));
    }
    absl::StatusOr<uint64_t> bytes = ParseByteSize(v.Scalar());
    if (!bytes.ok()) return r.Error(kField, bytes.status().message());
    if (*bytes == 0) return r.Error(kField, "must be > 0");
    resources->memory_per_rank = *bytes;
  }
  return absl::OkStatus();
}

// "auto" leaves every field but the micro-batch to the planner; in a map, a field given as
// `auto` is the planner's and a field left out is fixed at its default.
absl::Status ParseStrategy(const SpecReader& r, const YAML::Node& node, StrategySpec* strategy) {
  if (node.IsScalar() && node.Scalar() == "auto") {
    const std::optional<int64_t> micro_batch = strategy->micro_batch;
    *strategy = StrategySpec();
    strategy->micro_batch = micro_batch;
    return absl::OkStatus();
  }
  if (!node.IsMap()) {
    return r.Error("strategy", absl::StrCat("expected \"auto\" or a map, got ", Describe(node)));
  }
  LATHE_RETURN_IF_ERROR(r.ExpectMap(node, "strategy",
                                    {"zero_stage", "offload_optimizer", "offload_params",
                                     "activation_checkpointing", "chunked_loss", "fused_kernels"}));
  auto read = [&](absl::string_view name, auto* field) -> absl::Status {
    using T = typename std::remove_reference_t<decltype(*field)>::value_type;
    const std::string path = absl::StrCat("strategy.", name);
    const YAML::Node v = node[std::string(name)];
    *field = T{};
    if (!v) return absl::OkStatus();
    if (v.IsScalar() && v.Scalar() == "auto") {
      field->reset();
      return absl::OkStatus();
    }
    T value{};
    if constexpr (std::is_same_v<T, bool>) {
      LATHE_RETURN_IF_ERROR(r.ReadBool(v, path, &value));
    } else {
      LATHE_RETURN_IF_ERROR(r.ReadInt(v, path, &value));
    }
    *field = value;
    return absl::OkStatus();
  };
  LATHE_RETURN_IF_ERROR(read("zero_stage", &strategy->zero_stage));
  LATHE_RETURN_IF_ERROR(read("offload_optimizer", &strategy->offload_optimizer));
  LATHE_RETURN_IF_ERROR(read("offload_params", &strategy->offload_params));
  LATHE_RETURN_IF_ERROR(read("activation_checkpointing", &strategy->activation_checkpointing));
  LATHE_RETURN_IF_ERROR(read("chunked_loss", &strategy->chunked_loss));
  if (const YAML::Node v = node["fused_kernels"]) {
    LATHE_RETURN_IF_ERROR(r.ReadBool(v, "strategy.fused_kernels", &strategy->fused_kernels));
  }
  return absl::OkStatus();
}

bool IsValidJobName(absl::string_view name) {
  if (name.empty() || name.size() > 63) return false;
  for (char c : name) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-') {
      return false;
    }
  }
  return true;
}

// The longest path a spec may name (Linux's PATH_MAX).
constexpr size_t kMaxPathBytes = 4096;

// The value checks of ValidateJobSpec, each naming its field.
class ValueChecker {
 public:
  explicit ValueChecker(const SpecReader& r) : r_(r) {}

  absl::Status AtLeast(absl::string_view field, int64_t value, int64_t min) const {
    if (value >= min) return absl::OkStatus();
    return r_.Error(field, absl::StrCat("must be >= ", min, ", got ", value));
  }
  // min <= value <= max: sizes are bounded so that no product of them overflows and no
  // allocation they size is absurd (a spec is untrusted input).
  absl::Status Between(absl::string_view field, int64_t value, int64_t min, int64_t max) const {
    if (value >= min && value <= max) return absl::OkStatus();
    if (value < min) return AtLeast(field, value, min);
    return r_.Error(field, absl::StrCat("must be <= ", max, ", got ", value));
  }
  absl::Status ShortPath(absl::string_view field, const std::string& path) const {
    if (path.size() <= kMaxPathBytes) return absl::OkStatus();
    return r_.Error(field,
                    absl::StrCat("must be at most ", kMaxPathBytes, " bytes, got ", path.size()));
  }
  // value > min (or >= min when `inclusive`), and < max when given; finite.
  absl::Status InRange(absl::string_view field, double value, double min, bool inclusive,
                       std::optional<double> max = std::nullopt) const {
    if (!std::isfinite(value)) return r_.Error(field, absl::StrCat("must be finite, got ", value));
    const bool above = inclusive ? value >= min : value > min;
    if (above && (!max.has_value() || value < *max)) return absl::OkStatus();
    if (max.has_value()) {
      return r_.Error(field, absl::StrCat("must be in ", inclusive ? "[" : "(", min, ", ", *max,
                                          "), got ", value));
    }
    return r_.Error(field,
                    absl::StrCat("must be ", inclusive ? ">= " : "> ", min, ", got ", value));
  }
  absl::Status Present(absl::string_view field, const std::string& value) const {
    return value.empty() ? r_.Missing(field) : absl::OkStatus();
  }

 private:
  const SpecReader& r_;
};

// The model-independent checks; which modules the targets select is known where the model is
// opened (common/lora_targets.h).
absl::Status ValidateLoraTargets(const SpecReader& r, const LoraSpec& lora) {
  constexpr absl::string_view kField = "lora.targets";
  if (!lora.targets_pattern.empty()) {
    absl::Status pattern = CheckLoraTargetsPattern(lora.targets_pattern);
    return pattern.ok() ? pattern : r.Error(kField, pattern.message());
  }
  // Empty: every projection of the model. Names are checked against the model's own
  // projections where it is opened (MatchLoraTargets); here, against every architecture's.
  const std::vector<std::string>& targets = lora.targets;
  for (size_t i = 0; i < targets.size(); ++i) {
    const std::string field = absl::StrCat(kField, "[", i, "]");
    // A module name, or a dotted suffix of a full name (self_attn.q_proj,
    // model.layers.0.self_attn.q_proj), as PEFT matches list entries.
    const size_t dot = targets[i].rfind('.');
    const absl::string_view module = dot == std::string::npos
                                         ? absl::string_view(targets[i])
                                         : absl::string_view(targets[i]).substr(dot + 1);
    if (!IsProjectionModule(module)) {
      return r.Error(field,
                     absl::StrCat("unknown module ", Quoted(targets[i]), " (expected one of: ",
                                  absl::StrJoin(AllProjectionModules(), ", "), ")"));
    }
    for (size_t j = 0; j < i; ++j) {
      if (targets[j] == targets[i])
        return r.Error(field, absl::StrCat("duplicate ", Quoted(targets[i])));
    }
  }
  return absl::OkStatus();
}

absl::Status Validate(const SpecReader& r, const JobSpec& spec) {
  const ValueChecker check(r);
  LATHE_RETURN_IF_ERROR(check.Present("name", spec.name));
  if (!IsValidJobName(spec.name)) {
    return r.Error("name", absl::StrCat(Quoted(spec.name),
                                        " must be 1 to 63 characters from A-Z a-z 0-9 . _ -"));
  }
  LATHE_RETURN_IF_ERROR(check.Present("model.path", spec.model.path));
  LATHE_RETURN_IF_ERROR(check.Present("data.train", spec.data.train));
  LATHE_RETURN_IF_ERROR(check.Between("data.seq_len", spec.data.seq_len, 2, 1 << 20));
  for (const auto& [field, path] :
       {std::pair{"model.path", &spec.model.path}, std::pair{"data.train", &spec.data.train},
        std::pair{"data.eval", &spec.data.eval}, std::pair{"lora.init_from", &spec.lora.init_from},
        std::pair{"output", &spec.output}}) {
    LATHE_RETURN_IF_ERROR(check.ShortPath(field, *path));
  }

  const LoraSpec& lora = spec.lora;
  LATHE_RETURN_IF_ERROR(check.Between("lora.rank", lora.rank, 1, 1 << 16));
  LATHE_RETURN_IF_ERROR(check.InRange("lora.alpha", lora.alpha, 0, false));
  LATHE_RETURN_IF_ERROR(check.InRange("lora.dropout", lora.dropout, 0, true, 1.0));
  LATHE_RETURN_IF_ERROR(ValidateLoraTargets(r, lora));
  for (const auto& [key, rank] : lora.rank_pattern) {
    LATHE_RETURN_IF_ERROR(
        check.Between(SpecReader::Join("lora.rank_pattern", ShownKey(key)), rank, 1, 1 << 16));
  }
  for (const auto& [key, alpha] : lora.alpha_pattern) {
    LATHE_RETURN_IF_ERROR(
        check.InRange(SpecReader::Join("lora.alpha_pattern", ShownKey(key)), alpha, 0, false));
  }
  if (absl::Status keys = CheckLoraPatternKeys(lora); !keys.ok()) {
    return r.Error("", keys.message());
  }
  if (!lora.modules_to_save.empty()) {
    // Every supported family has model.embed_tokens and lm_head, and no other module PEFT
    // could save whole here; LoRA targets are projections only, so no module is both.
    if (absl::StatusOr<SavedModules> saved = ResolveModulesToSave(lora.modules_to_save);
        !saved.ok()) {
      return r.Error("lora.modules_to_save", saved.status().message());
    }
    if (spec.method != Method::kLora && spec.method != Method::kQLora) {
      return r.Error("lora.modules_to_save",
                     absl::StrCat("only with method lora or qlora, not ", MethodName(spec.method)));
    }
  }

  const TrainSpec& train = spec.train;
  if (spec.method == Method::kMezo) {
    LATHE_RETURN_IF_ERROR(check.InRange("mezo.eps", spec.mezo.eps, 0, false));
    if (spec.mezo.trainable != Method::kLora && spec.mezo.trainable != Method::kFull) {
      return r.Error("mezo.trainable", "must be lora or full");
    }
    if (train.optimizer != OptimizerKind::kAdamW) {
      return r.Error("train.optimizer",
                     absl::StrCat(OptimizerKindName(train.optimizer),
                                  ": method mezo has its own update (leave train.optimizer out)"));
    }
    if (train.paged_optimizer) {
      return r.Error("train.paged_optimizer", "method mezo keeps no optimizer state");
    }
    if (train.precision == Precision::kFp16) {
      return r.Error("train.precision",
                     "fp16 does not go with method mezo (no loss scaling "
                     "without a backward pass): use fp32 or bf16");
    }
  }
  LATHE_RETURN_IF_ERROR(check.Between("train.steps", train.steps, 0, 1'000'000'000));
  LATHE_RETURN_IF_ERROR(check.Between("train.epochs", train.epochs, 0, 1'000'000));
  LATHE_RETURN_IF_ERROR(check.Between("train.global_batch", train.global_batch, 1, 1 << 20));
  if (spec.strategy.micro_batch) {
    LATHE_RETURN_IF_ERROR(
        check.Between("train.micro_batch", *spec.strategy.micro_batch, 1, 1 << 20));
  }
  LATHE_RETURN_IF_ERROR(check.InRange("train.lr", train.lr, 0, false));
  LATHE_RETURN_IF_ERROR(
      check.AtLeast("train.schedule.warmup_steps", train.schedule.warmup_steps, 0));
  LATHE_RETURN_IF_ERROR(check.InRange("train.adam_beta1", train.adam_beta1, 0, true, 1.0));
  LATHE_RETURN_IF_ERROR(check.InRange("train.adam_beta2", train.adam_beta2, 0, true, 1.0));
  LATHE_RETURN_IF_ERROR(check.InRange("train.adam_eps", train.adam_eps, 0, false));
  LATHE_RETURN_IF_ERROR(check.InRange("train.weight_decay", train.weight_decay, 0, true));
  LATHE_RETURN_IF_ERROR(check.InRange("train.sgd_momentum", train.sgd_momentum, 0, true, 1.0));
  if (train.sgd_nesterov && train.sgd_momentum == 0.0) {
    return r.Error("train.sgd_nesterov", "needs train.sgd_momentum > 0");
  }
  LATHE_RETURN_IF_ERROR(
      check.InRange("train.adafactor_beta1", train.adafactor_beta1, 0, true, 1.0));
  LATHE_RETURN_IF_ERROR(
      check.InRange("train.adafactor_decay_rate", train.adafactor_decay_rate, -1, true, 0.0));
  LATHE_RETURN_IF_ERROR(
      check.InRange("train.adafactor_clip_threshold", train.adafactor_clip_threshold, 0, false));
  LATHE_RETURN_IF_ERROR(check.InRange("train.max_grad_norm", train.max_grad_norm, 0, true));
  LATHE_RETURN_IF_ERROR(check.AtLeast("train.checkpoint_every", train.checkpoint_every, 0));
  LATHE_RETURN_IF_ERROR(check.Between("train.keep_checkpoints", train.keep_checkpoints, 1, 1000));
  LATHE_RETURN_IF_ERROR(check.AtLeast("train.eval_every", train.eval_every, 0));
  LATHE_RETURN_IF_ERROR(check.AtLeast("train.max_nonfinite_steps", train.max_nonfinite_steps, 1));
  LATHE_RETURN_IF_ERROR(check.Between("resources.ranks", spec.resources.ranks, 1, 4096));

  LATHE_RETURN_IF_ERROR(check.Between("max_restarts", spec.max_restarts, 0, 100));
  LATHE_RETURN_IF_ERROR(check.Present("output", spec.output));

  // Checks that involve more than one field.
  if ((train.steps > 0) == (train.epochs > 0)) {
    return r.Error("train.steps",
                   absl::StrCat("exactly one of train.steps and train.epochs must be > 0, got ",
                                train.steps > 0 ? "both" : "neither"));
  }
  if (train.steps > 0 && train.schedule.warmup_steps >= train.steps) {
    return r.Error(
        "train.schedule.warmup_steps",
        absl::StrCat("must be < train.steps ", train.steps, ", got ", train.schedule.warmup_steps));
  }
  const int64_t ranks = spec.resources.ranks;
  if (train.global_batch % ranks != 0) {
    return r.Error(
        "train.global_batch",
        absl::StrCat(train.global_batch, " is not divisible by resources.ranks ", ranks));
  }
  // Within the default limits every rule is INVALID_ARGUMENT.
  if (absl::Status strategy = ValidateStrategy(spec.strategy, StrategyContextOf(spec));
      !strategy.ok()) {
    return r.Prefixed(strategy);
  }
  return absl::OkStatus();
}

absl::StatusOr<JobSpec> ParseRoot(const SpecReader& r, const YAML::Node& root,
                                  absl::string_view source) {
  if (root.IsNull()) return absl::InvalidArgumentError(absl::StrCat(source, ": empty job spec"));
  if (!root.IsMap()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": expected a map at the top level, got ", Describe(root)));
  }
  LATHE_RETURN_IF_ERROR(
      r.ExpectMap(root, "",
                  {"name", "model", "data", "method", "lora", "mezo", "train", "resources",
                   "strategy", "priority", "max_restarts", "output"}));
  JobSpec spec;
  if (const YAML::Node v = root["name"]) {
    LATHE_RETURN_IF_ERROR(r.ReadString(v, "name", &spec.name));
  }
  if (const YAML::Node v = root["model"]) {
    LATHE_RETURN_IF_ERROR(ParseModel(r, v, &spec.model));
  }
  if (const YAML::Node v = root["data"]) {
    LATHE_RETURN_IF_ERROR(ParseData(r, v, &spec.data));
  }
  if (const YAML::Node v = root["method"]) {
    LATHE_RETURN_IF_ERROR(r.ReadEnum<Method>(v, "method",
                                             {{"lora", Method::kLora},
                                              {"full", Method::kFull},
                                              {"qlora", Method::kQLora},
                                              {"mezo", Method::kMezo}},
                                             &spec.method));
  }
  if (const YAML::Node v = root["mezo"]) {
    if (spec.method != Method::kMezo) return r.Error("mezo", "is for method: mezo only");
    LATHE_RETURN_IF_ERROR(r.ExpectMap(v, "mezo", {"trainable", "eps"}));
    if (const YAML::Node t = v["trainable"]) {
      LATHE_RETURN_IF_ERROR(r.ReadEnum<Method>(t, "mezo.trainable",
                                               {{"lora", Method::kLora}, {"full", Method::kFull}},
                                               &spec.mezo.trainable));
    }
    if (const YAML::Node e = v["eps"]) {
      LATHE_RETURN_IF_ERROR(r.ReadDouble(e, "mezo.eps", &spec.mezo.eps));
    }
  }
  if (const YAML::Node v = root["lora"]) {
    LATHE_RETURN_IF_ERROR(ParseLora(r, v, &spec.lora));
  }
  if (const YAML::Node v = root["train"]) {
    LATHE_RETURN_IF_ERROR(ParseTrain(r, v, &spec.train, &spec.strategy.micro_batch));
  }
  if (const YAML::Node v = root["resources"]) {
    LATHE_RETURN_IF_ERROR(ParseResources(r, v, &spec.resources));
  }
  if (const YAML::Node v = root["strategy"]) {
    LATHE_RETURN_IF_ERROR(ParseStrategy(r, v, &spec.strategy));
  }
  if (const YAML::Node v = root["priority"]) {
    LATHE_RETURN_IF_ERROR(r.ReadInt(v, "priority", &spec.priority));
  }
  if (const YAML::Node v = root["max_restarts"]) {
    LATHE_RETURN_IF_ERROR(r.ReadInt(v, "max_restarts", &spec.max_restarts));
  }
  if (const YAML::Node v = root["output"]) {
    LATHE_RETURN_IF_ERROR(r.ReadNonEmptyString(v, "output", &spec.output));
  }
  LATHE_RETURN_IF_ERROR(Validate(r, spec));
  return spec;
}

}  // namespace

bool TrainsLora(const JobSpec& spec) {
  return spec.method == Method::kLora || spec.method == Method::kQLora ||
         (spec.method == Method::kMezo && spec.mezo.trainable == Method::kLora);
}

bool TrainsFullWeights(const JobSpec& spec) {
  return spec.method == Method::kFull ||
         (spec.method == Method::kMezo && spec.mezo.trainable == Method::kFull);
}

absl::StatusOr<JobSpec> ParseJobSpec(absl::string_view text, absl::string_view source) {
  // yaml-cpp reports errors only by exception; they are caught here, at the boundary.
  YAML::Node root;
  try {
    root = YAML::Load(std::string(text));
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": line ", e.mark.line + 1, ", column ",
                                                   e.mark.column + 1,
                                                   ": invalid YAML: ", PrintableAscii(e.msg)));
  }
  SpecReader reader(source);
  try {
    return ParseRoot(reader, root, source);
  } catch (const YAML::Exception& e) {
    // Not expected: the reader checks node types before every access.
    return absl::InvalidArgumentError(absl::StrCat(source, ": ", PrintableAscii(e.what())));
  }
}

absl::Status ValidateJobSpec(const JobSpec& spec, absl::string_view source) {
  return Validate(SpecReader(source), spec);
}

absl::StatusOr<JobSpec> LoadJobSpec(const std::string& path) {
  LATHE_ASSIGN_OR_RETURN(std::string text, ReadFile(path));
  return ParseJobSpec(text, path);
}

// A rank or alpha pattern as a JSON object, in its order.
template <typename T>
nlohmann::ordered_json PatternJson(const std::vector<std::pair<std::string, T>>& entries) {
  nlohmann::ordered_json json = nlohmann::ordered_json::object();
  for (const auto& [key, value] : entries) json[key] = value;
  return json;
}

std::string JobSpecToJson(const JobSpec& spec) {
  using Json = nlohmann::ordered_json;
  auto name = [](absl::string_view word) { return std::string(word); };
  const TrainSpec& t = spec.train;
  const StrategySpec& s = spec.strategy;
  auto or_auto = [](const auto& field) { return field ? Json(*field) : Json("auto"); };
  Json strategy = "auto";
  if (!IsAutomatic(s) || !s.fused_kernels) {
    strategy = {{"zero_stage", or_auto(s.zero_stage)},
                {"offload_optimizer", or_auto(s.offload_optimizer)},
                {"offload_params", or_auto(s.offload_params)},
                {"activation_checkpointing", or_auto(s.activation_checkpointing)},
                {"chunked_loss", or_auto(s.chunked_loss)},
                {"fused_kernels", s.fused_kernels}};
  }
  Json out = {
      {"name", spec.name},
      {"model", {{"path", spec.model.path}}},
      {"data",
       {{"train", spec.data.train},
        {"eval", spec.data.eval},
        {"seq_len", spec.data.seq_len},
        {"pack", spec.data.pack}}},
      {"method", name(MethodName(spec.method))},
      {"lora",
       {{"rank", spec.lora.rank},
        {"alpha", spec.lora.alpha},
        {"dropout", spec.lora.dropout},
        {"targets", !spec.lora.targets_pattern.empty() ? Json(spec.lora.targets_pattern)
                    : spec.lora.targets.empty()        ? Json(nullptr)
                                                       : Json(spec.lora.targets)},
        {"rank_pattern", PatternJson(spec.lora.rank_pattern)},
        {"alpha_pattern", PatternJson(spec.lora.alpha_pattern)},
        {"use_rslora", spec.lora.use_rslora}}},
      {"train",
       {{"steps", t.steps},
        {"epochs", t.epochs},
        {"global_batch", t.global_batch},
        {"micro_batch", or_auto(s.micro_batch)},
        {"lr", t.lr},
        {"schedule",
         {{"kind", name(ScheduleKindName(t.schedule.kind))},
          {"warmup_steps", t.schedule.warmup_steps}}},
        {"optimizer", name(OptimizerKindName(t.optimizer))},
        {"adam_beta1", t.adam_beta1},
        {"adam_beta2", t.adam_beta2},
        {"adam_eps", t.adam_eps},
        {"weight_decay", t.weight_decay},
        {"sgd_momentum", t.sgd_momentum},
        {"sgd_nesterov", t.sgd_nesterov},
        {"adafactor_beta1", t.adafactor_beta1},
        {"adafactor_decay_rate", t.adafactor_decay_rate},
        {"adafactor_clip_threshold", t.adafactor_clip_threshold},
        {"adafactor_relative_step", t.adafactor_relative_step},
        {"paged_optimizer", t.paged_optimizer},
        {"max_grad_norm", t.max_grad_norm},
        {"precision", name(PrecisionName(t.precision))},
        {"seed", t.seed},
        {"checkpoint_every", t.checkpoint_every},
        {"keep_checkpoints", t.keep_checkpoints},
        {"eval_every", t.eval_every},
        {"max_nonfinite_steps", t.max_nonfinite_steps}}},
      {"resources",
       {{"ranks", spec.resources.ranks},
        {"device", name(DeviceKindName(spec.resources.device))},
        {"memory_per_rank", spec.resources.memory_per_rank > 0
                                ? Json(spec.resources.memory_per_rank)
                                : Json(nullptr)}}},
      {"strategy", std::move(strategy)},
      {"priority", spec.priority},
      {"max_restarts", spec.max_restarts},
      {"output", spec.output},
  };
  // init_from is a path or nothing; the schema has no empty spelling for it.
  if (!spec.lora.init_from.empty()) out["lora"]["init_from"] = spec.lora.init_from;
  // Only when given: the JSON form of every other spec stays as it was.
  if (!spec.lora.modules_to_save.empty()) {
    out["lora"]["modules_to_save"] = spec.lora.modules_to_save;
  }
  if (spec.method == Method::kMezo) {
    out["mezo"] = {{"trainable", name(MethodName(spec.mezo.trainable))}, {"eps", spec.mezo.eps}};
  }
  return out.dump(-1, ' ', false, Json::error_handler_t::replace);
}

absl::StatusOr<uint64_t> ParseByteSize(absl::string_view text) {
  auto invalid = [text](absl::string_view problem) {
    return absl::InvalidArgumentError(
        absl::StrCat("invalid byte size \"", absl::CHexEscape(text), "\": ", problem));
  };
  absl::string_view rest = absl::StripAsciiWhitespace(text);
  if (rest.empty()) return invalid("empty");
  if (rest[0] == '-') return invalid("negative");

  // Exact arithmetic: 128 bits hold any 64-bit value times a unit.
  using Wide = unsigned __int128;
  constexpr Wide kMax = std::numeric_limits<uint64_t>::max();
  Wide whole = 0;
  size_t i = 0;
  for (; i < rest.size() && absl::ascii_isdigit(static_cast<unsigned char>(rest[i])); ++i) {
    whole = whole * 10 + static_cast<Wide>(rest[i] - '0');
    if (whole > kMax) return invalid("overflows 64 bits");
  }
  const size_t whole_digits = i;
  Wide fraction = 0;
  Wide fraction_scale = 1;
  size_t fraction_digits = 0;
  if (i < rest.size() && rest[i] == '.') {
    for (++i; i < rest.size() && absl::ascii_isdigit(static_cast<unsigned char>(rest[i])); ++i) {
      if (++fraction_digits > 18) return invalid("too many decimal places");
      fraction = fraction * 10 + static_cast<Wide>(rest[i] - '0');
      fraction_scale *= 10;
    }
    if (fraction_digits == 0) return invalid("expected digits after the decimal point");
  }
  if (whole_digits == 0 && fraction_digits == 0) return invalid("expected a number");

  const absl::string_view unit = absl::StripLeadingAsciiWhitespace(rest.substr(i));
  struct Unit {
    absl::string_view name;
    uint64_t bytes;
  };
  static constexpr Unit kUnits[] = {
      {"", 1},
      {"B", 1},
      {"KB", 1000},
      {"kB", 1000},
      {"MB", 1000 * 1000},
      {"GB", uint64_t{1000} * 1000 * 1000},
      {"TB", uint64_t{1000} * 1000 * 1000 * 1000},
      {"KiB", uint64_t{1} << 10},
      {"MiB", uint64_t{1} << 20},
      {"GiB", uint64_t{1} << 30},
      {"TiB", uint64_t{1} << 40},
  };
  const Unit* found = nullptr;
  for (const Unit& candidate : kUnits) {
    if (candidate.name == unit) found = &candidate;
  }
  if (found == nullptr) {
    return invalid(absl::StrCat("unknown unit \"", absl::CHexEscape(unit),
                                "\" (expected B, KB, MB, GB, TB, KiB, MiB, GiB or TiB)"));
  }
  const Wide fraction_bytes = fraction * found->bytes;
  if (fraction_bytes % fraction_scale != 0) return invalid("not a whole number of bytes");
  const Wide total = whole * found->bytes + fraction_bytes / fraction_scale;
  if (total > kMax) return invalid("overflows 64 bits");
  return static_cast<uint64_t>(total);
}

std::string FormatBytes(uint64_t bytes) {
  if (bytes < 1024) return absl::StrCat(bytes, " B");
  static constexpr const char* kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double value = static_cast<double>(bytes) / 1024;
  size_t unit = 0;
  while (value >= 1024 && unit + 1 < std::size(kUnits)) {
    value /= 1024;
    ++unit;
  }
  const int decimals = value < 10 ? 2 : value < 100 ? 1 : 0;
  return absl::StrFormat("%.*f %s", decimals, value, kUnits[unit]);
}

StrategyContext StrategyContextOf(const JobSpec& spec, const StrategyLimits& limits) {
  StrategyContext context;
  context.ranks = spec.resources.ranks;
  context.global_batch = spec.train.global_batch;
  context.zeroth_order = spec.method == Method::kMezo;
  context.limits = limits;
  return context;
}

}  // namespace lathe
