#!/usr/bin/env python3
"""The baseline users actually run: Hugging Face transformers + PEFT, against `lathe-worker
train` on the same LoRA job (issue #28, item 6).

  .venv/bin/python bench/hf_baseline.py [--bin-dir build/bin] [--steps 20] [--threads 2]
                                        [--size tiny|small|medium]

One model and data set from lathe-synth (train_bench's sizes), one LoRA job (rank 16, alpha
32, all seven projections, AdamW lr 1e-3, clipping at 1.0, packed sequences of seq_len
tokens, global batch and micro-batch as train_bench), run as child processes one after the
other on the same threads:
  - Lathe in fp32, and in bf16 where the CPU multiplies bf16 natively (avx512_bf16 or AMX);
  - transformers (AutoModelForCausalLM) + PEFT (get_peft_model, LoraConfig) in a manual
    loop with torch.optim.AdamW and gradient accumulation, with attn_implementation "eager"
    and "sdpa", in fp32, and in bf16 under torch.autocast("cpu", bfloat16) where native.
Tokens/s over steps 2..N (step 1 warms up), peak RSS from os.wait4's ru_maxrss. The goal
(issue #28): Lathe >= 2x the best HF variant's tokens/s at <= 0.5x its peak RSS. Prints a
markdown table with the CPU's model and flags for bench/RESULTS.md.

  .venv/bin/python bench/hf_baseline.py --device cuda [--size llama-3.2-1b|qwen2.5-1.5b]
      [--steps 8] [--seq-len 2048] [--global-batch 8] [--micro-batch 4] [--cpu-fallback]

The GPU benchmark (issue #29, item 6; scripts/gpu-check runs it on a lent GPU): a random model
with the shape of a real one, built by transformers from that model's published config.json
(AutoModelForCausalLM.from_config on the GPU, saved in bf16: no weights can be downloaded),
lathe-synth's data, one LoRA job as above in bf16 with packed sequences of seq_len tokens, and
  - Lathe: `lathe-worker train --spec` on CUDA, bf16 weights, the fused kernels
    (strategy.fused_kernels), no checkpointing; its text output (the engine-only build on the
    GPU machines has no --output json): tokens/s of the done line (steps 2..N), the largest
    step peak of its memory tracker ("peak ... MiB": on CUDA the caching allocator's peak of
    allocated bytes, reset at every step) and its own MFU;
  - transformers + PEFT: the bf16 model (dtype bfloat16), attention "sdpa", get_peft_model,
    torch.optim.AdamW, the loop above under torch.autocast("cuda", bfloat16); its peak is
    torch.cuda.max_memory_allocated over the steps (reset after loading).
MFU against the GPU's dense bf16 peak (common/flops.cc's table by torch.cuda.get_device_name,
or --peak-tflops), two ways: "6N+attn", 6 x (the projections, the LM head and the adapters)
+ 6 x layers x (seq_len + 1) x heads x head_dim per token (the usual 6N, causal attention), and
"LoRA", common/flops.h's count that Lathe's trainer reports (frozen weights 4x: no weight
gradients). The goals (issue #29): Lathe >= 1.5x HF + PEFT's tokens/s at <= 0.6x its peak
memory, MFU (6N+attn) >= 45%. Prints a markdown table for bench/RESULTS.md and, last, one
"summary:" line (scripts/gpu-check's). With --cpu-fallback and no CUDA device the same
comparison runs on the CPU (scripts/gpu-check --dry-run, --size tiny): peak RSS instead of
device memory, no MFU, and the output says it is not a GPU measurement.
"""

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import train_bench  # noqa: E402  (sizes, synthesis, CPU facts, the C++ trainer's measurement)

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# The HF side, run in a child process so that its peak RSS is its own.
HF_LOOP = r'''
import json, sys, time
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM
args = json.loads(sys.argv[1])
torch.manual_seed(0)
torch.set_num_threads(args["threads"])
device = torch.device(args.get("device", "cpu"))
cuda = device.type == "cuda"
dtype = getattr(torch, args.get("load_dtype", "float32"))
model = AutoModelForCausalLM.from_pretrained(args["model"], dtype=dtype,
                                             attn_implementation=args["attention"]).to(device)
model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                         target_modules=args["targets"]))
model.train()
ids = []
with open(args["data"]) as f:
    for line in f:
        ids.extend(json.loads(line)["input_ids"])
seq, micro, batch = args["seq_len"], args["micro_batch"], args["global_batch"]
rows = [ids[i:i + seq] for i in range(0, len(ids) - seq + 1, seq)]
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3,
                              weight_decay=0.0)
if cuda:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
times, losses, row = [], [], 0
for step in range(args["steps"]):
    start = time.perf_counter()
    total = 0.0
    for _ in range(batch // micro):
        x = torch.tensor([rows[(row + k) % len(rows)] for k in range(micro)], device=device)
        row += micro
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args["bf16"]):
            loss = model(input_ids=x, labels=x).loss / (batch // micro)
        loss.backward()
        total += loss.item()
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
    times.append(time.perf_counter() - start)
    losses.append(total)
tokens = batch * seq * (len(times) - 1)
print(json.dumps({"tokens_per_s": tokens / sum(times[1:]), "final_loss": losses[-1],
                  "peak_device": torch.cuda.max_memory_allocated(device) if cuda else None}))
'''


