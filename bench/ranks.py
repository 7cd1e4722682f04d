"""Runs one job on N ranks as real processes: `lathe-worker train --spec` per rank, meeting
in a fresh --rendezvous-dir and talking over gloo, as without a coordinator. Shared by
bench/shard_matrix.py and bench/shard_memory.py."""
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                "reference"))
import trainer_events  # noqa: E402
from train_bench import cpu_model  # noqa: E402


def machine():
    """The CPU model and flags and the core count, for every benchmark record."""
    return f"{cpu_model()}, {os.cpu_count()} cores"


def synth_model(bin_dir, out, m):
    """`lathe-synth model` with the sizes of `m` (vocab, hidden, layers, heads, kv_heads,
    intermediate; optionally type, head_dim, partial_rotary and longrope)."""
    flags = (("type", "--type"), ("head_dim", "--head-dim"),
             ("partial_rotary", "--partial-rotary"), ("longrope", "--longrope"))
    extra = [arg for key, flag in flags if key in m for arg in (flag, str(m[key]))]
    subprocess.run([os.path.join(bin_dir, "lathe-synth"), "model", "--out", out, "--vocab",
                    str(m["vocab"]), "--hidden", str(m["hidden"]), "--layers", str(m["layers"]),
                    "--heads", str(m["heads"]), "--kv-heads", str(m["kv_heads"]),
                    "--intermediate", str(m["intermediate"]), *extra], check=True,
                   stdout=subprocess.DEVNULL)


def synth_data(bin_dir, out, vocab, seq_len):
    """64 records, every one longer than `seq_len`: every sequence is seq_len tokens, all of
    them targets, the case the planner sizes."""
    subprocess.run([os.path.join(bin_dir, "lathe-synth"), "data", "--out", out, "--records",
                    "64", "--vocab", str(vocab), "--min-len", str(seq_len + 8), "--max-len",
                    str(seq_len + 40)], check=True, stdout=subprocess.DEVNULL)


def write_spec(path, fields):
    """A YAML job spec from a dict of top-level field -> inline YAML text."""
    with open(path, "w") as f:
        for key, value in fields.items():
            f.write(f"{key}: {value}\n")
    return path


def run_ranks(bin_dir, spec_path, ranks, work_dir, threads=1, extra=(), timeout=600):
    """Runs every rank and waits; returns each rank's flattened events. Raises with the
    ranks' stderr when one fails."""
    rendezvous = tempfile.mkdtemp(prefix="rdv-", dir=work_dir)
    procs = []
    for rank in range(ranks):
        cmd = [os.path.join(bin_dir, "lathe-worker"), "train", "--spec", spec_path, "--output",
               "json", "--threads", str(threads), *extra]
        if ranks > 1:
            cmd += ["--rank", str(rank), "--world-size", str(ranks), "--rendezvous-dir",
                    rendezvous]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    outputs = [p.communicate(timeout=timeout) for p in procs]
    shutil.rmtree(rendezvous, ignore_errors=True)
    failed = [(r, p.returncode, err) for r, (p, (_, err)) in enumerate(zip(procs, outputs))
              if p.returncode != 0]
    if failed:
        raise RuntimeError("; ".join(f"rank {r} exited {code}: {err.strip()[-400:]}"
                                     for r, code, err in failed))
    return [trainer_events.read_events(out) for out, _ in outputs]


def steps(events):
    return [e for e in events if e["event"] == "step"]
