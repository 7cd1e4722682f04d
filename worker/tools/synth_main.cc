// lathe-synth: writes small synthetic inputs for demos, tests and benchmarks, with the
// project's own writers and no libtorch:
//   model    a Hugging Face model directory (config.json + safetensors) with random weights
//   data     a JSONL token data set drawn from a learnable Markov chain
//   adapter  a PEFT LoRA adapter for a model directory
//   tokenizer  a byte-level BPE tokenizer.json in the style of GPT-2, Llama 3 or Qwen2
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/command_line.h"
#include "common/file_util.h"
#include "common/float16.h"
#include "common/model_config.h"
#include "common/peft.h"
#include "common/safetensors.h"
#include "common/status_macros.h"
#include "worker/tools/synthetic.h"

namespace lathe {
namespace {

const std::vector<FlagSpec> kModelFlags = {
    {"out", true, "output directory (created)"},
    {"type", true, "llama | mistral | qwen2 | qwen3 | gemma2 | gemma3_text | phi3 (default llama)"},
    {"vocab", true, "vocabulary size (default 256, or 576 with --tokenizer)"},
    {"tokenizer", true, "also write a tokenizer.json of this flavor: gpt2 | llama3 | qwen2"},
    {"hidden", true, "hidden size (default 64)"},
    {"layers", true, "decoder layers (default 2)"},
    {"heads", true, "attention heads (default 4)"},
    {"kv-heads", true, "key/value heads (default 2)"},
    {"intermediate", true, "MLP size (default 128)"},
    {"head-dim", true, "head dimension (default hidden/heads)"},
    {"max-pos", true, "max_position_embeddings (default 512)"},
    {"sliding-window", true,
     "sliding window (mistral, qwen2, qwen3, phi3; gemma2 and gemma3_text on their sliding "
     "layers)"},
    {"partial-rotary", true, "phi3: partial_rotary_factor (default 1)"},
    {"longrope", true,
     "phi3: LongRoPE with this original_max_position_embeddings (short factors 1..1.5, long "
     "factors 1..8 over the frequencies)"},
    {"rope-theta", true, "RoPE base (default 10000)"},
    {"tied", false, "tie the LM head to the embeddings"},
    {"dtype", true, "F32 | BF16 | F16 (default F32)"},
    {"shards", true, "number of safetensors shards (default 1)"},
    {"seed", true, "random seed (default 0)"},
};

absl::Status WriteModel(const ParsedFlags& flags) {
  std::string out = flags.Get("out");
  if (out.empty()) return absl::InvalidArgumentError("--out is required");
  ModelConfig config;
  config.model_type = flags.Get("type", "llama");
  if (config.model_type != "llama" && config.model_type != "mistral" &&
      config.model_type != "qwen2" && config.model_type != "qwen3" && !IsGemma(config) &&
      config.model_type != "phi3") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--type: expected llama, mistral, qwen2, qwen3, gemma2, gemma3_text or phi3, got \"",
        config.model_type, "\""));
  }
  std::optional<SyntheticTokenizer> tokenizer;
  if (flags.Has("tokenizer")) {
    SyntheticTokenizerOptions options;
    absl::StatusOr<TokenizerFlavor> flavor = ParseTokenizerFlavor(flags.Get("tokenizer"));
    if (!flavor.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--tokenizer: ", flavor.status().message()));
    }
    options.flavor = *flavor;
    LATHE_ASSIGN_OR_RETURN(options.vocab_size, flags.GetInt("vocab", options.vocab_size));
    absl::StatusOr<SyntheticTokenizer> made = MakeSyntheticTokenizer(options);
    if (!made.ok())
      return absl::InvalidArgumentError(absl::StrCat("--vocab: ", made.status().message()));
    tokenizer = *std::move(made);
    config.bos_token_id = tokenizer->bos_token_id;
    config.eos_token_ids = tokenizer->eos_token_ids;
  }
  LATHE_ASSIGN_OR_RETURN(
      config.vocab_size,
      flags.GetInt("vocab", tokenizer ? SyntheticTokenizerOptions().vocab_size : 256));
  LATHE_ASSIGN_OR_RETURN(config.hidden_size, flags.GetInt("hidden", 64));
  LATHE_ASSIGN_OR_RETURN(config.num_hidden_layers, flags.GetInt("layers", 2));
  LATHE_ASSIGN_OR_RETURN(config.num_attention_heads, flags.GetInt("heads", 4));
  LATHE_ASSIGN_OR_RETURN(config.num_key_value_heads, flags.GetInt("kv-heads", 2));
  LATHE_ASSIGN_OR_RETURN(config.intermediate_size, flags.GetInt("intermediate", 128));
  LATHE_ASSIGN_OR_RETURN(config.max_position_embeddings, flags.GetInt("max-pos", 512));
  LATHE_ASSIGN_OR_RETURN(config.rope_theta, flags.GetDouble("rope-theta", 10000.0));
  if (config.num_attention_heads <= 0) return absl::InvalidArgumentError("--heads must be > 0");
  LATHE_ASSIGN_OR_RETURN(config.head_dim,
                         flags.GetInt("head-dim", config.hidden_size / config.num_attention_heads));
  if (flags.Has("sliding-window")) {
    LATHE_ASSIGN_OR_RETURN(int64_t window, flags.GetInt("sliding-window", 0));
    if (config.model_type == "llama") {
      return absl::InvalidArgumentError("--sliding-window: llama models have none");
    }
    config.sliding_window = window;
  }
  config.tie_word_embeddings = flags.Has("tied");
  config.qkv_bias = config.model_type == "qwen2";
  config.qk_norm = config.model_type == "qwen3" || config.model_type == "gemma3_text";
  if (IsGemma(config)) {
    // Transformers' defaults: Gemma 2 alternates sliding and global layers and soft-caps;
    // Gemma 3 makes every sixth layer global and gives the sliding ones a RoPE base of 10000.
    const bool gemma2 = config.model_type == "gemma2";
    for (int64_t l = 0; l < config.num_hidden_layers; ++l) {
      config.sliding_layers.push_back((l + 1) % (gemma2 ? 2 : 6) != 0);
    }
    config.query_pre_attn_scalar = config.head_dim;
    config.pad_token_id = 0;
    config.attn_logit_softcapping = gemma2 ? 50.0 : 0.0;
    config.final_logit_softcapping = gemma2 ? 30.0 : 0.0;
    config.rope_local_base_freq = gemma2 ? 0.0 : 10000.0;
  }
  config.rms_norm_eps = 1e-6;
  if ((flags.Has("partial-rotary") || flags.Has("longrope")) && config.model_type != "phi3") {
    return absl::InvalidArgumentError("--partial-rotary and --longrope are for --type phi3");
  }
  LATHE_ASSIGN_OR_RETURN(config.partial_rotary_factor, flags.GetDouble("partial-rotary", 1.0));
  const int64_t rotary = RotaryDim(config);
  if (config.partial_rotary_factor > 1 || rotary <= 0 || rotary % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat("--partial-rotary: rotates ", rotary, " of ",
                                                   config.head_dim, " features (must be even)"));
  }
  if (flags.Has("longrope")) {
    RopeScaling& rope = config.rope_scaling;
    rope.kind = RopeScaling::Kind::kLongRope;
    LATHE_ASSIGN_OR_RETURN(rope.original_max_position_embeddings, flags.GetInt("longrope", 0));
    if (rope.original_max_position_embeddings <= 0) {
      return absl::InvalidArgumentError("--longrope must be > 0");
    }
    const int64_t pairs = rotary / 2;
    for (int64_t i = 0; i < pairs; ++i) {
      const double t = pairs > 1 ? static_cast<double>(i) / static_cast<double>(pairs - 1) : 0.0;
      rope.short_factor.push_back(1.0 + 0.5 * t);
      rope.long_factor.push_back(1.0 + 7.0 * t);
    }
    // As transformers derives them from the lengths (ModelConfig's RopeScaling).
    rope.factor = static_cast<double>(config.max_position_embeddings) /
                  static_cast<double>(rope.original_max_position_embeddings);
    rope.attention_factor =
        rope.factor <= 1.0
            ? 1.0
            : std::sqrt(1 + std::log(rope.factor) / std::log(static_cast<double>(
                                                        rope.original_max_position_embeddings)));
  }
  LATHE_ASSIGN_OR_RETURN(DType dtype, ParseDType(flags.Get("dtype", "F32")));
  if (dtype != DType::kF32 && dtype != DType::kBF16 && dtype != DType::kF16) {
    return absl::InvalidArgumentError("--dtype: expected F32, BF16 or F16");
  }
  config.torch_dtype = dtype == DType::kF32    ? "float32"
                       : dtype == DType::kBF16 ? "bfloat16"
                                               : "float16";
  LATHE_ASSIGN_OR_RETURN(int64_t shards, flags.GetInt("shards", 1));
  LATHE_ASSIGN_OR_RETURN(int64_t seed, flags.GetInt("seed", 0));
  LATHE_RETURN_IF_ERROR(
      WriteSyntheticModel(config, dtype, shards, static_cast<uint64_t>(seed), out));
  if (tokenizer) {
    LATHE_RETURN_IF_ERROR(WriteFileAtomically(out + "/tokenizer.json", tokenizer->json));
  }
  std::cout << "wrote " << out << " (" << config.model_type << ", " << ParameterCount(config)
            << " parameters, " << DTypeName(dtype)
            << (tokenizer ? absl::StrCat(", ", flags.Get("tokenizer"), " tokenizer of ",
                                         tokenizer->size, " ids")
                          : "")
            << ")\n";
  return absl::OkStatus();
}

