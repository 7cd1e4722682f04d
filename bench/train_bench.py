#!/usr/bin/env python3
"""Training throughput and peak memory: `lathe-worker train` against the eager-PyTorch
reference (tests/reference/lathe_reference.py) on the same LoRA job.

  .venv/bin/python bench/train_bench.py [--bin-dir build/bin] [--steps 20] [--threads 2]
                                        [--size tiny|small|medium] [--keep DIR]
                                        [--roofline F32,BF16] [--preload LIB]
                                        [--profile-steps N [--profile-memory]]

Generates a model and a data set with lathe-synth, writes one LoRA job (rank 16, all seven
projections) per configuration (fp32 and bf16, each with and without activation
checkpointing; --configs picks), then runs the implementations one after the other as child
processes on each spec:
  - the C++ trainer;
  - the baseline, what a PyTorch user runs: the reference's eager loop, in fp32, or for bf16
    with bf16 base weights under torch.autocast("cpu", bfloat16) (--products autocast);
  - for bf16 also the reference's bf16-product mode (--products bf16: float32 products of
    bf16-rounded operands where the C++ trainer multiplies bf16), whose losses the C++
    trainer's must match within 2% at every step. (fp32's baseline is that check itself.)
Each child's peak RSS comes from os.wait4's rusage (ru_maxrss, KiB on Linux); tokens/s and the
per-phase times (forward, loss, backward, optimizer) from its step events 2..N (step 1 is
warm-up). The C++ trainer's step events also carry its CPU matrix products per phase and
type (FLOPs and seconds): their rate is stated against the roofline, the best GFLOP/s of
bench/roofline_bench --quick on the same threads (run first unless --roofline gives them).
Prints markdown tables, with the C++ trainer's memory by component, and warns when the losses
disagree. --preload LIB runs the C++ trainer with LD_PRELOAD=LIB (an allocator, say).
--profile-steps N runs the C++ trainer a second time per configuration, profiling its first
N steps (`lathe-worker train --profile-steps`, docs/observability.md, "Profiling"; with
--profile-memory the memory timeline too), and prints its tokens/s over steps 2..N against
the unprofiled run's over the same steps: the cost of a capture while it runs.
Run it with the project venv's Python (torch 2.11, the eager loop users run).
"""

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                "reference"))
import trainer_events  # noqa: E402  (flattens the C++ trainer's TrainerEvent lines)

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE_DIR = os.path.normpath(os.path.join(HERE, ".."))
REFERENCE = os.path.join(SOURCE_DIR, "tests", "reference", "lathe_reference.py")

# Model shape, sequence length, batch. "small" keeps the default run (20 steps, both
# implementations) within about three minutes on two cores.
SIZES = {
    "tiny": dict(vocab=256, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128,
                 seq_len=64, global_batch=4, micro_batch=2, records=64, min_len=16, max_len=96),
    "small": dict(vocab=8192, hidden=512, layers=4, heads=8, kv_heads=4, intermediate=1408,
                  seq_len=256, global_batch=8, micro_batch=4, records=200, min_len=64,
                  max_len=512),
    "medium": dict(vocab=32000, hidden=1024, layers=8, heads=16, kv_heads=8, intermediate=2816,
                   seq_len=512, global_batch=8, micro_batch=2, records=400, min_len=128,
                   max_len=1024),
}
LOSS_TOL = 1e-3  # fp32: final losses, absolute
BF16_STEP_TOL = 0.02  # bf16: every step's loss, relative (issue #16)
PHASES = ("forward", "loss", "backward", "optimizer")
# name -> (train.precision, activation checkpointing)
CONFIGS = {"fp32": ("fp32", False), "bf16": ("bf16", False),
           "fp32+ckpt": ("fp32", True), "bf16+ckpt": ("bf16", True)}
COMPONENTS = ("weights", "trainable", "gradients", "optimizer", "activations", "logits",
              "comm_buffers", "overhead")


def run_quiet(cmd, env=None):
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=env)
    if proc.returncode != 0:
        sys.exit(f"train_bench: {' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr}")
    return proc.stdout