def run_hf(name, python, spec, attention, bf16, threads, steps, size, env, device="cpu",
           load_dtype="float32"):
    """The HF loop's tokens/s and final loss, its peak RSS (os.wait4) and, on CUDA, its peak
    device memory (torch.cuda.max_memory_allocated over the steps)."""
    args = {"model": spec["model"]["path"], "data": spec["data"]["train"], "attention": attention,
            "bf16": bf16, "threads": threads, "steps": steps, "targets": TARGETS,
            "seq_len": size["seq_len"], "micro_batch": size["micro_batch"],
            "global_batch": size["global_batch"], "device": device, "load_dtype": load_dtype}
    stderr = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen([python, "-c", HF_LOOP, json.dumps(args)], stdout=subprocess.PIPE,
                            stderr=stderr, text=True, env=env)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        stderr.seek(0)
        sys.exit(f"hf_baseline: {name} failed:\n{stderr.read()[-4000:]}")
    result = json.loads(out.strip().splitlines()[-1])
    return {"name": name, "tokens_per_s": result["tokens_per_s"],
            "final_loss": result["final_loss"], "peak_rss": usage.ru_maxrss * 1024,
            "peak_device": result.get("peak_device")}


# --device cuda (issue #29): the published config.json of each model (the fields its
# transformers class reads; bos/eos ids left out, so that the tiny fallback's vocabulary needs
# none). Llama 3.2 1B: Meta's, with its llama3 RoPE scaling; Qwen2.5 1.5B: Qwen's.
MODELS = {
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
        "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
        "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False,
        "initializer_range": 0.02},
    "qwen2.5-1.5b": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936,
        "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
        "num_attention_heads": 12, "num_key_value_heads": 2, "hidden_act": "silu",
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
        "sliding_window": 131072, "max_window_layers": 21, "use_sliding_window": False,
        "tie_word_embeddings": True, "initializer_range": 0.02},
}
# Their job: packed sequences of 2048 tokens, 8 a step in two micro-batches of 4.
MODEL_JOB = dict(seq_len=2048, global_batch=8, micro_batch=4)
# Dense bf16 peaks of CUDA devices by name, as common/flops.cc's CudaPeakFlops (the same table,
# the same order: more specific names first), in FLOP/s.
PEAK_BF16 = [("H200", 989.4e12), ("H100 PCIe", 756.0e12), ("H100 NVL", 835.0e12),
             ("H100", 989.4e12), ("A100", 312.0e12), ("L40S", 362.1e12), ("L40", 181.0e12),
             ("L4", 121.0e12)]
