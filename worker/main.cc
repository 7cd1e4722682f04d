// lathe-worker: the worker binary.
//   train --spec FILE   run a job spec in this process, no coordinator (docs/training.md)
//   train --task FILE   run one rank of an attempt, as a worker agent starts it
//   score --model DIR   mean loss (and optionally logits) of a model (+ adapter) on data
//   agent --coordinator ADDR   register with a coordinator and run the ranks it assigns
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/allowed_roots.h"
#include "common/command_line.h"
#include "common/file_util.h"
#include "common/job_spec.h"
#include "common/lora_targets.h"
#include "common/model_config.h"
#include "common/peft.h"
#include "common/plan.h"
#include "common/status_macros.h"
#include "kernels/ops/torch_compat.h"
#include "nlohmann/json.hpp"
#include "planner/device_pools.h"
#include "planner/plan_spec.h"
#ifdef LATHE_WITH_AGENT  // not in LATHE_ENGINE_ONLY builds (no gRPC, no protobuf)
#include "common/proto/job_spec_proto.h"
#include "common/proto/memory_breakdown.h"
#include "common/proto/trainer_io.h"
#include "common/rpc/tls.h"
#include "grpcpp/grpcpp.h"
#include "worker/agent/agent_main.h"
#include "worker/comm/grpc_kv_store.h"
#endif
#include "worker/comm/cuda_communicator.h"
#include "worker/comm/file_kv_store.h"
#include "worker/comm/gloo_communicator.h"
#include "worker/comm/nccl_communicator.h"
#include "worker/engine/causal_lm.h"
#include "worker/engine/evaluation.h"
#include "worker/engine/memory_tracker.h"
#include "worker/engine/text_record_encoder.h"
#include "worker/engine/weights.h"
#include "worker/train/trainer.h"

