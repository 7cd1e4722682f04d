// lathe-worker: the worker binary.
//   train --spec FILE   run a job spec in this process, no coordinator (docs/training.md)
//   score --model DIR   mean loss (and optionally logits) of a model (+ adapter) on data
//   agent --coordinator ADDR   register with a coordinator and run the ranks it assigns
#include <signal.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/command_line.h"
#include "common/file_util.h"
#include "common/job_spec.h"
#include "common/model_config.h"
#include "common/peft.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
#ifdef LATHE_WITH_AGENT  // not in LATHE_ENGINE_ONLY builds (no gRPC)
#include "grpcpp/grpcpp.h"
#include "worker/agent/agent_main.h"
#include "worker/comm/gloo_communicator.h"
#include "worker/comm/grpc_kv_store.h"
#endif
#include "worker/engine/causal_lm.h"
#include "worker/engine/evaluation.h"
#include "worker/engine/memory_tracker.h"
#include "worker/engine/text_record_encoder.h"
#include "worker/engine/trainer.h"
#include "worker/engine/weights.h"

namespace lathe {
namespace {

// The running trainer, for the SIGTERM handler.
std::atomic<Trainer*> g_trainer{nullptr};

// JSON null for a missing or non-finite number, so every line stays valid JSON.
nlohmann::json Number(std::optional<double> value) {
  if (!value || !std::isfinite(*value)) return nullptr;
  return *value;
}

nlohmann::json PathOrNull(const std::string& path) {
  return path.empty() ? nlohmann::json(nullptr) : nlohmann::json(path);
}

absl::StatusOr<bool> JsonOutput(const ParsedFlags& flags) {
  std::string output = flags.Get("output", "table");
  if (output != "table" && output != "json") {
    return absl::InvalidArgumentError(
        absl::StrCat("--output: expected table or json, got \"", output, "\""));
  }
  return output == "json";
}

const std::vector<FlagSpec> kTrainFlags = {
    {"spec", true, "job spec (YAML or JSON)"},
    {"output", true, "table | json (default table)"},
    {"threads", true, "intra-op threads (default: every core)"},
    {"rank", true, "this process's rank (set by the agent; default 0)"},
    {"world-size", true, "ranks in the attempt (set by the agent; default 1)"},
    {"job-id", true, "job id (set by the agent, for logs and rendezvous)"},
    {"generation", true, "attempt generation (set by the agent)"},
    {"coordinator", true, "coordinator address for rendezvous (set by the agent)"},
};

absl::Status Train(const ParsedFlags& flags) {
  if (!flags.Has("spec")) return absl::InvalidArgumentError("--spec is required");
  LATHE_ASSIGN_OR_RETURN(bool json, JsonOutput(flags));
  MemoryTracker::Install();  // before any thread allocates through libtorch
  TrainerOptions options;
  LATHE_ASSIGN_OR_RETURN(int64_t threads, flags.GetInt("threads", 0));
  options.threads = static_cast<int>(threads);
  LATHE_ASSIGN_OR_RETURN(options.rank, flags.GetInt("rank", 0));
  LATHE_ASSIGN_OR_RETURN(options.world_size, flags.GetInt("world-size", 1));
  LATHE_ASSIGN_OR_RETURN(JobSpec spec, LoadJobSpec(flags.Get("spec")));
#ifdef LATHE_WITH_AGENT
  // Several ranks meet through the coordinator's rendezvous store and talk over gloo.
  std::unique_ptr<KvStore> store;
  std::unique_ptr<Communicator> comm;
  if (options.world_size > 1) {
    if (!flags.Has("coordinator") || !flags.Has("job-id") || !flags.Has("generation")) {
      return absl::InvalidArgumentError(
          "--world-size above 1 needs --coordinator, --job-id and --generation");
    }
    GrpcKvStoreOptions store_options;
    store_options.job_id = flags.Get("job-id");
    LATHE_ASSIGN_OR_RETURN(store_options.generation, flags.GetInt("generation", 0));
    store = std::make_unique<GrpcKvStore>(
        grpc::CreateChannel(flags.Get("coordinator"), grpc::InsecureChannelCredentials()),
        store_options);
    absl::StatusOr<std::unique_ptr<Communicator>> connected =
        ConnectGloo(store.get(), static_cast<int>(options.rank),
                    static_cast<int>(options.world_size), GlooOptions{});
    if (!connected.ok()) return Annotate(connected.status(), "connecting the ranks");
    comm = *std::move(connected);
    options.comm = comm.get();
  }
#endif
  LATHE_ASSIGN_OR_RETURN(std::unique_ptr<Trainer> trainer, Trainer::Create(spec, options));
  for (const std::string& skipped : trainer->skipped_checkpoints()) {
    std::cerr << "lathe-worker train: skipping checkpoint " << skipped << "\n";
  }
  if (trainer->resume_step() > 0) {
    std::cerr << "lathe-worker train: resuming after step " << trainer->resume_step() << "\n";
  }
  // SIGTERM (a cancel, a preemption) stops after the current step with a checkpoint.
  g_trainer.store(trainer.get());
  absl::Cleanup forget_trainer = [] { g_trainer.store(nullptr); };
  struct sigaction action {};
  action.sa_handler = [](int) {
    if (Trainer* t = g_trainer.load()) t->RequestStop();
  };
  sigaction(SIGTERM, &action, nullptr);
  if (json) {
    std::cout << nlohmann::json{{"event", "start"},
                                {"job", spec.name},
                                {"steps", trainer->total_steps()},
                                {"micro_batch", trainer->micro_batch()},
                                {"global_batch", spec.train.global_batch}}
                     .dump()
              << std::endl;
  } else {
    std::cout << absl::StrFormat("job %s: %d steps, global batch %d, micro-batch %d\n", spec.name,
                                 trainer->total_steps(), spec.train.global_batch,
                                 trainer->micro_batch());
  }
  auto on_step = [json](const StepReport& r) {
    double tokens_per_s = r.seconds > 0 ? r.tokens / r.seconds : 0.0;
    if (json) {
      nlohmann::json memory;
      for (int i = 0; i < kNumMemoryComponents; ++i) {
        memory[std::string(MemoryComponentName(static_cast<MemoryComponent>(i)))] =
            r.memory_at_peak[i];
      }
      memory["total"] = r.peak_bytes;
      const nlohmann::json phases = {{"forward", r.phases.forward},
                                     {"loss", r.phases.loss},
                                     {"backward", r.phases.backward},
                                     {"comm", r.phases.comm},
                                     {"optimizer", r.phases.optimizer}};
      std::cout << nlohmann::json{{"event", "step"},
                                  {"step", r.step},
                                  {"steps", r.steps},
                                  {"loss", Number(r.loss)},
                                  {"lr", r.lr},
                                  {"grad_norm", r.grad_norm},
                                  {"skipped", r.skipped},
                                  {"loss_scale", r.loss_scale},
                                  {"tokens", r.tokens},
                                  {"tokens_per_s", tokens_per_s},
                                  {"eval_loss", Number(r.eval_loss)},
                                  {"memory", memory},
                                  {"phases", phases}}
                       .dump()
                << std::endl;
    } else {
      std::cout
          << absl::StrFormat(
                 "step %5d/%d  loss %s  lr %.3e  grad_norm %.4f  tokens/s %.0f  peak %.1f MiB",
                 r.step, r.steps,
                 !r.loss     ? "no targets"
                 : r.skipped ? absl::StrFormat("%g (not finite: step skipped)", *r.loss)
                             : absl::StrFormat("%.4f", *r.loss),
                 r.lr, r.grad_norm, tokens_per_s, r.peak_bytes / 1048576.0)
          << (r.eval_loss ? absl::StrFormat("  eval_loss %.4f", *r.eval_loss) : "") << std::endl;
    }
  };
  LATHE_ASSIGN_OR_RETURN(TrainResult result, trainer->Run(on_step));
  if (json) {
    std::cout << nlohmann::json{{"event", "done"},
                                {"steps", result.steps},
                                {"skipped_steps", result.skipped_steps},
                                {"final_loss", Number(result.final_loss)},
                                {"eval_loss", Number(result.eval_loss)},
                                {"adapter", PathOrNull(result.adapter_dir)},
                                {"model", PathOrNull(result.model_dir)},
                                {"seconds", result.seconds},
                                {"tokens_per_s", result.tokens_per_second},
                                {"peak_rss_bytes", result.peak_rss_bytes},
                                {"peak_bytes", result.peak_bytes}}
                     .dump()
              << std::endl;
  } else {
    std::cout << absl::StrFormat("done: %d steps in %.1f s, %.0f tokens/s, peak RSS %.1f MiB\n",
                                 result.steps, result.seconds, result.tokens_per_second,
                                 result.peak_rss_bytes / 1048576.0);
    if (result.eval_loss) std::cout << absl::StrFormat("eval loss %.4f\n", *result.eval_loss);
    std::cout << (result.adapter_dir.empty() ? "model: " + result.model_dir
                                             : "adapter: " + result.adapter_dir)
              << std::endl;
  }
  return absl::OkStatus();
}

const std::vector<FlagSpec> kScoreFlags = {
    {"model", true, "Hugging Face model directory"},
    {"adapter", true, "PEFT LoRA adapter directory to apply (optional)"},
    {"data", true, "JSONL data (token ids, text, chat or instruction records)"},
    {"seq-len", true, "truncate each record to this many tokens (default 1024)"},
    {"logits-out", true, "write logits.N [len, vocab] per record to this safetensors file"},
    {"output", true, "table | json (default table)"},
    {"threads", true, "intra-op threads (default: every core)"},
};

absl::Status Score(const ParsedFlags& flags) {
  if (!flags.Has("model") || !flags.Has("data")) {
    return absl::InvalidArgumentError("--model and --data are required");
  }
  LATHE_ASSIGN_OR_RETURN(bool json, JsonOutput(flags));
  LATHE_ASSIGN_OR_RETURN(int64_t seq_len, flags.GetInt("seq-len", 1024));
  LATHE_ASSIGN_OR_RETURN(int64_t threads, flags.GetInt("threads", 0));
  if (seq_len < 2) return absl::InvalidArgumentError("--seq-len must be >= 2");
  if (threads > 0) at::set_num_threads(static_cast<int>(threads));
  std::string model_dir = flags.Get("model");
  LATHE_ASSIGN_OR_RETURN(ModelConfig config, LoadModelConfig(model_dir));
  TextRecordEncoder text_encoder(model_dir, config);
  LATHE_ASSIGN_OR_RETURN(TokenDataset data, TokenDataset::Load(flags.Get("data"), "--data",
                                                               config.vocab_size, &text_encoder));
  LATHE_ASSIGN_OR_RETURN(std::unique_ptr<CausalLm> model,
                         CausalLm::Load(model_dir, config, /*trainable_base=*/false));
  if (flags.Has("adapter")) {
    std::string adapter_dir = flags.Get("adapter");
    std::string config_path = adapter_dir + "/adapter_config.json";
    LATHE_ASSIGN_OR_RETURN(std::string text, ReadFile(config_path));
    LATHE_ASSIGN_OR_RETURN(PeftAdapterConfig adapter, ParsePeftAdapterConfig(text, config_path));
    LoraSpec lora;
    lora.rank = adapter.r;
    lora.alpha = adapter.lora_alpha;
    lora.use_rslora = adapter.use_rslora;
    lora.targets = adapter.target_modules;
    for (const std::string& t : lora.targets) {
      if (!IsLoraTargetModule(t)) {
        return absl::InvalidArgumentError(
            absl::StrCat(config_path, ": target_modules: unknown module \"", t, "\""));
      }
    }
    LATHE_RETURN_IF_ERROR(model->LoadLora(lora, adapter_dir));
  }
  bool keep_logits = flags.Has("logits-out");
  LATHE_ASSIGN_OR_RETURN(Evaluation eval, Evaluate(*model, data, seq_len, keep_logits));
  if (keep_logits) {
    TensorsToWrite tensors;
    for (size_t i = 0; i < eval.logits.size(); ++i) {
      tensors.Add(absl::StrCat("logits.", i), eval.logits[i]);
    }
    LATHE_RETURN_IF_ERROR(WriteSafetensors(flags.Get("logits-out"), tensors.tensors()));
  }
  if (json) {
    std::cout << nlohmann::json{{"loss", Number(eval.loss)}, {"targets", eval.targets}}.dump()
              << std::endl;
  } else {
    std::cout << absl::StrFormat("loss %.6f over %d targets (perplexity %.3f)\n", eval.loss,
                                 eval.targets, std::exp(eval.loss));
  }
  return absl::OkStatus();
}

int Usage() {
  std::cerr << "usage: lathe-worker train|score|agent [flags]\n\ntrain:\n"
            << FlagsHelp(kTrainFlags) << "\nscore:\n"
            << FlagsHelp(kScoreFlags);
#ifdef LATHE_WITH_AGENT
  std::cerr << "\nagent (register with a coordinator, run its ranks):\n" << AgentFlagsHelp();
#endif
  return 2;
}

int Main(int argc, char** argv) {
  if (argc < 2) return Usage();
  std::string command = argv[1];
  if (command == "--help" || command == "-h" || command == "help") {
    Usage();
    return 0;
  }
#ifdef LATHE_WITH_AGENT
  if (command == "agent") return RunAgentCommand(argc - 2, argv + 2);
#endif
  const std::vector<FlagSpec>* specs = command == "train"   ? &kTrainFlags
                                       : command == "score" ? &kScoreFlags
                                                            : nullptr;
  if (specs == nullptr) return Usage();
  absl::StatusOr<ParsedFlags> flags = ParseFlags({argv + 2, argv + argc}, *specs);
  if (!flags.ok()) {
    std::cerr << "lathe-worker " << command << ": " << flags.status().message() << "\n";
    return 2;
  }
  absl::Status status = command == "train" ? Train(*flags) : Score(*flags);
  if (!status.ok()) {
    std::cerr << "lathe-worker " << command << ": " << status.message() << "\n";
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace lathe

int main(int argc, char** argv) { return lathe::Main(argc, argv); }
