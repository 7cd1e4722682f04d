#!/usr/bin/env python3
"""The whole ZeRO matrix of issue #10 as real processes over gloo: ranks 1-4 x stages 0-3,
LoRA and full fine-tuning, optimizer offload (stages 1-3) and parameter offload (stage 3),
bf16 and fp16 at stage 3. Every run's per-step losses must equal the single-process run of
the same global batch within 1e-5 relative (fp32: summation order is the only difference).

  python3 bench/shard_matrix.py [--bin-dir build/bin] [--keep DIR]

Sizes are chosen so that no rank count divides the flat buffers evenly (LoRA rank 5, a
vocabulary of 250). Prints one line per run and a summary; exits 1 when any run misses.
A subset runs in scripts/test (tests/shard/sharded_trainer_test.cc, tests/e2e)."""
import argparse
import datetime
import os
import shutil
import subprocess
import sys
import tempfile
import time

import ranks as launcher

TOLERANCE = 1e-5


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bin-dir", default=os.path.join(os.path.dirname(__file__), "..",
                                                           "build", "bin"))
    parser.add_argument("--keep", help="keep the work directory here")
    args = parser.parse_args()
    work = args.keep or tempfile.mkdtemp(prefix="lathe-shard-matrix-")
    os.makedirs(work, exist_ok=True)
    synth = os.path.join(args.bin_dir, "lathe-synth")
    subprocess.run([synth, "model", "--out", f"{work}/model", "--vocab", "250", "--hidden", "48",
                    "--intermediate", "100", "--layers", "3"], check=True,
                   stdout=subprocess.DEVNULL)
    subprocess.run([synth, "data", "--out", f"{work}/train.jsonl", "--records", "96",
                    "--vocab", "250"], check=True, stdout=subprocess.DEVNULL)

    def spec(name, ranks, method, stage=None, precision="fp32", offload_optimizer=False,
             offload_params=False):
        strategy = "auto" if stage is None else (
            f"{{zero_stage: {stage}, offload_optimizer: {str(offload_optimizer).lower()}, "
            f"offload_params: {str(offload_params).lower()}}}")
        lr = "1.0e-3" if method == "full" else "1.0e-2"
        return launcher.write_spec(f"{work}/{name}.yaml", {
            "name": name, "method": method,
            "model": f"{{path: {work}/model}}",
            "data": f"{{train: {work}/train.jsonl, seq_len: 24}}",
            "lora": "{rank: 5, alpha: 10}",
            "train": (f"{{steps: 4, global_batch: 12, micro_batch: 1, lr: {lr}, "
                      f"weight_decay: 0.01, max_grad_norm: 0.5, precision: {precision}}}"),
            "resources": f"{{ranks: {ranks}, device: cpu}}",
            "strategy": strategy,
            "output": f"{work}/out/{name}"})

    def losses(name, ranks, **kw):
        events = launcher.run_ranks(args.bin_dir, spec(name, ranks, **kw), ranks, work)
        per_rank = [[s["loss"] for s in launcher.steps(e)] for e in events]
        if any(p != per_rank[0] for p in per_rank):
            raise RuntimeError("the ranks report different losses")
        return per_rank[0]

    runs = []
    for method in ("lora", "full"):
        for precision in ("fp32", "bf16", "fp16"):
            reference = losses(f"{method}-{precision}-single", 1, method=method,
                               precision=precision)
            variants = []
            for stage in (0, 1, 2, 3):
                if precision != "fp32" and stage != 3:
                    continue
                variants.append((stage, False, False))
                if stage >= 1 and precision == "fp32":
                    variants.append((stage, True, False))
                if stage == 3 and precision == "fp32":
                    variants.append((stage, True, True))
            for stage, offload_opt, offload_params in variants:
                for ranks in (1, 2, 3, 4):
                    name = (f"{method}-{precision}-z{stage}-r{ranks}" +
                            ("-offopt" if offload_opt else "") +
                            ("-offparams" if offload_params else ""))
                    start = time.time()
                    try:
                        got = losses(name, ranks, method=method, stage=stage,
                                     precision=precision, offload_optimizer=offload_opt,
                                     offload_params=offload_params)
                        worst = max(abs(g - w) / abs(w) for g, w in zip(got, reference))
                        ok = len(got) == len(reference) and worst <= TOLERANCE
                        note = f"worst relative difference {worst:.1e}"
                    except RuntimeError as e:
                        ok, note = False, str(e)
                    runs.append((name, ok))
                    print(f"{'ok  ' if ok else 'FAIL'} {name:34s} {note} "
                          f"({time.time() - start:.1f} s)", flush=True)
    failed = [name for name, ok in runs if not ok]
    print(f"\n{len(runs) - len(failed)} of {len(runs)} runs match the single process within "
          f"{TOLERANCE:g} relative; {datetime.date.today()}; {launcher.machine()}")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