namespace lathe {
namespace {

// The running trainer, for the SIGTERM handler.
std::atomic<Trainer*> g_trainer{nullptr};

// JSON null for a missing or non-finite number, so every line stays valid JSON.
nlohmann::json Number(std::optional<double> value) {
  if (!value || !std::isfinite(*value)) return nullptr;
  return *value;
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
    {"spec", true,
     "job spec (YAML or JSON) to run alone, with the plan the coordinator would make"},
#ifdef LATHE_WITH_AGENT
    {"task", true, "trainer task written by a worker agent: spec, plan, rank, rendezvous"},
#endif
    {"output", true, "table | json: one TrainerEvent per line (default table)"},
    {"threads", true, "intra-op threads (default: every core)"},
    {"rank", true, "with --spec: this process's rank (default 0)"},
    {"world-size", true, "with --spec: the number of ranks; must equal resources.ranks"},
    {"rendezvous-dir", true,
     "with --spec and several ranks: a directory every rank reaches, where they meet"},
    {"collective-timeout", true,
     "seconds a collective waits for the other ranks before it fails (default: the task's, "
     "else 60)"},
    {"prefetch", true, "on | off: ZeRO-3 gathers the next unit while one computes (default on)"},
    {"collectives", true,
     "nccl | gloo: how several ranks talk (default: nccl on cuda, gloo on cpu; gloo on cuda "
     "stages each call through host memory, as when ranks share a GPU)"},
    {"peak-flops", true,
     "the device's peak FLOP/s for MFU (default: the task's, else looked up (CUDA) or measured "
     "(CPU))"},
    {"profile-dir", true,
     "with --spec: look for profile requests at DIR/request.json between steps and write "
     "captures to DIR/<capture_id>/ (a task's is <its directory>/profile)"},
    {"profile-steps", true,
     "profile the first N steps (a request with capture_id local-<time>); captures go to "
     "--profile-dir, else <output>/profile"},
    {"profile-memory", false, "with --profile-steps: also record the memory timeline"},
};

// What `train` runs, from --spec or --task.
struct TrainJob {
  JobSpec spec;
  Plan plan;
  TrainerOptions options;  // with the attempt's job id and generation from a task
  std::string rendezvous_address;
  std::string rendezvous_dir;                             // --spec with several ranks
  absl::Duration collective_timeout = absl::Seconds(60);  // the task's, else gloo's default
  bool nccl = false;                      // several ranks on cuda: NCCL, else gloo (staged on cuda)
  std::string profile_dir;                // empty: no profiling on request
  std::optional<ProfileRequest> profile;  // --profile-steps
};

// The spec's paths this process opened below the allowed roots, and what they stand for.
PinnedPaths g_pinned;

#ifdef LATHE_WITH_AGENT  // tasks come from the agent
// Each path of a task's spec opened again below the coordinator's allowed roots without
// following a symbolic link (common/allowed_roots.h), and read and written through that from
// here on: a link swapped in after the submission is refused, and one swapped in later is
// not followed.
absl::Status PinSpecPaths(const std::vector<std::string>& roots, JobSpec* spec) {
  for (const auto& [field, path, kind] :
       {std::tuple{"model.path", &spec->model.path, PinKind::kDirectory},
        std::tuple{"data.train", &spec->data.train, PinKind::kFile},
        std::tuple{"data.eval", &spec->data.eval, PinKind::kFile},
        std::tuple{"lora.init_from", &spec->lora.init_from, PinKind::kDirectory},
        std::tuple{"output", &spec->output, PinKind::kCreateDirectory}}) {
    if (path->empty()) continue;
    LATHE_ASSIGN_OR_RETURN(*path, g_pinned.Pin(*path, roots, kind, field));
  }
  return absl::OkStatus();
}
#endif

// The plan of a spec run alone (--spec). When the spec fixes every choice it is the spec's
// own; otherwise (`strategy: auto`, a strategy field given as `auto`, `micro_batch: auto`)
// the planner makes it as `lathe plan --local` does, for this machine: the CPU pool with this
// host's memory over the ranks, or this GPU's pool and memory (resources.memory_per_rank,
// when given, instead). So `zero_stage: auto` is what the coordinator would choose, never
// silently 0.
absl::StatusOr<Plan> PlanSpecHere(const JobSpec& spec) {
  if (const std::optional<Strategy> fixed = FixedStrategy(spec.strategy)) {
    Plan plan = PlanOf(spec, *fixed);
    plan.explanation = "the spec's explicit strategy";
    return plan;
  }
  const bool cuda = spec.resources.device == DeviceKind::kCuda;
  const DevicePools pools = DefaultPools();
  if (cuda && !at::hasCUDA()) {
    return absl::FailedPreconditionError(
        "resources.device: cuda: this worker's libtorch has no CUDA support or sees no GPU");
  }
  const std::string pool = PoolOf(pools, cuda, cuda ? CudaDeviceName(0) : "");
  DeviceRates rates = pools.at(pool);
  if (cuda && rates.memory_bytes == 0) rates.memory_bytes = CudaTotalMemory(0);
  LATHE_ASSIGN_OR_RETURN(PlanOptions options, PlanOptionsFor(spec, pool, rates));
  absl::StatusOr<PlanResult> result = PlanSpec(spec, options);
  if (!result.ok()) return Annotate(result.status(), "planning the spec's auto fields here");
  return result->plan;
}

absl::StatusOr<TrainJob> LoadTrainJob(const ParsedFlags& flags) {
  TrainJob job;
  if (flags.Has("spec") == flags.Has("task")) {
    return absl::InvalidArgumentError("exactly one of --spec and --task is required");
  }
  if (flags.Has("spec")) {
    LATHE_ASSIGN_OR_RETURN(job.spec, LoadJobSpec(flags.Get("spec")));
    LATHE_ASSIGN_OR_RETURN(job.plan, PlanSpecHere(job.spec));
    LATHE_ASSIGN_OR_RETURN(job.options.rank, flags.GetInt("rank", 0));
    LATHE_ASSIGN_OR_RETURN(job.options.world_size, flags.GetInt("world-size", 1));
    job.rendezvous_dir = flags.Get("rendezvous-dir", "");
    // Trainer::Create checks these too, but the ranks connect before it runs: a wrong
    // world size would wait out the rendezvous timeout instead of failing at once.
    if (job.options.world_size != job.plan.ranks) {
      return absl::InvalidArgumentError(absl::StrCat(
          "resources.ranks: ", job.plan.ranks, " but --world-size is ", job.options.world_size));
    }
    if (job.options.rank < 0 || job.options.rank >= job.options.world_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--rank: ", job.options.rank, " is outside world size ", job.options.world_size));
    }
  } else if (flags.Has("rank") || flags.Has("world-size") || flags.Has("rendezvous-dir")) {
    return absl::InvalidArgumentError(
        "--rank, --world-size and --rendezvous-dir go with --spec (a task names its own)");
  }
#ifdef LATHE_WITH_AGENT
  if (flags.Has("task")) {
    const std::string path = flags.Get("task");
    LATHE_ASSIGN_OR_RETURN(v1::TrainerTask task, ReadTrainerTask(path));
    LATHE_ASSIGN_OR_RETURN(job.spec, JobSpecFromProto(task.spec(), path));
    LATHE_ASSIGN_OR_RETURN(job.plan, PlanFromProto(task.plan(), path));
    job.options.rank = task.rank();
    job.options.world_size = task.world_size();
    job.options.peak_flops = task.peak_flops();
    job.options.job_id = task.job_id();
    job.options.generation = task.generation();
    job.rendezvous_address = task.rendezvous_address();
    if (task.collective_timeout_seconds() > 0) {
      job.collective_timeout = absl::Seconds(task.collective_timeout_seconds());
    }
    if (!task.allowed_roots().empty()) {
      job.options.submitted_spec = std::make_shared<const JobSpec>(job.spec);
      LATHE_RETURN_IF_ERROR(
          PinSpecPaths({task.allowed_roots().begin(), task.allowed_roots().end()}, &job.spec));
    }
    // The agent drops profile requests into the rank's directory (trainer.proto).
    job.profile_dir =
        (std::filesystem::absolute(path).parent_path() / "profile").lexically_normal().string();
  }
#endif
  if (flags.Has("profile-dir")) {
    if (!flags.Has("spec")) return absl::InvalidArgumentError("--profile-dir goes with --spec");
    job.profile_dir = flags.Get("profile-dir");
    if (job.profile_dir.empty()) return absl::InvalidArgumentError("--profile-dir: empty");
  }
  if (flags.Has("profile-steps")) {
    ProfileRequest request;
    LATHE_ASSIGN_OR_RETURN(request.steps, flags.GetInt("profile-steps", 0));
    request.capture_id = absl::StrCat("local-", absl::ToUnixSeconds(absl::Now()));
    request.memory = flags.Has("profile-memory");
    if (absl::Status valid = CheckProfileRequest(request); !valid.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--profile-", valid.message()));
    }
    job.profile = request;
    if (job.profile_dir.empty()) {
      job.profile_dir = (std::filesystem::path(job.spec.output) / "profile").string();
    }
  } else if (flags.Has("profile-memory")) {
    return absl::InvalidArgumentError("--profile-memory goes with --profile-steps");
  }
  LATHE_ASSIGN_OR_RETURN(int64_t threads, flags.GetInt("threads", 0));
  job.options.threads = static_cast<int>(threads);
  LATHE_ASSIGN_OR_RETURN(double peak, flags.GetDouble("peak-flops", 0));
  if (flags.Has("peak-flops") && peak <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("--peak-flops: must be > 0, got ", peak));
  }
  if (peak > 0) job.options.peak_flops = peak;
  if (flags.Has("collective-timeout")) {
    LATHE_ASSIGN_OR_RETURN(double seconds, flags.GetDouble("collective-timeout", 60));
    if (seconds <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--collective-timeout: must be > 0 seconds, got ", seconds));
    }
    job.collective_timeout = absl::Seconds(seconds);
  }
  const std::string prefetch = flags.Get("prefetch", "on");
  if (prefetch != "on" && prefetch != "off") {
    return absl::InvalidArgumentError(
        absl::StrCat("--prefetch: expected on or off, got \"", prefetch, "\""));
  }
  job.options.prefetch = prefetch == "on";
  const bool cuda = job.plan.device == DeviceKind::kCuda;
  const std::string collectives = flags.Get("collectives", cuda ? "nccl" : "gloo");
  if (collectives != "nccl" && collectives != "gloo") {
    return absl::InvalidArgumentError(
        absl::StrCat("--collectives: expected nccl or gloo, got \"", collectives, "\""));
  }
  if (collectives == "nccl" && !cuda) {
    return absl::InvalidArgumentError(
        "--collectives: nccl needs resources.device cuda (NCCL reduces GPU memory)");
  }
  job.nccl = collectives == "nccl";
  return job;
}

#ifdef LATHE_WITH_AGENT
void PrintEvent(const v1::TrainerEvent& event) {
  std::cout << TrainerEventLine(event) << std::endl;
}

v1::TrainerEvent StartEvent(const Trainer& trainer) {
  v1::TrainerEvent event;
  v1::TrainerStart* start = event.mutable_start();
  *start->mutable_plan() = PlanToProto(trainer.plan());
  start->set_total_steps(trainer.total_steps());
  start->set_resumed_from_step(trainer.resume_step());
  for (const std::string& skipped : trainer.skipped_checkpoints()) {
    start->add_skipped_checkpoints(skipped);
  }
  start->set_model_flops_per_token(trainer.model_flops_per_token());
  start->set_peak_flops(trainer.peak_flops());
  return event;
}

v1::TrainerEvent StepEvent(const StepReport& r) {
  v1::TrainerEvent event;
  v1::TrainerStep* step = event.mutable_step();
  step->set_tokens(r.tokens);
  step->set_seconds(r.seconds);
  step->set_skipped(r.skipped);
  v1::Progress* p = step->mutable_progress();
  p->set_step(r.step);
  p->set_total_steps(r.steps);
  // A skipped step's loss is not finite, which JSON cannot carry as a number.
  if (r.loss && std::isfinite(*r.loss)) p->set_loss(*r.loss);
  p->set_lr(r.lr);
  p->set_grad_norm(r.grad_norm);  // protobuf JSON writes a non-finite one as "NaN"
  p->set_tokens_per_second(r.seconds > 0 ? r.tokens / r.seconds : 0.0);
  p->set_mfu(r.mfu);
  p->set_products(r.products);
  if (r.eval_loss) p->set_eval_loss(*r.eval_loss);
  for (MemoryComponent c : kMemoryComponents) {
    SetComponentBytes(p->mutable_memory(), c,
                      static_cast<uint64_t>(r.memory_at_peak[static_cast<int>(c)]));
  }
  p->mutable_memory()->set_total(static_cast<uint64_t>(r.peak_bytes));
  p->set_skipped_steps(r.skipped_steps);
  p->set_loss_scale(r.loss_scale);
  v1::StepPhases* phases = p->mutable_phases();
  phases->set_forward(r.phases.forward);
  phases->set_loss(r.phases.loss);
  phases->set_backward(r.phases.backward);
  phases->set_comm(r.phases.comm);
  phases->set_optimizer(r.phases.optimizer);
  static constexpr const char* kPhaseNames[kNumProductPhases] = {"forward", "loss", "backward",
                                                                 "optimizer"};
  static constexpr const char* kTypeNames[kNumProductTypes] = {"f32", "bf16"};
  for (int phase = 0; phase < kNumProductPhases; ++phase) {
    for (int type = 0; type < kNumProductTypes; ++type) {
      const ProductTally& tally = r.phase_products[phase][type];
      if (tally.seconds <= 0) continue;
      v1::PhaseProducts* products = phases->add_kernel_products();
      products->set_phase(kPhaseNames[phase]);
      products->set_dtype(kTypeNames[type]);
      products->set_flops(tally.flops);
      products->set_seconds(tally.seconds);
    }
  }
  p->set_step_seconds(r.mean_step_seconds);
  return event;
}

v1::TrainerEvent DoneEvent(const TrainResult& result) {
  v1::TrainerEvent event;
  v1::TrainerDone* done = event.mutable_done();
  done->set_steps(result.steps);
  done->set_skipped_steps(result.skipped_steps);
  if (result.final_loss && std::isfinite(*result.final_loss)) {
    done->set_final_loss(*result.final_loss);
  }
  if (result.eval_loss) done->set_eval_loss(*result.eval_loss);
  done->set_adapter_path(result.adapter_dir);
  done->set_model_path(result.model_dir);
  done->set_seconds(result.seconds);
  done->set_tokens_per_second(result.tokens_per_second);
  done->set_peak_rss_bytes(static_cast<uint64_t>(result.peak_rss_bytes));
  done->set_peak_bytes(static_cast<uint64_t>(result.peak_bytes));
  return event;
}

v1::TrainerEvent ProfileEvent(const ProfileOutcome& outcome) {
  v1::TrainerEvent event;
  v1::TrainerProfile* profile = event.mutable_profile();
  profile->set_capture_id(outcome.capture_id);
  profile->set_first_step(outcome.first_step);
  profile->set_last_step(outcome.last_step);
  for (const std::string& file : outcome.files) profile->add_files(file);
  profile->set_error(outcome.error);
  return event;
}

v1::TrainerEvent ErrorEvent(const absl::Status& status) {
  v1::TrainerEvent event;
  event.mutable_error()->set_code(absl::StatusCodeToString(status.code()));
  event.mutable_error()->set_message(std::string(status.message()));
  return event;
}
#endif  // LATHE_WITH_AGENT

absl::Status Train(const ParsedFlags& flags, bool json) {
#ifndef LATHE_WITH_AGENT
  // Events are protobuf messages (proto/lathe/v1/trainer.proto), which this build lacks.
  if (json)
    return absl::UnimplementedError("--output json: this engine-only build has no protobuf");
#endif
  MemoryTracker::Install();  // before any thread allocates through libtorch
  LATHE_ASSIGN_OR_RETURN(TrainJob job, LoadTrainJob(flags));
  const JobSpec& spec = job.spec;
  // Several ranks meet through the coordinator's rendezvous store (a task) or a shared
  // directory (--spec), and talk over gloo.
  std::unique_ptr<KvStore> store;
  std::unique_ptr<Communicator> comm;
  if (job.options.world_size > 1) {
    if (!job.rendezvous_dir.empty()) {
      LATHE_ASSIGN_OR_RETURN(store, FileKvStore::Open(job.rendezvous_dir));
#ifdef LATHE_WITH_AGENT
    } else if (!job.rendezvous_address.empty() && !job.options.job_id.empty()) {
      GrpcKvStoreOptions store_options;
      store_options.job_id = job.options.job_id;
      store_options.generation = job.options.generation;
      // The agent hands its worker token down (common/rpc/auth.h).
      if (const char* token = std::getenv("LATHE_TOKEN")) store_options.token = token;
      // And its TLS files (common/rpc/tls.h).
      LATHE_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> credentials,
                             MakeChannelCredentials(ClientTlsFilesFromEnv()));
      store = std::make_unique<GrpcKvStore>(
          grpc::CreateChannel(job.rendezvous_address, credentials), store_options);
#endif
    } else {
      return absl::InvalidArgumentError(
          "several ranks need a place to meet: --rendezvous-dir with --spec, or a task that "
          "names its rendezvous_address and job_id");
    }
    const int rank = static_cast<int>(job.options.rank);
    const int world = static_cast<int>(job.options.world_size);
    // A CUDA rank uses the device its slot's CUDA_VISIBLE_DEVICES leaves it: device 0, on
    // libtorch's default stream.
    absl::StatusOr<std::unique_ptr<Communicator>> connected;
    if (job.nccl) {
      NcclOptions nccl;
      nccl.timeout = job.collective_timeout;
      connected = ConnectNccl(store.get(), rank, world, nccl);
    } else {
      GlooOptions gloo;
      gloo.timeout = job.collective_timeout;
      connected = ConnectGloo(store.get(), rank, world, gloo);
      if (connected.ok() && spec.resources.device == DeviceKind::kCuda) {
        connected = MakeCudaStagedCommunicator(*std::move(connected), {});
      }
    }
    if (!connected.ok()) return Annotate(connected.status(), "connecting the ranks");
    comm = *std::move(connected);
    job.options.comm = comm.get();
  }
  job.options.profile.dir = job.profile_dir;
  job.options.profile.initial = job.profile;
#ifdef LATHE_WITH_AGENT
  job.options.profile.parse =
      [dir = job.profile_dir](const std::string& text) -> absl::StatusOr<ProfileRequest> {
    LATHE_ASSIGN_OR_RETURN(
        v1::ProfileRequest parsed,
        ParseProfileRequest(text, (std::filesystem::path(dir) / "request.json").string()));
    return ProfileRequest{parsed.capture_id(), parsed.steps(), parsed.memory()};
  };
#endif
  job.options.profile.on_profile = [json](const ProfileOutcome& outcome) {
#ifdef LATHE_WITH_AGENT
    if (json) PrintEvent(ProfileEvent(outcome));
#endif
    std::ostream& text = json ? std::cerr : std::cout;
    text << "profile " << (outcome.capture_id.empty() ? "(no capture_id)" : outcome.capture_id);
    if (outcome.first_step > 0) {
      text << ": steps " << outcome.first_step << "-" << outcome.last_step;
    }
    for (const std::string& file : outcome.files) text << "\n  " << file;
    if (!outcome.error.empty()) text << (outcome.files.empty() ? ": " : "\n  ") << outcome.error;
    text << std::endl;
  };
  LATHE_ASSIGN_OR_RETURN(std::unique_ptr<Trainer> trainer,
                         Trainer::Create(spec, job.plan, job.options));
  for (const std::string& skipped : trainer->skipped_checkpoints()) {
    std::cerr << "lathe-worker train: skipping checkpoint " << g_pinned.Original(skipped) << "\n";
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
  const Plan& plan = trainer->plan();
  // The human-readable lines: on stdout, or with --output json (stdout is the agent's event
  // stream) on stderr, which the agent keeps as the rank's log (`lathe logs`).
  std::ostream& text = json ? std::cerr : std::cout;
  {
#ifdef LATHE_WITH_AGENT
    if (json) PrintEvent(StartEvent(*trainer));
#endif
    text << absl::StrFormat(
        "job %s: %d steps, global batch %d, micro-batch %d x %d accumulation on %d rank(s)%s\n",
        spec.name, trainer->total_steps(), spec.train.global_batch, plan.strategy.micro_batch,
        plan.gradient_accumulation, plan.ranks,
        plan.strategy.activation_checkpointing ? ", activation checkpointing" : "");
    // The planner's line ("planner: ZeRO-2, micro-batch 4, ...") or the spec's own.
    if (!plan.explanation.empty()) {
      text << (absl::StartsWith(plan.explanation, "planner:") ? "" : "plan: ") << plan.explanation
           << "\n";
    }
  }
  // Whoever reads the output (the agent) is gone when a write fails: stop after the next
  // step with a checkpoint rather than train on unheard (docs/reliability.md).
  signal(SIGPIPE, SIG_IGN);
  auto on_step = [json, &text](const StepReport& r) {
    absl::Cleanup stop_when_unheard = [] {
      if (!std::cout) g_trainer.load()->RequestStop();
    };
#ifdef LATHE_WITH_AGENT
    if (json) PrintEvent(StepEvent(r));
#endif
    const double tokens_per_s = r.seconds > 0 ? r.tokens / r.seconds : 0.0;
    text << absl::StrFormat(
                "step %5d/%d  loss %s  lr %.3e  grad_norm %.4f  tokens/s %.0f  MFU %.1f%%  "
                "peak %.1f MiB",
                r.step, r.steps,
                !r.loss     ? "no targets"
                : r.skipped ? absl::StrFormat("%g (not finite: step skipped)", *r.loss)
                            : absl::StrFormat("%.4f", *r.loss),
                r.lr, r.grad_norm, tokens_per_s, 100 * r.mfu, r.peak_bytes / 1048576.0)
         << (r.eval_loss ? absl::StrFormat("  eval_loss %.4f", *r.eval_loss) : "") << std::endl;
  };
  auto on_checkpoint = [json, &text](int64_t step, const std::string& pinned_dir) {
    const std::string dir = g_pinned.Original(pinned_dir);
#ifdef LATHE_WITH_AGENT
    if (json) {
      v1::TrainerEvent event;
      event.mutable_checkpoint()->set_step(step);
      event.mutable_checkpoint()->set_path(dir);
      PrintEvent(event);
    }
#endif
    text << "checkpoint after step " << step << ": " << dir << std::endl;
  };
  LATHE_ASSIGN_OR_RETURN(TrainResult result, trainer->Run(on_step, on_checkpoint));
  result.adapter_dir = g_pinned.Original(result.adapter_dir);
  result.model_dir = g_pinned.Original(result.model_dir);
#ifdef LATHE_WITH_AGENT
  if (json) PrintEvent(DoneEvent(result));
#endif
  text << absl::StrFormat("done: %d steps in %.1f s, %.0f tokens/s, peak RSS %.1f MiB\n",
                          result.steps, result.seconds, result.tokens_per_second,
                          result.peak_rss_bytes / 1048576.0);
  if (result.eval_loss) text << absl::StrFormat("eval loss %.4f\n", *result.eval_loss);
  // Rank 0 writes the output; the other ranks have none to name.
  if (!result.adapter_dir.empty()) text << "adapter: " << result.adapter_dir << std::endl;
  if (!result.model_dir.empty()) text << "model: " << result.model_dir << std::endl;
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

// Adds the PEFT LoRA adapter in `adapter_dir` to `model`, as its adapter_config.json says.
absl::Status LoadAdapter(const std::string& adapter_dir, CausalLm* model) {
  const std::string config_path = adapter_dir + "/adapter_config.json";
  LATHE_ASSIGN_OR_RETURN(std::string text, ReadFile(config_path));
  LATHE_ASSIGN_OR_RETURN(PeftAdapterConfig adapter, ParsePeftAdapterConfig(text, config_path));
  LoraSpec lora;
  lora.rank = adapter.r;
  lora.alpha = adapter.lora_alpha;
  lora.use_rslora = adapter.use_rslora;
  SetSpecTargets(adapter, &lora);
  lora.rank_pattern = adapter.rank_pattern;
  lora.alpha_pattern = adapter.alpha_pattern;
  lora.modules_to_save = adapter.modules_to_save;  // its trained copies replace the modules
  if (absl::StatusOr<std::vector<LoraTarget>> targets = MatchLoraTargets(lora, model->config());
      !targets.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        config_path,
        ": target_modules: ", absl::StripPrefix(targets.status().message(), "lora.targets: ")));
  }
  // LoadLora names the spec's field (a training job's lora.init_from); here it is the flag.
  if (absl::Status loaded = model->LoadLora(lora, adapter_dir); !loaded.ok()) {
    return absl::Status(
        loaded.code(),
        absl::StrCat("--adapter: ", absl::StripPrefix(loaded.message(), "lora.init_from: ")));
  }
  return absl::OkStatus();
}

