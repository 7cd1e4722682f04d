#!/usr/bin/env python3
"""The optimizers side by side on full fine-tuning, where optimizer state matters: peak
memory, the optimizer's own bytes, step time and loss after N steps for AdamW, 8-bit AdamW,
Adafactor, SGD with momentum and MeZO (zeroth order, no optimizer state, no gradients), on the
same model, data, precision and strategy (only train.optimizer or the method changes), with the
notes' table (../shared/seeds, genai-cookbook) beside it; then LoRA, QLoRA and MeZO over LoRA.

  .venv/bin/python bench/optimizer_bench.py [--bin-dir build/bin] [--steps 30] [--threads 2]
                                            [--size tiny|small|medium] [--keep DIR]

Runs `lathe-worker train` once per optimizer (method full, ZeRO 0, fp32, the job's lr for
each but SGD's). Peak RSS from os.wait4, the optimizer's bytes and the step's peak from the
trainer's own memory report (MemoryTracker), step and optimizer-phase times averaged over
steps 2..N. Prints a markdown table for bench/RESULTS.md.
"""

import argparse
import datetime
import json
import os
import platform
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_bench import SIZES, cpu_busy, cpu_model, measure, synthesize, thread_env  # noqa: E402

# name -> (train.* fields besides the job's own, top-level spec fields besides method full).
OPTIMIZERS = {
    "adamw": ({"optimizer": "adamw"}, {}),
    "adamw8bit": ({"optimizer": "adamw8bit"}, {}),
    "adamw8bit, paged": ({"optimizer": "adamw8bit", "paged_optimizer": True}, {}),
    "adafactor": ({"optimizer": "adafactor"}, {}),
    "adafactor + beta1 0.9": ({"optimizer": "adafactor", "adafactor_beta1": 0.9}, {}),
    "sgd + momentum 0.9": ({"optimizer": "sgd", "sgd_momentum": 0.9, "lr": 1e-2}, {}),
    "mezo (zeroth order)": ({"lr": 1e-5}, {"method": "mezo",
                                          "mezo": {"trainable": "full", "eps": 1e-3}}),
    # The methods, over LoRA r16 on all seven projections (AdamW).
    "lora r16": ({"lr": 1e-3}, {"method": "lora", "lora": {"rank": 16, "alpha": 32}}),
    "qlora r16": ({"lr": 1e-3}, {"method": "qlora", "lora": {"rank": 16, "alpha": 32}}),
    "mezo over lora r16": ({"lr": 1e-3}, {"method": "mezo", "lora": {"rank": 16, "alpha": 32},
                                          "mezo": {"trainable": "lora", "eps": 1e-3}}),
}
# The notes' table (genai-cookbook, a GPU, fp16 and gradient checkpointing for all but
# AdamW): peak GPU MB, train time s, train loss.
SEED = {"adamw": (12197, 464, 0.6911), "adafactor": (8514, 388, 0.7478),
        "adamw8bit": (8865, 310, 0.7591)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin-dir", default=os.path.join(os.path.dirname(__file__), "..", "build",
                                                      "bin"))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--keep", help="generate into this directory and keep it")
    args = ap.parse_args()
    if args.steps < 2:
        sys.exit("optimizer_bench: --steps must be >= 2 (step 1 is warm-up)")
    synth = os.path.join(args.bin_dir, "lathe-synth")
    worker = os.path.join(args.bin_dir, "lathe-worker")
    size = SIZES[args.size]
    busy = cpu_busy()
    work = args.keep or tempfile.mkdtemp(prefix="lathe-optimizer-bench-")
    os.makedirs(work, exist_ok=True)
    results = {}
    try:
        model, data = synthesize(synth, work, size)
        env = thread_env(args.threads)
        for name, (fields, top) in OPTIMIZERS.items():
            out_dir = os.path.join(work, "out")
            shutil.rmtree(out_dir, ignore_errors=True)
            train = {"steps": args.steps, "global_batch": size["global_batch"],
                     "micro_batch": size["micro_batch"], "lr": 1e-4,
                     "schedule": {"kind": "cosine", "warmup_steps": 2}, "weight_decay": 0.01,
                     "max_grad_norm": 1.0, "precision": "fp32", "seed": 0}
            train.update(fields)
            spec = {"name": "optimizer-bench", "model": {"path": model},
                    "data": {"train": data, "seq_len": size["seq_len"], "pack": True},
                    "method": "full", "train": train,
                    "resources": {"ranks": 1, "device": "cpu"},
                    "strategy": {"zero_stage": 0}, "output": out_dir}
            spec.update(top)
            spec_path = os.path.join(work, "job.json")
            with open(spec_path, "w") as f:
                json.dump(spec, f)
            results[name] = measure(name, [worker, "train", "--spec", spec_path, "--output",
                                           "json", "--threads", str(args.threads)], env)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    mib = 1024 * 1024
    print(f"## optimizer_bench — size {args.size}: llama vocab {size['vocab']}, hidden "
          f"{size['hidden']}, {size['layers']} layers, intermediate {size['intermediate']}; "
          f"full fine-tuning, fp32, seq_len {size['seq_len']}, global_batch "
          f"{size['global_batch']} (micro {size['micro_batch']}); {args.steps} steps, lr 1e-4 "
          f"(SGD 1e-2), {args.threads} threads")
    print(f"\n{platform.node()}, {cpu_model()}, {os.cpu_count()} cores, {platform.platform()}, "
          f"{datetime.date.today().isoformat()}, cores {busy:.0%} busy before the run\n")
    print("| optimizer | optimizer at peak MiB | step peak MiB | peak RSS MiB | step s | "
          "optimizer phase s | loss after N | vs AdamW: state, peak RSS, step | notes: peak GPU "
          "MB, time s, loss |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |")
    base = results["adamw"]

    def step_seconds(r):
        return sum(r["phases"].values())
    for name, r in results.items():
        seed = SEED.get(name)
        ratio = (f"{r['memory']['optimizer'] / max(1, base['memory']['optimizer']):.2f}, "
                 f"{r['peak_rss'] / base['peak_rss']:.2f}, "
                 f"{step_seconds(r) / step_seconds(base):.2f}")
        seed_text = (f"{seed[0]}, {seed[1]}, {seed[2]} (x{seed[0] / SEED['adamw'][0]:.2f} "
                     "peak)" if seed else "")
        print(f"| {name} | {r['memory']['optimizer'] / mib:.1f} | {r['memory']['total'] / mib:.1f} "
              f"| {r['peak_rss'] / mib:.0f} | {step_seconds(r):.3f} | "
              f"{r['phases']['optimizer']:.3f} | {r['final_loss']:.4f} | {ratio} | {seed_text} |")
    print("\nweights at the step's peak MiB: " + ", ".join(
        f"{name} {r['memory']['weights'] / mib:.1f}" for name, r in results.items()
        if "lora" in name))


if __name__ == "__main__":
    main()