const std::vector<FlagSpec> kTokenizerFlags = {
    {"out", true, "output directory (created); the file is <out>/tokenizer.json"},
    {"flavor", true, "gpt2 | llama3 | qwen2"},
    {"vocab-size", true, "ids in all: 256 bytes + merges + special tokens (default 576)"},
};

absl::Status WriteTokenizer(const ParsedFlags& flags) {
  std::string out = flags.Get("out");
  if (out.empty() || !flags.Has("flavor")) {
    return absl::InvalidArgumentError("--out and --flavor are required");
  }
  SyntheticTokenizerOptions options;
  absl::StatusOr<TokenizerFlavor> flavor = ParseTokenizerFlavor(flags.Get("flavor"));
  if (!flavor.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--flavor: ", flavor.status().message()));
  }
  options.flavor = *flavor;
  LATHE_ASSIGN_OR_RETURN(options.vocab_size, flags.GetInt("vocab-size", options.vocab_size));
  absl::StatusOr<SyntheticTokenizer> tokenizer = MakeSyntheticTokenizer(options);
  if (!tokenizer.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--vocab-size: ", tokenizer.status().message()));
  }
  std::error_code error;
  std::filesystem::create_directories(out, error);
  if (error) return absl::InternalError(absl::StrCat(out, ": ", error.message()));
  const std::string path = out + "/tokenizer.json";
  LATHE_RETURN_IF_ERROR(WriteFileAtomically(path, tokenizer->json));
  std::cout << "wrote " << path << " (" << flags.Get("flavor") << ", " << tokenizer->size
            << " ids)\n";
  return absl::OkStatus();
}