absl::Status Score(const ParsedFlags& flags, bool json) {
  if (!flags.Has("model") || !flags.Has("data")) {
    return absl::InvalidArgumentError("--model and --data are required");
  }
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
  if (flags.Has("adapter")) LATHE_RETURN_IF_ERROR(LoadAdapter(flags.Get("adapter"), model.get()));
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

const std::vector<FlagSpec> kMergeFlags = {
    {"model", true, "the adapter's base model: a Hugging Face model directory"},
    {"adapter", true, "PEFT LoRA adapter directory to fold into the base weights"},
    {"out", true, "the merged model's directory: new, or empty"},
    {"dtype", true, "float32 | bfloat16 | float16 (default: the base's torch_dtype, else float32)"},
    {"max-shard-bytes", true,
     "largest safetensors file (default 5000000000, transformers' 5GB); more files get an "
     "index"},
    {"output", true, "table | json (default table)"},
};

// `lathe-worker merge`: the base model with the adapter folded in, as a Hugging Face model
// directory that AutoModelForCausalLM.from_pretrained loads: the base's dtype, safetensors
// files of at most --max-shard-bytes (with model.safetensors.index.json when there are
// several), the base's config.json (its dtype updated) and tokenizer files.
absl::Status Merge(const ParsedFlags& flags, bool json) {
  for (const char* flag : {"model", "adapter", "out"}) {
    if (!flags.Has(flag))
      return absl::InvalidArgumentError("--model, --adapter and --out are required");
  }
  const std::string model_dir = flags.Get("model"), out = flags.Get("out");
  std::error_code error;
  if (std::filesystem::exists(out, error) && !std::filesystem::is_empty(out, error)) {
    return absl::InvalidArgumentError(absl::StrCat("--out: ", out, " is not empty"));
  }
  LATHE_ASSIGN_OR_RETURN(int64_t max_shard, flags.GetInt("max-shard-bytes", 5'000'000'000));
  if (max_shard <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max-shard-bytes: must be > 0, got ", max_shard));
  }
  LATHE_ASSIGN_OR_RETURN(std::string config_text, ReadFile(model_dir + "/config.json"));
  LATHE_ASSIGN_OR_RETURN(ModelConfig config,
                         ParseModelConfig(config_text, model_dir + "/config.json"));
  const std::string dtype_name =
      flags.Get("dtype", config.torch_dtype.empty() ? std::string("float32") : config.torch_dtype);
  const std::map<std::string, at::ScalarType> kTypes = {
      {"float32", at::kFloat}, {"bfloat16", at::kBFloat16}, {"float16", at::kHalf}};
  auto type = kTypes.find(dtype_name);
  if (type == kTypes.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat(flags.Has("dtype") ? "--dtype" : "the base's torch_dtype",
                     ": expected float32, "
                     "bfloat16 or float16, got \"",
                     dtype_name, "\""));
  }
  // Float32 arithmetic whatever the files hold: the sum is rounded once, to the output type.
  LATHE_ASSIGN_OR_RETURN(std::unique_ptr<CausalLm> model,
                         CausalLm::Load(model_dir, config, /*trainable_base=*/false));
  LATHE_RETURN_IF_ERROR(LoadAdapter(flags.Get("adapter"), model.get()));
  LATHE_RETURN_IF_ERROR(model->MergeLora());

  // Shards in the weights' order, a new one whenever the next tensor would pass the bound.
  std::vector<std::pair<std::string, at::Tensor>> weights;
  std::vector<int> shard_of;
  std::vector<int64_t> shard_bytes = {0};
  for (auto& [name, weight] : model->NamedBaseWeights()) {
    at::Tensor tensor = weight.to(type->second);
    const int64_t bytes = tensor.numel() * tensor.element_size();
    if (shard_bytes.back() > 0 && shard_bytes.back() + bytes > max_shard) shard_bytes.push_back(0);
    shard_bytes.back() += bytes;
    shard_of.push_back(static_cast<int>(shard_bytes.size()) - 1);
    weights.emplace_back(name, std::move(tensor));
  }
  const int shards = static_cast<int>(shard_bytes.size());
  auto file_name = [shards](int shard) {
    return shards == 1 ? std::string("model.safetensors")
                       : absl::StrFormat("model-%05d-of-%05d.safetensors", shard + 1, shards);
  };
  std::filesystem::create_directories(out, error);
  if (error) return absl::InternalError(absl::StrCat("--out: ", out, ": ", error.message()));
  nlohmann::ordered_json index;
  for (int shard = 0; shard < shards; ++shard) {
    TensorsToWrite tensors;
    for (size_t i = 0; i < weights.size(); ++i) {
      if (shard_of[i] != shard) continue;
      tensors.Add(weights[i].first, weights[i].second);
      index["weight_map"][weights[i].first] = file_name(shard);
    }
    LATHE_RETURN_IF_ERROR(
        WriteSafetensors(out + "/" + file_name(shard), tensors.tensors(), {{"format", "pt"}}));
  }
  if (shards > 1) {
    int64_t total = 0;
    for (int64_t bytes : shard_bytes) total += bytes;
    index["metadata"]["total_size"] = total;
    LATHE_RETURN_IF_ERROR(
        WriteFileAtomically(out + "/model.safetensors.index.json", index.dump(2) + "\n"));
  }
  // The base's config as it is (fields this engine does not read included), in the new type.
  nlohmann::ordered_json base_config = nlohmann::ordered_json::parse(config_text);
  if (base_config.contains("dtype")) base_config["dtype"] = dtype_name;
  if (base_config.contains("torch_dtype") || !base_config.contains("dtype")) {
    base_config["torch_dtype"] = dtype_name;
  }
  LATHE_RETURN_IF_ERROR(WriteFileAtomically(out + "/config.json", base_config.dump(2) + "\n"));
  LATHE_RETURN_IF_ERROR(CopyModelSideFiles(model_dir, out));
  if (json) {
    std::cout << nlohmann::json{{"out", out}, {"dtype", dtype_name}, {"files", shards}}.dump()
              << std::endl;
  } else {
    std::cout << "merged model: " << out << " (" << dtype_name << ", " << shards
              << (shards == 1 ? " file)\n" : " files)\n");
  }
  return absl::OkStatus();
}

int Usage() {
  std::cerr << "usage: lathe-worker train|score|merge|agent [flags]\n\ntrain:\n"
            << FlagsHelp(kTrainFlags) << "\nscore:\n"
            << FlagsHelp(kScoreFlags) << "\nmerge:\n"
            << FlagsHelp(kMergeFlags);
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
  if (command == "agent") {
    // The agent runs without libtorch (worker/agent/agent_main.h): the lathe-agent beside
    // this binary, when there is one, with the same flags and this binary as its trainer.
    const std::string agent = BesideThisExecutable("lathe-agent");
    if (access(agent.c_str(), X_OK) == 0) {
      std::vector<char*> args = {const_cast<char*>(agent.c_str())};
      for (int i = 2; i < argc; ++i) args.push_back(argv[i]);
      args.push_back(nullptr);
      execv(agent.c_str(), args.data());
      std::cerr << "lathe-worker agent: cannot run " << agent << ": " << std::strerror(errno)
                << "\n";
      return 1;
    }
    return RunAgentCommand(argc - 2, argv + 2, "/proc/self/exe");
  }
#endif
  const std::vector<FlagSpec>* specs = command == "train"   ? &kTrainFlags
                                       : command == "score" ? &kScoreFlags
                                       : command == "merge" ? &kMergeFlags
                                                            : nullptr;
  if (specs == nullptr) return Usage();
  if (WantsHelp({argv + 2, argv + argc})) {
    std::cout << "usage: lathe-worker " << command << " [flags]\n" << FlagsHelp(*specs);
    return 0;
  }
  absl::StatusOr<ParsedFlags> flags = ParseFlags({argv + 2, argv + argc}, *specs);
  if (!flags.ok()) {
    std::cerr << "lathe-worker " << command << ": " << flags.status().message() << "\n";
    return 2;
  }
  absl::StatusOr<bool> json = JsonOutput(*flags);
  absl::Status status;
  // The engine's boundary: what escapes it (an allocation that failed, a tensor library
  // error no caller turned into a status) ends the run with an error event and a one-line
  // message, never with abort().
  try {
    status = !json.ok()           ? json.status()
             : command == "train" ? Train(*flags, *json)
             : command == "score" ? Score(*flags, *json)
                                  : Merge(*flags, *json);
  } catch (const std::bad_alloc&) {
    status = absl::ResourceExhaustedError(
        "out of memory: an allocation failed (a smaller micro-batch, activation checkpointing "
        "or more host memory may help)");
  } catch (const c10::Error& e) {
    status = StatusFromTorchError(e, "the tensor library");
  } catch (const std::exception& e) {
    status = absl::InternalError(absl::StrCat("unexpected error: ", e.what()));
  }
  if (!status.ok()) {
    status = absl::Status(status.code(), g_pinned.Original(status.message()));
#ifdef LATHE_WITH_AGENT
    // Whoever reads the events learns why the run ended from the last one.
    if (command == "train" && json.ok() && *json) PrintEvent(ErrorEvent(status));
#endif
    std::cerr << "lathe-worker " << command << ": " << status.message() << "\n";
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace lathe

int main(int argc, char** argv) { return lathe::Main(argc, argv); }