def cpu_busy(seconds=1.0):
    """Fraction of all cores busy over `seconds` (from /proc/stat), before the run."""
    def sample():
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        return idle, sum(fields)
    try:
        idle0, total0 = sample()
        time.sleep(seconds)
        idle1, total1 = sample()
    except (OSError, ValueError, IndexError):
        return 0.0
    total = total1 - total0
    return 1.0 - (idle1 - idle0) / total if total > 0 else 0.0


def cpu_model():
    """The CPU's model name and its vector extensions that matter here."""
    model, flags = "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model == "unknown CPU":
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    wanted = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{model} ({' '.join(wanted) or 'no AVX2'})"


def synthesize(synth, work, size):
    """The model and data set of `size` under `work` (kept when already there): their paths."""
    model = os.path.join(work, "model")
    data = os.path.join(work, "train.jsonl")
    if not os.path.exists(os.path.join(model, "config.json")):
        run_quiet([synth, "model", "--out", model, "--type", "llama",
                   "--vocab", str(size["vocab"]), "--hidden", str(size["hidden"]),
                   "--layers", str(size["layers"]), "--heads", str(size["heads"]),
                   "--kv-heads", str(size["kv_heads"]), "--intermediate", str(size["intermediate"]),
                   "--max-pos", str(max(512, size["seq_len"])), "--seed", "1"])
    if not os.path.exists(data):
        run_quiet([synth, "data", "--out", data, "--vocab", str(size["vocab"]),
                   "--records", str(size["records"]), "--min-len", str(size["min_len"]),
                   "--max-len", str(size["max_len"]), "--seed", "2"])
    return model, data


def thread_env(threads):
    """This environment with every BLAS/OpenMP thread count set to `threads`."""
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = str(threads)
    return env


def measure(name, cmd, env):
    """Runs `cmd`, returning its JSON events, wall seconds and peak RSS in bytes."""
    stderr = tempfile.TemporaryFile(mode="w+")
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
    out = proc.stdout.read()  # drain before waiting, so a full pipe cannot block the child
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        stderr.seek(0)
        sys.exit(f"train_bench: {name} failed ({proc.returncode}):\n  $ {' '.join(cmd)}\n"
                 f"{stderr.read()[-4000:]}")
    events = trainer_events.read_events(out)
    steps = [e for e in events if e.get("event") == "step"]
    done = next((e for e in events if e.get("event") == "done"), None)
    if not steps or done is None:
        sys.exit(f"train_bench: {name} printed no step/done events:\n{out[-2000:]}")
    timed = steps[1:] if len(steps) > 1 else steps
    tokens = sum(s["tokens"] for s in timed)
    seconds = sum(s["tokens"] / s["tokens_per_s"] for s in timed if s["tokens_per_s"] > 0)
    phases = {p: sum(s.get("phases", {}).get(p, 0.0) for s in timed) / len(timed)
              for p in PHASES}
    # The C++ trainer's own accounting: the components of its largest step peak.
    memory = max((s["memory"] for s in steps if "memory" in s), key=lambda m: m["total"],
                 default=None)
    mfus = [s["mfu"] for s in timed if s.get("mfu") is not None]
    products = {}  # (phase, dtype) -> [flops, seconds] over steps 2..N
    for s in timed:
        for p in s.get("kernel_products", []):
            tally = products.setdefault((p["phase"], p["dtype"]), [0.0, 0.0])
            tally[0] += p["flops"] or 0.0
            tally[1] += p["seconds"] or 0.0
    return {"name": name, "tokens_per_s": tokens / seconds if seconds > 0 else float("nan"),
            "mfu": sum(mfus) / len(mfus) if mfus else None,
            "peak_rss": usage.ru_maxrss * 1024, "final_loss": done.get("final_loss"),
            "losses": [s["loss"] for s in steps], "products": products,
            "per_step": [(s["tokens"], s["tokens"] / s["tokens_per_s"] if s["tokens_per_s"] > 0
                          else 0.0) for s in steps],
            "wall": wall, "steps": len(steps), "phases": phases, "memory": memory}


