#!/usr/bin/env python3
"""Per-rank memory by component under ZeRO stages 0-3 on 1, 2 and 4 ranks, measured next to
the formulas of docs/sharding.md, and ZeRO-3's communication time with and without prefetch.

  python3 bench/shard_memory.py [--bin-dir build/bin] [--steps 3] [--keep DIR]

A LoRA job on a model whose frozen weights dominate (32M parameters, LoRA rank 8 on every
projection: 0.6M trainable) runs as real processes over gloo (bench/ranks.py). Memory is the
tracking allocator's breakdown at the last step's peak (rank 0; the ranks agree to within
the data's lengths). Prints markdown tables for bench/RESULTS.md and checks issue #10's
bound: at ZeRO-3 on 4 ranks, weights + trainable + gradients + optimizer per rank is at
most a quarter of the single-process figure plus the two largest gathered units."""
import argparse
import datetime
import os
import shutil
import subprocess
import sys
import tempfile

import ranks as launcher

MODEL = dict(vocab=8192, hidden=512, layers=8, heads=8, kv_heads=4, intermediate=1408)
LORA_RANK = 8
MIB = 1 << 20
FIXED = ("weights", "trainable", "gradients", "optimizer")


def units(m, lora_rank):
    """(frozen, trainable) element counts of every unit, as CausalLm::UnitTensors lays them
    out: the embeddings, each block (norms, projections; LoRA A and B), the final norm and
    an untied LM head."""
    h, i, d = m["hidden"], m["intermediate"], m["hidden"] // m["heads"]
    shapes = [(h, m["heads"] * d), (h, m["kv_heads"] * d), (h, m["kv_heads"] * d),
              (m["heads"] * d, h), (h, i), (h, i), (i, h)]  # (in, out) of the seven
    block_frozen = 2 * h + sum(a * b for a, b in shapes)
    block_lora = sum(lora_rank * (a + b) for a, b in shapes)
    return ([(m["vocab"] * h, 0)] + [(block_frozen, block_lora)] * m["layers"] +
            [(h + m["vocab"] * h, 0)])


def predicted(stage, n, weight_bytes=4):
    """docs/sharding.md's per-rank formulas, in bytes, for the fixed components and for one
    gathered unit (ZeRO-3)."""
    shard = lambda x: -(-x // n)  # noqa: E731  (ceil)
    us = units(MODEL, LORA_RANK)
    frozen = sum(f for f, _ in us)
    trainable = sum(t for _, t in us)
    if stage == 0:
        return dict(weights=weight_bytes * frozen, trainable=4 * trainable,
                    gradients=4 * trainable, optimizer=8 * trainable), 0
    slices = sum(shard(t) for _, t in us)
    weights = weight_bytes * (sum(shard(f) for f, _ in us) if stage == 3 else frozen)
    whole_trainable = 4 * (slices if stage == 3 else sum(n * shard(t) for _, t in us))
    gradients = 4 * (trainable if stage == 1 else slices)
    largest = max(n * (weight_bytes * shard(f) + 4 * shard(t)) for f, t in us)
    return dict(weights=weights, trainable=whole_trainable, gradients=gradients,
                optimizer=8 * slices), (largest if stage == 3 else 0)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bin-dir", default=os.path.join(os.path.dirname(__file__), "..",
                                                           "build", "bin"))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--keep", help="keep the work directory here")
    args = parser.parse_args()
    work = args.keep or tempfile.mkdtemp(prefix="lathe-shard-memory-")
    os.makedirs(work, exist_ok=True)
    synth = os.path.join(args.bin_dir, "lathe-synth")
    m = MODEL
    subprocess.run([synth, "model", "--out", f"{work}/model", "--vocab", str(m["vocab"]),
                    "--hidden", str(m["hidden"]), "--layers", str(m["layers"]), "--heads",
                    str(m["heads"]), "--kv-heads", str(m["kv_heads"]), "--intermediate",
                    str(m["intermediate"])], check=True, stdout=subprocess.DEVNULL)
    subprocess.run([synth, "data", "--out", f"{work}/train.jsonl", "--records", "64",
                    "--vocab", str(m["vocab"]), "--min-len", "100", "--max-len", "160"],
                   check=True, stdout=subprocess.DEVNULL)

    def run(name, ranks, stage, extra=()):
        spec = launcher.write_spec(f"{work}/{name}.yaml", {
            "name": name, "model": f"{{path: {work}/model}}",
            "data": f"{{train: {work}/train.jsonl, seq_len: 128}}",
            "lora": f"{{rank: {LORA_RANK}, alpha: 16}}",
            "train": f"{{steps: {args.steps}, global_batch: 4, micro_batch: 1, lr: 1.0e-4}}",
            "resources": f"{{ranks: {ranks}, device: cpu}}",
            "strategy": f"{{zero_stage: {stage}}}",
            "output": f"{work}/out/{name}"})
        return launcher.run_ranks(args.bin_dir, spec, ranks, work, extra=extra)

    print(f"# ZeRO memory, {datetime.date.today()}, {launcher.machine()}\n")
    print(f"LoRA rank {LORA_RANK} on {m}; seq_len 128, global batch 4, micro-batch 1; "
          f"memory of rank 0 at the last step's peak, MiB (measured / formula)\n")
    print("| stage | ranks | weights | trainable | gradients | optimizer | comm_buffers "
          "| activations | W+T+G+O |")
    print("|---|---|---|---|---|---|---|---|---|")
    fixed_sum = {}
    largest_unit = {}
    for stage in (0, 1, 2, 3):
        for ranks in (1, 2, 4):
            events = run(f"z{stage}-r{ranks}", ranks, stage)
            memory = launcher.steps(events[0])[-1]["memory"]
            want, largest_unit[stage, ranks] = predicted(stage, ranks)
            cells = [f"{memory.get(c, 0) / MIB:.2f} / {want[c] / MIB:.2f}" for c in FIXED]
            fixed_sum[stage, ranks] = sum(memory.get(c, 0) for c in FIXED)
            print(f"| {stage} | {ranks} | " + " | ".join(cells) +
                  f" | {memory.get('comm_buffers', 0) / MIB:.2f} | "
                  f"{memory.get('activations', 0) / MIB:.2f} | "
                  f"{fixed_sum[stage, ranks] / MIB:.2f} / {sum(want.values()) / MIB:.2f} |",
                  flush=True)
    single, four = fixed_sum[0, 1], fixed_sum[3, 4]
    bound = single / 4 + 2 * largest_unit[3, 4]
    print(f"\nZeRO-3 on 4 ranks: W+T+G+O {four / MIB:.2f} MiB per rank; bound: a quarter of the "
          f"single process's {single / MIB:.2f} MiB plus two gathered units of "
          f"{largest_unit[3, 4] / MIB:.2f} MiB = {bound / MIB:.2f} MiB: "
          f"{'met' if four <= bound else 'MISSED'}\n")

    print("| ZeRO-3 ranks | prefetch | step s | comm (blocked) s per step |")
    print("|---|---|---|---|")
    for ranks in (2, 4):
        for prefetch in ("off", "on"):
            events = run(f"z3-r{ranks}-prefetch-{prefetch}", ranks, 3,
                         extra=("--prefetch", prefetch))
            timed = launcher.steps(events[0])[1:]  # step 1 is warm-up
            step_s = timed[-1]["step_seconds"]  # the mean over steps 2..N
            comm = sum(s["phases"]["comm"] for s in timed) / len(timed)
            print(f"| {ranks} | {prefetch} | {step_s:.3f} | {comm:.3f} |", flush=True)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if four <= bound else 1


if __name__ == "__main__":
    sys.exit(main())