# The goals of issue #29, item 6.
GOAL_SPEED, GOAL_MEMORY, GOAL_MFU = 1.5, 0.6, 0.45

# Builds the random model from its config.json on the device (cuda, or the CPU where torch sees
# none and the fallback is allowed) and saves it in bf16; prints the device and versions.
BUILD_MODEL = r"""
import json, os, sys
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM
args = json.loads(sys.argv[1])
cuda = torch.cuda.is_available()
if not cuda and not args["fallback"]:
    sys.exit(f"torch {torch.__version__} sees no CUDA device (--cpu-fallback runs the same "
             "comparison on the CPU)")
device = "cuda" if cuda else "cpu"
os.makedirs(args["out"], exist_ok=True)
with open(os.path.join(args["out"], "config.json"), "w") as f:
    json.dump(args["config"], f, indent=2)
torch.manual_seed(1)
with torch.device(device):
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args["out"]),
                                             dtype=torch.bfloat16)
model.save_pretrained(args["out"])
print(json.dumps({"device": device, "torch": torch.__version__,
                  "transformers": transformers.__version__,
                  "device_name": torch.cuda.get_device_name(0) if cuda else "",
                  "parameters": sum(p.numel() for p in model.parameters())}))
"""


def model_config(size_name):
    """The config.json of --size: a published model's, or (train_bench's sizes) Llama 3.2 1B's
    with that size's dimensions."""
    if size_name in MODELS:
        return dict(MODELS[size_name])
    size = train_bench.SIZES[size_name]
    config = dict(MODELS["llama-3.2-1b"])
    config.update(vocab_size=size["vocab"], hidden_size=size["hidden"],
                  intermediate_size=size["intermediate"], num_hidden_layers=size["layers"],
                  num_attention_heads=size["heads"], num_key_value_heads=size["kv_heads"],
                  head_dim=size["hidden"] // size["heads"])
    return config


def flops_per_token(config, seq_len, rank=16):
    """Training FLOPs per token of the LoRA job on `config`: (6N+attn, LoRA). 6N+attn counts
    6 x every product's weights (the seven projections, the LM head once even when tied, the
    adapters) plus causal attention's 6 x (seq_len + 1) x heads x head_dim per layer; LoRA is
    common/flops.h's TrainingFlopsPerToken, the count Lathe's trainer reports MFU with: the
    frozen projections and the head 4x (forward and input gradients), the adapters and the
    attention 6x."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    layers, vocab = config["num_hidden_layers"], config["vocab_size"]
    shapes = [(hidden, heads * head_dim), (hidden, kv * head_dim), (hidden, kv * head_dim),
              (heads * head_dim, hidden), (hidden, inter), (hidden, inter), (inter, hidden)]
    weights = layers * sum(i * o for i, o in shapes) + vocab * hidden
    adapters = layers * sum(rank * (i + o) for i, o in shapes)
    attention = 2.0 * (seq_len + 1) * heads * head_dim * layers  # forward
    return (6 * (weights + adapters) + 3 * attention,
            4 * weights + 6 * adapters + 3 * attention)


def peak_flops(device_name, given_tflops):
    """(FLOP/s, where it came from): --peak-tflops, else the table by the device's name."""
    if given_tflops:
        return given_tflops * 1e12, "--peak-tflops"
    for part, flops in PEAK_BF16:
        if part in device_name:
            return flops, f'"{part}" in common/flops.cc\'s table'
    return None, "not in common/flops.cc's table (pass --peak-tflops)"


STEP_LINE = re.compile(r"^step\s+(\d+)/(\d+)\s+loss (\S+).*\btokens/s (\d+)\s+MFU ([0-9.]+)%\s+"
                       r"peak ([0-9.]+) MiB")
DONE_LINE = re.compile(r"^done: (\d+) steps in ([0-9.]+) s, (\d+) tokens/s")


def run_lathe_text(name, cmd, env):
    """`lathe-worker train` read from its text output (the engine-only build has no --output
    json): tokens/s over steps 2..N (the done line), the largest step peak of its memory
    tracker, the mean of its own MFU over steps 2..N, the last loss and the peak RSS."""
    stderr = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        stderr.seek(0)
        sys.exit(f"hf_baseline: {name} failed:\n  $ {' '.join(cmd)}\n{stderr.read()[-4000:]}")
    steps = [m for m in map(STEP_LINE.match, out.splitlines()) if m]
    done = next((m for m in map(DONE_LINE.match, out.splitlines()) if m), None)
    if not steps or done is None:
        sys.exit(f"hf_baseline: {name} printed no step or done lines:\n{out[-2000:]}")
    timed = steps[1:] or steps
    loss = steps[-1][3]
    return {"name": name, "tokens_per_s": float(done[3]),
            "final_loss": float(loss) if re.fullmatch(r"[-+0-9.eE]+", loss) else float("nan"),
            "tracker_peak": max(float(m[6]) for m in steps) * 1024 * 1024,
            "own_mfu": sum(float(m[5]) for m in timed) / len(timed) / 100,
            "peak_rss": usage.ru_maxrss * 1024}


def run_python(name, python, script, args, env):
    """A Python child's last stdout line, as JSON."""
    proc = subprocess.run([python, "-c", script, json.dumps(args)], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=env)
    if proc.returncode != 0:
        sys.exit(f"hf_baseline: {name} failed: {proc.stderr.strip()[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def device_main(args):
    """--device cuda: Lathe and HF + PEFT on the GPU (or, with --cpu-fallback and no GPU, the
    same path on the CPU)."""
    config = model_config(args.size)
    job = dict(MODEL_JOB) if args.size in MODELS else {
        k: train_bench.SIZES[args.size][k] for k in ("seq_len", "global_batch", "micro_batch")}
    for key in ("seq_len", "global_batch", "micro_batch"):
        if getattr(args, key) is not None:
            job[key] = getattr(args, key)
    if job["global_batch"] % job["micro_batch"] != 0:
        sys.exit(f"hf_baseline: --global-batch {job['global_batch']} is not a multiple of "
                 f"--micro-batch {job['micro_batch']}")
    seq = job["seq_len"]
    synth = os.path.join(args.bin_dir, "lathe-synth")
    worker = os.path.join(args.bin_dir, "lathe-worker")
    for b in (synth, worker):
        if not os.access(b, os.X_OK):
            sys.exit(f"hf_baseline: {b} not found (build lathe-synth and lathe-worker, or pass "
                     "--bin-dir)")
    work = tempfile.mkdtemp(prefix="lathe-hf-baseline-")
    env = train_bench.thread_env(args.threads)
    times = {}
    try:
        start = time.perf_counter()
        model = os.path.join(work, "model")
        built = run_python("building the model", args.python, BUILD_MODEL,
                           {"config": config, "out": model, "fallback": args.cpu_fallback}, env)
        times["model"] = time.perf_counter() - start
        device = built["device"]
        # Enough records for every step's sequences without repeating: lengths seq/2..2 seq.
        data = os.path.join(work, "train.jsonl")
        records = job["global_batch"] * args.steps + 8
        train_bench.run_quiet([synth, "data", "--out", data, "--vocab", str(config["vocab_size"]),
                               "--records", str(records), "--min-len", str(max(1, seq // 2)),
                               "--max-len", str(2 * seq), "--seed", "2"])
        spec = {
            "name": "hf-baseline-gpu", "model": {"path": model},
            "data": {"train": data, "seq_len": seq, "pack": True},
            "method": "lora",
            "lora": {"rank": 16, "alpha": 32, "dropout": 0.0, "targets": TARGETS},
            "train": {"steps": args.steps, "global_batch": job["global_batch"],
                      "micro_batch": job["micro_batch"], "lr": 1e-3,
                      "schedule": {"kind": "constant", "warmup_steps": 0},
                      "weight_decay": 0.0, "max_grad_norm": 1.0, "precision": "bf16",
                      "seed": 0},
            "resources": {"ranks": 1, "device": device},
            "strategy": {"zero_stage": 0, "activation_checkpointing": False,
                         "fused_kernels": True},
            "output": os.path.join(work, "out"),
        }
        spec_path = os.path.join(work, "job.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        start = time.perf_counter()
        lathe = run_lathe_text("Lathe bf16, fused kernels",
                               [worker, "train", "--spec", spec_path, "--threads",
                                str(args.threads)], env)
        times["lathe"] = time.perf_counter() - start
        start = time.perf_counter()
        hf = run_hf("HF+PEFT sdpa bf16", args.python, spec, "sdpa", True, args.threads,
                    args.steps, job, env, device=device, load_dtype="bfloat16")
        times["hf"] = time.perf_counter() - start
    finally:
        shutil.rmtree(work, ignore_errors=True)

    on_cpu = device == "cpu"
    mib = 1024 * 1024
    # On the CPU there is no device memory to compare: each process's peak RSS.
    lathe["peak_device"] = lathe["peak_rss"] if on_cpu else lathe["tracker_peak"]
    if on_cpu:
        hf["peak_device"] = hf["peak_rss"]
    six_n, lora = flops_per_token(config, seq)
    peak, peak_source = (None, "no GPU") if on_cpu else peak_flops(built["device_name"],
                                                                   args.peak_tflops)
    for r in (lathe, hf):
        r["mfu"] = six_n * r["tokens_per_s"] / peak if peak else None
        r["mfu_lora"] = lora * r["tokens_per_s"] / peak if peak else None
    speed = lathe["tokens_per_s"] / hf["tokens_per_s"]
    memory = lathe["peak_device"] / hf["peak_device"]
    where = ("CPU FALLBACK (torch sees no CUDA device): NOT a GPU measurement"
             if on_cpu else built["device_name"])
    heads = f"{config['num_attention_heads']}/{config['num_key_value_heads']}"
    print(f"## hf_baseline --device cuda — {args.size}: {config['model_type']} vocab "
          f"{config['vocab_size']}, hidden {config['hidden_size']}, "
          f"{config['num_hidden_layers']} layers, heads {heads}, intermediate "
          f"{config['intermediate_size']}, {built['parameters']:,} parameters "
          f"(random, bf16); seq_len {seq}, global batch {job['global_batch']} (micro "
          f"{job['micro_batch']}); LoRA r16 x 7; {args.steps} steps; {where}; torch "
          f"{built['torch']}, transformers {built['transformers']}; "
          f"{datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}")
    print()
    memory_kind = "peak RSS" if on_cpu else "peak device memory"
    print(f"| run | tokens/s | {memory_kind} (MiB) | final loss | MFU 6N+attn | MFU LoRA | "
          f"Lathe tokens/s vs it | Lathe memory vs it |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")

    def pct(x):
        return "n/a" if x is None else f"{100 * x:.1f}%"
    for r in (lathe, hf):
        print(f"| {r['name']} | {r['tokens_per_s']:.0f} | {r['peak_device'] / mib:.0f} | "
              f"{r['final_loss']:.4f} | {pct(r['mfu'])} | {pct(r['mfu_lora'])} | "
              f"{lathe['tokens_per_s'] / r['tokens_per_s']:.2f}x | "
              f"{lathe['peak_device'] / r['peak_device']:.2f}x |")
    print()
    if on_cpu:
        print(f"Memory: each process's peak RSS (ru_maxrss; Lathe's tracker counted "
              f"{lathe['tracker_peak'] / mib:.1f} MiB of libtorch CPU memory at its largest "
              f"step peak). MFU: none (no GPU peak).")
    else:
        print(f"Memory: Lathe's tracker (the largest step peak: the CUDA caching allocator's "
              f"allocated bytes, reset each step), HF's torch.cuda.max_memory_allocated over "
              f"the steps. MFU: FLOPs per token x tokens/s / {peak / 1e12:.1f} TFLOPS "
              f"({peak_source}); 6N+attn {six_n / 1e9:.2f} GFLOP/token, LoRA (common/flops.h) "
              f"{lora / 1e9:.2f}; Lathe's trainer reported {pct(lathe['own_mfu'])} (LoRA count)."
              if peak else f"MFU: the GPU's peak is {peak_source}.")
    print(f"Seconds: model built in {times['model']:.0f}, Lathe's run {times['lathe']:.0f}, "
          f"HF's {times['hf']:.0f}.")
    print()
    mfu_text = (f", MFU {pct(lathe['mfu'])} (HF {pct(hf['mfu'])})" if lathe["mfu"] is not None
                else "")
    memory_text = (f"{memory:.2f}x its {memory_kind} ({lathe['peak_device'] / mib:.0f} vs "
                   f"{hf['peak_device'] / mib:.0f} MiB)")
    speed_text = (f"Lathe {speed:.2f}x HF+PEFT tokens/s ({lathe['tokens_per_s']:.0f} vs "
                  f"{hf['tokens_per_s']:.0f})")
    if on_cpu:
        print("Goals (issue #29): judged on a GPU only.")
        print(f"summary: CPU fallback, not a GPU measurement: {args.size}: {speed_text}, "
              f"{memory_text}")
        return 0
    goals = [(f"tokens/s {speed:.2f}x (goal >= {GOAL_SPEED}x)", speed >= GOAL_SPEED),
             (f"peak memory {memory:.2f}x (goal <= {GOAL_MEMORY}x)", memory <= GOAL_MEMORY)]
    if lathe["mfu"] is not None:
        goals.append((f"MFU 6N+attn {pct(lathe['mfu'])} (goal >= {100 * GOAL_MFU:.0f}%)",
                      lathe["mfu"] >= GOAL_MFU))
    verdict = ", ".join(f"{g}: {'met' if m else 'NOT met'}" for g, m in goals)
    print(f"Goals (issue #29), Lathe against HF+PEFT: {verdict}.")
    print(f"summary: {args.size} seq {seq} x {job['global_batch']}: {speed_text}, "
          f"{memory_text}{mfu_text}; goals met {sum(m for _, m in goals)}/{len(goals)}")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin-dir", default=os.path.join(train_bench.SOURCE_DIR, "build", "bin"))
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cpu: issue #28's comparison; cuda: the GPU benchmark (issue #29)")
    ap.add_argument("--steps", type=int, help="default 20 (cpu), 8 (cuda)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--size", choices=sorted(train_bench.SIZES) + sorted(MODELS),
                    help="default small (cpu), llama-3.2-1b (cuda; the models' shapes need it)")
    ap.add_argument("--python", default=sys.executable,
                    help="interpreter with torch, transformers and peft")
    ap.add_argument("--seq-len", type=int, help="cuda: packed sequence length (default 2048)")
    ap.add_argument("--global-batch", type=int, help="cuda: sequences a step (default 8)")
    ap.add_argument("--micro-batch", type=int, help="cuda: sequences a micro-batch (default 4)")
    ap.add_argument("--peak-tflops", type=float,
                    help="cuda: the GPU's dense bf16 peak (default: by its name)")
    ap.add_argument("--cpu-fallback", action="store_true",
                    help="cuda: where torch sees no CUDA device, run the same comparison on "
                    "the CPU (scripts/gpu-check --dry-run)")
    args = ap.parse_args()
    if args.steps is None:
        args.steps = 8 if args.device == "cuda" else 20
    if args.size is None:
        args.size = "llama-3.2-1b" if args.device == "cuda" else "small"
    if args.steps < 2:
        sys.exit("hf_baseline: --steps must be >= 2 (step 1 is warm-up)")
    if args.device == "cuda":
        return device_main(args)
    if args.size not in train_bench.SIZES:
        sys.exit(f"hf_baseline: --size {args.size} needs --device cuda")
    size = train_bench.SIZES[args.size]
    cpu = train_bench.cpu_model()
    native_bf16 = "avx512_bf16" in cpu or "amx_bf16" in cpu
    busy = train_bench.cpu_busy()
    if busy > 0.2:
        print(f"hf_baseline: WARNING: the cores are {busy:.0%} busy before starting: these "
              "numbers understate both sides", file=sys.stderr)
    work = tempfile.mkdtemp(prefix="lathe-hf-baseline-")
    env = train_bench.thread_env(args.threads)
    rows = []
    try:
        model, data = train_bench.synthesize(os.path.join(args.bin_dir, "lathe-synth"), work,
                                             size)
        for precision in ["fp32"] + (["bf16"] if native_bf16 else []):
            spec = {
                "name": "hf-baseline", "model": {"path": model},
                "data": {"train": data, "seq_len": size["seq_len"], "pack": True},
                "method": "lora",
                "lora": {"rank": 16, "alpha": 32, "dropout": 0.0, "targets": TARGETS},
                "train": {"steps": args.steps, "global_batch": size["global_batch"],
                          "micro_batch": size["micro_batch"], "lr": 1e-3,
                          "schedule": {"kind": "constant", "warmup_steps": 0},
                          "weight_decay": 0.0, "max_grad_norm": 1.0, "precision": precision,
                          "seed": 0},
                "resources": {"ranks": 1, "device": "cpu"}, "strategy": "auto",
                "output": os.path.join(work, f"out-{precision}"),
            }
            spec_path = os.path.join(work, f"job-{precision}.json")
            with open(spec_path, "w") as f:
                json.dump(spec, f)
            lathe = train_bench.measure(
                f"Lathe {precision}", [os.path.join(args.bin_dir, "lathe-worker"), "train",
                                       "--spec", spec_path, "--output", "json", "--threads",
                                       str(args.threads)], env)
            hf = [run_hf(f"HF+PEFT {attention} {precision}", args.python, spec, attention,
                         precision == "bf16", args.threads, args.steps, size, env)
                  for attention in ("eager", "sdpa")]
            rows.append((precision, lathe, hf))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    mib = 1024 * 1024
    print(f"## hf_baseline — size {args.size}: llama vocab {size['vocab']}, hidden "
          f"{size['hidden']}, {size['layers']} layers, heads {size['heads']}/{size['kv_heads']}; "
          f"seq_len {size['seq_len']}, global batch {size['global_batch']} (micro "
          f"{size['micro_batch']}); LoRA r16 x 7; {args.steps} steps, {args.threads} threads; "
          f"{cpu}; {time.strftime('%Y-%m-%d')}")
    print()
    print("| precision | run | tokens/s | peak RSS (MiB) | final loss | Lathe tokens/s vs it | "
          "Lathe RSS vs it |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for precision, lathe, hf in rows:
        for r in [lathe] + hf:
            speed = lathe["tokens_per_s"] / r["tokens_per_s"]
            memory = lathe["peak_rss"] / r["peak_rss"]
            print(f"| {precision} | {r['name']} | {r['tokens_per_s']:.0f} | "
                  f"{r['peak_rss'] / mib:.0f} | {r['final_loss']:.4f} | {speed:.2f}x | "
                  f"{memory:.2f}x |")
    best = [max(hf, key=lambda r: r["tokens_per_s"]) for _, _, hf in rows]
    for (precision, lathe, _), b in zip(rows, best):
        met = (lathe["tokens_per_s"] >= 2 * b["tokens_per_s"] and
               lathe["peak_rss"] <= 0.5 * b["peak_rss"])
        print(f"\n{precision}: goal (>= 2x the best HF variant's tokens/s at <= 0.5x its peak "
              f"RSS) {'met' if met else 'NOT met'} against {b['name']}.")


if __name__ == "__main__":
    sys.exit(main())