def roofline(bin_dir, threads, given):
    """{"f32": GFLOP/s, "bf16": GFLOP/s or None}: `given` ("F32,BF16") or the best figures of
    roofline_bench --quick on `threads` threads."""
    if given:
        try:
            f32, bf16 = (float(x) for x in given.split(","))
        except ValueError:
            sys.exit(f"train_bench: --roofline: {given!r} is not F32,BF16 (GFLOP/s)")
        return {"f32": f32, "bf16": bf16}
    bench = os.path.join(bin_dir, "roofline_bench")
    if not os.access(bench, os.X_OK):
        sys.exit(f"train_bench: {bench} not found (build it, or pass --roofline F32,BF16)")
    out = run_quiet([bench, "--quick"], thread_env(threads))
    # "roofline, 2 threads: f32 229.4 GFLOP/s (...); bf16 443.3 GFLOP/s (...)", the bf16
    # figure absent where the CPU has none
    found = re.search(rf"^roofline, {threads} threads?: f32 ([0-9.]+) GFLOP/s.*; bf16 "
                      r"(?:([0-9.]+) GFLOP/s)?", out, re.MULTILINE)
    if found:
        return {"f32": float(found[1]), "bf16": float(found[2]) if found[2] else None}
    sys.exit(f"train_bench: roofline_bench printed no roofline for {threads} threads "
             f"(cores: {os.cpu_count()})")