const std::vector<FlagSpec> kDataFlags = {
    {"out", true, "output JSONL file"},
    {"vocab", true, "vocabulary size (default 256)"},
    {"records", true, "number of records (default 256)"},
    {"min-len", true, "shortest record (default 8)"},
    {"max-len", true, "longest record (default 64)"},
    {"prompt-labels", false, "mask a prompt prefix of each record with -100 labels"},
    {"seed", true, "random seed (default 0)"},
};

absl::Status WriteData(const ParsedFlags& flags) {
  std::string out = flags.Get("out");
  if (out.empty()) return absl::InvalidArgumentError("--out is required");
  LATHE_ASSIGN_OR_RETURN(int64_t vocab, flags.GetInt("vocab", 256));
  LATHE_ASSIGN_OR_RETURN(int64_t records, flags.GetInt("records", 256));
  LATHE_ASSIGN_OR_RETURN(int64_t min_len, flags.GetInt("min-len", 8));
  LATHE_ASSIGN_OR_RETURN(int64_t max_len, flags.GetInt("max-len", 64));
  LATHE_ASSIGN_OR_RETURN(int64_t seed, flags.GetInt("seed", 0));
  if (vocab < 2) return absl::InvalidArgumentError("--vocab must be >= 2");
  if (records < 1) return absl::InvalidArgumentError("--records must be >= 1");
  if (min_len < 2 || max_len < min_len) {
    return absl::InvalidArgumentError("--min-len/--max-len: need 2 <= min-len <= max-len");
  }
  SyntheticDataOptions options{
      vocab, records, min_len, max_len, flags.Has("prompt-labels"), static_cast<uint64_t>(seed)};
  std::string text = SyntheticDataJsonl(options);
  LATHE_RETURN_IF_ERROR(WriteFileAtomically(out, text));
  std::cout << "wrote " << out << " (" << records << " records)\n";
  return absl::OkStatus();
}

const std::vector<FlagSpec> kAdapterFlags = {
    {"model", true, "model directory the adapter is for"},
    {"out", true, "output adapter directory"},
    {"rank", true, "LoRA rank (default 8)"},
    {"alpha", true, "LoRA alpha (default 16)"},
    {"targets", true, "comma-separated modules (default all seven)"},
    {"b-scale", true, "B ~ uniform(-x, x); 0 gives PEFT's zero init (default 0)"},
    {"rslora", false, "mark the adapter use_rslora"},
    {"seed", true, "random seed (default 0)"},
};

