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
"""

import argparse
import json
import os
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
model = AutoModelForCausalLM.from_pretrained(args["model"], dtype=torch.float32,
                                             attn_implementation=args["attention"])
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
times, losses, row = [], [], 0
for step in range(args["steps"]):
    start = time.perf_counter()
    total = 0.0
    for _ in range(batch // micro):
        x = torch.tensor([rows[(row + k) % len(rows)] for k in range(micro)])
        row += micro
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args["bf16"]):
            loss = model(input_ids=x, labels=x).loss / (batch // micro)
        loss.backward()
        total += loss.item()
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    times.append(time.perf_counter() - start)
    losses.append(total)
tokens = batch * seq * (len(times) - 1)
print(json.dumps({"tokens_per_s": tokens / sum(times[1:]), "final_loss": losses[-1]}))
'''


def run_hf(name, python, spec, attention, bf16, threads, steps, size, env):
    """The HF loop's tokens/s and final loss, and its peak RSS (os.wait4)."""
    args = {"model": spec["model"]["path"], "data": spec["data"]["train"], "attention": attention,
            "bf16": bf16, "threads": threads, "steps": steps, "targets": TARGETS,
            "seq_len": size["seq_len"], "micro_batch": size["micro_batch"],
            "global_batch": size["global_batch"]}
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
            "final_loss": result["final_loss"], "peak_rss": usage.ru_maxrss * 1024}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin-dir", default=os.path.join(train_bench.SOURCE_DIR, "build", "bin"))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--size", choices=sorted(train_bench.SIZES), default="small")
    ap.add_argument("--python", default=sys.executable,
                    help="interpreter with torch, transformers and peft")
    args = ap.parse_args()
    if args.steps < 2:
        sys.exit("hf_baseline: --steps must be >= 2 (step 1 is warm-up)")
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
    main()