def max_step_difference(losses, reference):
    """The largest relative difference between two runs' step losses (None where missing)."""
    pairs = [(a, b) for a, b in zip(losses, reference) if a is not None and b is not None]
    if len(pairs) != len(reference) or len(losses) != len(reference):
        return float("inf")
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in pairs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin-dir", default=os.path.join(SOURCE_DIR, "build", "bin"))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--python", default=sys.executable,
                    help="interpreter for the reference (needs torch)")
    ap.add_argument("--keep", help="generate into this directory and keep it")
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help="comma-separated subset of " + ", ".join(CONFIGS))
    ap.add_argument("--roofline", help="F32,BF16: the roofline in GFLOP/s (default: measure it "
                    "with roofline_bench --quick)")
    ap.add_argument("--preload", help="LD_PRELOAD for the C++ trainer (e.g. an allocator)")
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="also run the C++ trainer profiling its first N steps (2..20)")
    ap.add_argument("--profile-memory", action="store_true",
                    help="with --profile-steps: record the memory timeline too")
    args = ap.parse_args()
    if args.steps < 2:
        sys.exit("train_bench: --steps must be >= 2 (step 1 is warm-up)")
    if args.profile_steps and not 2 <= args.profile_steps <= min(args.steps, 20):
        sys.exit("train_bench: --profile-steps must be in 2..min(--steps, 20)")
    for config in args.configs.split(","):
        if config not in CONFIGS:
            sys.exit(f"train_bench: --configs: unknown {config!r} (known: {', '.join(CONFIGS)})")
    synth = os.path.join(args.bin_dir, "lathe-synth")
    worker = os.path.join(args.bin_dir, "lathe-worker")
    for b in (synth, worker):
        if not os.access(b, os.X_OK):
            sys.exit(f"train_bench: {b} not found (build first, or pass --bin-dir)")

    size = SIZES[args.size]
    if args.preload and not os.path.exists(args.preload):
        sys.exit(f"train_bench: --preload: {args.preload} does not exist")
    busy = cpu_busy()
    if busy > 0.2:
        print(f"train_bench: WARNING: the cores are {busy:.0%} busy before starting: other "
              "processes compete for them (OpenMP threads degrade badly when oversubscribed), "
              "so these numbers understate both implementations", file=sys.stderr)
    work = args.keep or tempfile.mkdtemp(prefix="lathe-train-bench-")
    os.makedirs(work, exist_ok=True)
    try:
        model, data = synthesize(synth, work, size)
        env = thread_env(args.threads)
        cpp_env = dict(env, LD_PRELOAD=args.preload) if args.preload else env
        best = roofline(args.bin_dir, args.threads, args.roofline)
        results = {}
        profiled = {}  # config -> (unprofiled run, profiled run, profile dir) with its sizes
        for config in args.configs.split(","):
            precision, checkpointing = CONFIGS[config]
            out_dir = os.path.join(work, "out")
            shutil.rmtree(out_dir, ignore_errors=True)
            spec = {
                "name": f"train-bench-{args.size}",
                "model": {"path": model},
                "data": {"train": data, "seq_len": size["seq_len"], "pack": True},
                "method": "lora",
                "lora": {"rank": 16, "alpha": 32, "dropout": 0.0,
                         "targets": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                     "up_proj", "down_proj"]},
                "train": {"steps": args.steps, "global_batch": size["global_batch"],
                          "micro_batch": size["micro_batch"], "lr": 1e-3,
                          "schedule": {"kind": "cosine", "warmup_steps": 2},
                          "weight_decay": 0.0, "max_grad_norm": 1.0, "precision": precision,
                          "seed": 0},
                "resources": {"ranks": 1, "device": "cpu"},
                "strategy": {"activation_checkpointing": True} if checkpointing else "auto",
                "output": out_dir,
            }
            spec_path = os.path.join(work, f"job-{config}.json")
            with open(spec_path, "w") as f:
                json.dump(spec, f, indent=2)
            cpp_cmd = [worker, "train", "--spec", spec_path, "--output", "json", "--threads",
                       str(args.threads)]
            cpp = measure(f"{config} C++", cpp_cmd, cpp_env)
            if args.profile_steps:
                shutil.rmtree(out_dir, ignore_errors=True)
                profile_dir = os.path.join(work, f"profile-{config}")
                shutil.rmtree(profile_dir, ignore_errors=True)
                flags = ["--profile-steps", str(args.profile_steps), "--profile-dir", profile_dir]
                if args.profile_memory:
                    flags.append("--profile-memory")
                run = measure(f"{config} C++ profiled", cpp_cmd + flags, cpp_env)
                files = [os.path.join(d, f) for d, _, names in os.walk(profile_dir)
                         for f in names]
                profiled[config] = (cpp, run, {os.path.basename(f): os.path.getsize(f)
                                               for f in files})

            def reference(products):
                shutil.rmtree(out_dir, ignore_errors=True)
                return measure(f"{config} reference --products {products}",
                               [args.python, REFERENCE, "train", "--spec", spec_path, "--output",
                                "json", "--threads", str(args.threads), "--products", products],
                               env)
            if precision == "bf16":
                results[config] = (cpp, reference("autocast"), reference("bf16"))
            else:
                baseline = reference("widen")
                results[config] = (cpp, baseline, baseline)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    mib = 1024 * 1024
    tokens_per_step = size["global_batch"] * size["seq_len"]
    print(f"## train_bench — size {args.size}: llama vocab {size['vocab']}, hidden "
          f"{size['hidden']}, {size['layers']} layers, heads {size['heads']}/{size['kv_heads']}, "
          f"intermediate {size['intermediate']}; seq_len {size['seq_len']}, global_batch "
          f"{size['global_batch']} (micro {size['micro_batch']}), {tokens_per_step} tokens/step; "
          f"LoRA r16 x 7 targets; {args.steps} steps (tokens/s over steps 2..N), "
          f"{args.threads} threads")
    print(f"\n{platform.node()}, {cpu_model()}, {os.cpu_count()} cores, {platform.platform()}, "
          f"{datetime.date.today().isoformat()}, cores {busy:.0%} busy before the run\n")
    print("Baseline: the reference's eager loop (fp32), or bf16 base weights under CPU autocast "
          "(bf16). Loss check: fp32's final losses (absolute), bf16's every step against the "
          "reference's bf16-product mode (relative).\n")
    print("| config | C++ tokens/s | baseline tokens/s | ratio | C++ peak RSS MiB | baseline peak "
          "RSS MiB | ratio | final loss C++ / baseline / check | loss check | C++ MFU |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | ---: |")
    mismatched = []
    for config, (cpp, base, check) in results.items():
        if CONFIGS[config][0] == "bf16":
            diff = max_step_difference(cpp["losses"], check["losses"])
            ok = diff <= BF16_STEP_TOL
            check_text = f"max step {100 * diff:.2f}% ({'ok' if ok else 'FAIL'})"
        else:
            a, b = cpp["final_loss"], check["final_loss"]
            diff = abs(a - b) if a is not None and b is not None else float("inf")
            ok = diff <= LOSS_TOL
            check_text = f"final {diff:.1e} ({'ok' if ok else 'FAIL'})"
        if not ok:
            mismatched.append(config)
        losses = [r["final_loss"] for r in (cpp, base, check)]
        loss_text = " / ".join("n/a" if x is None else f"{x:.6f}" for x in losses)
        mfu_text = "n/a" if cpp["mfu"] is None else f"{100 * cpp['mfu']:.1f}%"
        print(f"| {config} | {cpp['tokens_per_s']:.1f} | {base['tokens_per_s']:.1f} | "
              f"{cpp['tokens_per_s'] / base['tokens_per_s']:.2f}x | {cpp['peak_rss'] / mib:.1f} "
              f"| {base['peak_rss'] / mib:.1f} | {cpp['peak_rss'] / base['peak_rss']:.2f}x | "
              f"{loss_text} | {check_text} | {mfu_text} |")
    print("\nMean seconds per step by phase (steps 2..N), C++ / baseline:\n")
    print("| config | " + " | ".join(PHASES) + " |")
    print("| --- |" + " ---: |" * len(PHASES))
    for config, (cpp, base, _) in results.items():
        cells = [f"{cpp['phases'][p]:.3f} / {base['phases'][p]:.3f}" for p in PHASES]
        print(f"| {config} | " + " | ".join(cells) + " |")
    bf16_text = "n/a" if best["bf16"] is None else f"{best['bf16']:.1f}"
    print(f"\nThe C++ trainer's CPU matrix products by phase (steps 2..N): GFLOP/s and the "
          f"fraction of the roofline ({best['f32']:.1f} GFLOP/s f32, {bf16_text} bf16, "
          f"{args.threads} threads); share: the products' part of the phase's time.\n")
    print("| config | phase | f32 GFLOP/s | f32 of roofline | bf16 GFLOP/s | bf16 of roofline "
          "| share of phase |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for config, (cpp, _, _) in results.items():
        timed_steps = max(cpp["steps"] - 1, 1)
        for phase in PHASES:
            cells, seconds = [], 0.0
            for dtype in ("f32", "bf16"):
                flops, secs = cpp["products"].get((phase, dtype), (0.0, 0.0))
                seconds += secs
                if secs <= 0 or not best.get(dtype):
                    cells += ["-", "-"]
                    continue
                rate = flops / secs / 1e9
                cells += [f"{rate:.1f}", f"{100 * rate / best[dtype]:.0f}%"]
            phase_seconds = cpp["phases"][phase] * timed_steps
            if seconds <= 0:
                continue
            share = f"{100 * seconds / phase_seconds:.0f}%" if phase_seconds > 0 else "-"
            print(f"| {config} | {phase} | " + " | ".join(cells) + f" | {share} |")
    print("\nC++ memory at its largest step peak, by component (MiB, the tracker's count):\n")
    print("| config | " + " | ".join(COMPONENTS) + " | total |")
    print("| --- |" + " ---: |" * (len(COMPONENTS) + 1))
    for config, (cpp, _, _) in results.items():
        m = cpp["memory"] or {}
        cells = [f"{m.get(c, 0) / mib:.1f}" for c in COMPONENTS + ("total",)]
        print(f"| {config} | " + " | ".join(cells) + " |")
    if profiled:
        n = args.profile_steps
        print(f"\nProfiling cost: the C++ trainer with its first {n} steps profiled "
              f"(--profile-steps{' --profile-memory' if args.profile_memory else ''}) against "
              f"the run without, tokens/s over steps 2..{n} of each; the capture's files:\n")
        print("| config | tokens/s off | tokens/s profiling | ratio | files (KiB) |")
        print("| --- | ---: | ---: | ---: | --- |")
        for config, (off, on, sizes) in profiled.items():
            def rate(run):
                tokens = sum(t for t, _ in run["per_step"][1:n])
                seconds = sum(sec for _, sec in run["per_step"][1:n])
                return tokens / seconds if seconds > 0 else float("nan")
            files = ", ".join(f"{name} {size / 1024:.0f}" for name, size in sorted(sizes.items()))
            print(f"| {config} | {rate(off):.1f} | {rate(on):.1f} | {rate(on) / rate(off):.2f}x "
                  f"| {files} |")
    if mismatched:
        print(f"\nWARNING: the losses disagree in {mismatched} (fp32: final losses more than "
              f"{LOSS_TOL} apart; bf16: a step more than {100 * BF16_STEP_TOL:.0f}% from the "
              "reference's bf16-product mode): the implementations do not compute the same "
              "training (docs/training.md)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