absl::Status WriteAdapter(const ParsedFlags& flags) {
  std::string model_dir = flags.Get("model");
  std::string out = flags.Get("out");
  if (model_dir.empty() || out.empty()) {
    return absl::InvalidArgumentError("--model and --out are required");
  }
  LATHE_ASSIGN_OR_RETURN(ModelConfig config, LoadModelConfig(model_dir));
  PeftAdapterConfig adapter;
  adapter.base_model_name_or_path = model_dir;
  LATHE_ASSIGN_OR_RETURN(adapter.r, flags.GetInt("rank", 8));
  LATHE_ASSIGN_OR_RETURN(adapter.lora_alpha, flags.GetDouble("alpha", 16.0));
  LATHE_ASSIGN_OR_RETURN(double b_scale, flags.GetDouble("b-scale", 0.0));
  LATHE_ASSIGN_OR_RETURN(int64_t seed, flags.GetInt("seed", 0));
  adapter.use_rslora = flags.Has("rslora");
  if (adapter.r <= 0) return absl::InvalidArgumentError("--rank must be > 0");
  std::vector<std::string> targets;
  if (flags.Has("targets")) targets = absl::StrSplit(flags.Get("targets"), ',');
  absl::StatusOr<std::vector<std::string>> resolved = LoraTargetsOf(config, targets);
  if (!resolved.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--targets: ", resolved.status().message()));
  }
  adapter.target_modules = *resolved;
  std::mt19937_64 rng(static_cast<uint64_t>(seed));
  std::vector<std::vector<float>> buffers;
  std::vector<TensorToWrite> tensors;
  buffers.reserve(2 * config.num_hidden_layers * adapter.target_modules.size());
  for (int64_t layer = 0; layer < config.num_hidden_layers; ++layer) {
    for (const std::string& module : adapter.target_modules) {
      ProjectionShape shape = ProjectionShapeOf(config, module);
      float bound = 1.0f / std::sqrt(static_cast<float>(shape.in_features));
      std::uniform_real_distribution<float> a_dist(-bound, bound);
      std::uniform_real_distribution<float> b_dist(-static_cast<float>(b_scale),
                                                   static_cast<float>(b_scale));
      std::vector<float> a(adapter.r * shape.in_features);
      for (float& v : a) v = a_dist(rng);
      std::vector<float> b(shape.out_features * adapter.r, 0.0f);
      if (b_scale > 0) {
        for (float& v : b) v = b_dist(rng);
      }
      buffers.push_back(std::move(a));
      tensors.push_back({PeftLoraTensorName(layer, module, "A"),
                         DType::kF32,
                         {adapter.r, shape.in_features},
                         buffers.back().data(),
                         buffers.back().size() * 4});
      buffers.push_back(std::move(b));
      tensors.push_back({PeftLoraTensorName(layer, module, "B"),
                         DType::kF32,
                         {shape.out_features, adapter.r},
                         buffers.back().data(),
                         buffers.back().size() * 4});
    }
  }
  LATHE_RETURN_IF_ERROR(WritePeftAdapter(out, adapter, tensors));
  std::cout << "wrote " << out << " (" << tensors.size() << " tensors)\n";
  return absl::OkStatus();
}

int Usage() {
  std::cerr << "usage: lathe-synth model|data|adapter|tokenizer [flags]\n\nmodel:\n"
            << FlagsHelp(kModelFlags) << "\ndata:\n"
            << FlagsHelp(kDataFlags) << "\nadapter:\n"
            << FlagsHelp(kAdapterFlags) << "\ntokenizer:\n"
            << FlagsHelp(kTokenizerFlags);
  return 2;
}

int Main(int argc, char** argv) {
  if (argc < 2) return Usage();
  std::string command = argv[1];
  std::vector<std::string> args(argv + 2, argv + argc);
  const std::vector<FlagSpec>* specs = command == "model"       ? &kModelFlags
                                       : command == "data"      ? &kDataFlags
                                       : command == "adapter"   ? &kAdapterFlags
                                       : command == "tokenizer" ? &kTokenizerFlags
                                                                : nullptr;
  if (specs == nullptr) return Usage();
  if (WantsHelp(args)) {
    std::cout << "usage: lathe-synth " << command << " [flags]\n" << FlagsHelp(*specs);
    return 0;
  }
  absl::StatusOr<ParsedFlags> flags = ParseFlags(args, *specs);
  if (!flags.ok()) {
    std::cerr << "lathe-synth " << command << ": " << flags.status().message() << "\n";
    return 2;
  }
  absl::Status status = command == "model"     ? WriteModel(*flags)
                        : command == "data"    ? WriteData(*flags)
                        : command == "adapter" ? WriteAdapter(*flags)
                                               : WriteTokenizer(*flags);
  if (!status.ok()) {
    std::cerr << "lathe-synth " << command << ": " << status.message() << "\n";
    return status.code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
  }
  return 0;
}

}  // namespace
}  // namespace lathe

int main(int argc, char** argv) { return lathe::Main(argc, argv); }
