#!/usr/bin/env python3
"""Goodput under failures (issue #12): a job whose trainer is SIGKILLed every --kill-every
seconds, against the same job left alone, side by side on one cluster.

  python3 bench/goodput.py [--minutes 10] [--kill-every 60] [--checkpoint-every 25]
                           [--json PATH] [--keep] [--bin-dir build/bin]

Starts a coordinator and two worker agents (w1, w2; one slot and one trainer thread each) as
real processes on 127.0.0.1 in a scratch directory, makes a synthetic model and data set
(lathe-synth), and submits two identical LoRA jobs that cannot finish (10^6 steps): the
baseline and the failure job, each on its own worker (the second is submitted once the first
runs, and a failed attempt goes back to the only free slot, its own). Once both train, a
window of --minutes starts; at (i + 1/2) * --kill-every seconds into it the failure job's
current trainer (`pgrep -f /<job>-g<generation>-r0/`) is SIGKILLed. At the window's end the
latest attempt's step of each job (`lathe status`: what the job has, recomputed steps counted
once) gives goodput = failure steps / baseline steps over the window.

Where each failure's seconds went, from what the system records (the coordinator's attempt
times, the agent's task.json mtime, the trainer's events as the agent writes them to
events.jsonl, stamped on arrival by a 20 ms poller here since the events carry no clock).
The total lost: when the step after the one reached at the kill arrives, less when it would
have arrived without the kill (that step's first arrival plus one step). Its parts:
  step in flight   the killed step's work: the kill - the arrival of the last step before it
  detection        the kill -> the coordinator ends the attempt (attempt ended_unix_ms)
  placement        attempt ended -> the next attempt placed (next started_unix_ms)
  delivery         placed -> the agent writes the trainer's task.json (the next heartbeat)
  process start    task.json -> the trainer's start event (model and data loaded), less:
  checkpoint load  measured apart after the run: the same task started fresh and from the
                   job's newest checkpoint, 5 times each, the difference of the medians
  first step       the start event -> the first step's arrival, less one step: the
                   optimizer and data-cursor restore and the first step's warm-up
  recomputed       (step at the kill - resumed_from_step) * the step time of the moment
                   (the median of the killed attempt's last 20 steps, its first left
                   out; the "one step" above is this one too)
  other            the rest: checkpoint writes while catching up, step-time noise
Stdlib only; every process it starts is stopped on the way out (also on error or Ctrl-C).
"""
import argparse
import copy
import datetime
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests", "e2e"))
from ranks import machine, synth_data, synth_model  # noqa: E402
from services_test import free_port, write_tokens  # noqa: E402

MODEL = {"vocab": 8192, "hidden": 384, "layers": 4, "heads": 6, "kv_heads": 2,
         "intermediate": 1024}


def now_ms():
    return time.time() * 1000.0


def load_averages():
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


class EventTail(threading.Thread):
    """Polls every run directory's events.jsonl under the workers' work dirs and stamps each
    new line with its arrival time: the trainer events carry no clock of their own."""

    def __init__(self, work_dirs, period=0.02):
        super().__init__(daemon=True)
        self.work_dirs, self.period = work_dirs, period
        self.files = {}  # path -> [offset, partial line]
        self.runs = {}  # (job_id, generation) -> {"start", "steps", "checkpoints", "dir"}
        self.lock = threading.Lock()
        self.stop_flag = threading.Event()

    def run(self):
        while not self.stop_flag.is_set():
            try:
                self.poll()
            except Exception as e:  # noqa: BLE001 - never let the poller die silently
                print(f"event poller: {e}", file=sys.stderr)
            self.stop_flag.wait(self.period)

    def poll(self):
        for work in self.work_dirs:
            try:
                names = os.listdir(work)
            except FileNotFoundError:
                continue
            for name in names:
                job, sep, rest = name.rpartition("-g")
                if not sep or not rest.endswith("-r0"):
                    continue
                path = os.path.join(work, name, "events.jsonl")
                state = self.files.setdefault(path, [0, ""])
                try:
                    with open(path) as f:
                        f.seek(state[0])
                        data = f.read()
                        state[0] = f.tell()
                except FileNotFoundError:
                    continue
                if not data:
                    continue
                t = now_ms()
                text = state[1] + data
                lines = text.split("\n")
                state[1] = lines.pop()
                key = (job, int(rest[:-3]))
                with self.lock:
                    run = self.runs.setdefault(key, {"start": None, "steps": {},
                                                     "checkpoints": {},
                                                     "dir": os.path.join(work, name)})
                    for line in lines:
                        if not line.strip():
                            continue
                        event = json.loads(line)
                        if "start" in event:
                            run["start"] = {"t": t, "resumed_from_step": int(
                                event["start"].get("resumed_from_step", 0))}
                        elif "step" in event:
                            step = int(event["step"]["progress"]["step"])
                            run["steps"][step] = {"t": t,
                                                  "seconds": float(event["step"]["seconds"])}
                        elif "checkpoint" in event:
                            run["checkpoints"][int(event["checkpoint"]["step"])] = t

    def get(self, job, generation):
        with self.lock:
            run = self.runs.get((job, generation))
            return copy.deepcopy(run) if run else None

    def last_step(self, job, generation):
        with self.lock:
            run = self.runs.get((job, generation))
            return max(run["steps"]) if run and run["steps"] else None


class Cluster:
    """A coordinator and worker agents, each in its own process group; stop() ends them and
    any trainer left under the scratch directory, by process id."""

    def __init__(self, root, bin_dir, peak_flops):
        self.root, self.bin, self.peak_flops = root, bin_dir, peak_flops
        self.tokens = write_tokens(root)
        self.address = f"127.0.0.1:{free_port()}"
        self.procs = {}

    def start(self, workers):
        log = open(os.path.join(self.root, "coordinator.log"), "a")
        coordinator = subprocess.Popen(
            [os.path.join(self.bin, "lathe-coordinator"), "--listen", self.address, "--db",
             os.path.join(self.root, "lathe.db"), "--allowed-roots", self.root,
             "--auth-tokens", self.tokens["file"], "--heartbeat-interval", "0.5",
             "--heartbeat-timeout", "5"],
            stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
        self.procs["coordinator"] = coordinator
        lines = []  # its log lines (a warning, say) may come first
        while not lines or "listening on" not in lines[-1]:
            lines.append(coordinator.stdout.readline())
            if not lines[-1] or len(lines) > 20:
                raise RuntimeError(f"the coordinator did not start: {''.join(lines)!r}")
        # Nobody reads its stdout from here on: drained to the log, so it never blocks.
        threading.Thread(target=lambda: [log.write(l) for l in coordinator.stdout],
                         daemon=True).start()
        for worker in workers:
            with open(os.path.join(self.root, f"{worker}.log"), "a") as wlog:
                self.procs[worker] = subprocess.Popen(
                    [os.path.join(self.bin, "lathe-worker"), "agent", "--coordinator",
                     self.address, "--worker-id", worker, "--token-file", self.tokens["worker"],
                     "--slots", "1", "--trainer-threads", "1", "--peak-flops",
                     str(self.peak_flops), "--work-dir", os.path.join(self.root, worker)],
                    stdout=wlog, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + 30
        while time.time() < deadline:
            result = self.lathe("--output", "json", "workers", check=False)
            if result.returncode == 0:
                ready = [w for w in json.loads(result.stdout or "[]")
                         if w.get("state") == "ready"]
                if len(ready) >= len(workers):
                    return
            time.sleep(0.2)
        raise RuntimeError(f"fewer than {len(workers)} workers registered")

    def lathe(self, *args, check=True, timeout=60):
        result = subprocess.run([os.path.join(self.bin, "lathe"), "--coordinator", self.address,
                                 "--token-file", self.tokens["client"], *args],
                                capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise RuntimeError(f"lathe {' '.join(args)}: {result.stderr.strip()}")
        return result

    def status(self, job_id):
        return json.loads(self.lathe("--output", "json", "status", job_id).stdout)

    def trainers(self, pattern=None):
        result = subprocess.run(["pgrep", "-f", "--", pattern or self.root + "/"],
                                capture_output=True, text=True)
        own = {p.pid for p in self.procs.values()}
        return [int(p) for p in result.stdout.split() if int(p) not in own]

    def stop(self):
        for name, proc in reversed(list(self.procs.items())):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            if proc.stdout:
                proc.stdout.close()
        # Trainers run in process groups of their own (the agent's launcher): any left over.
        for pid in self.trainers():
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def write_spec(root, name, model, data, args):
    path = os.path.join(root, f"{name}.yaml")
    with open(path, "w") as f:
        f.write(f"""name: {name}
model: {{path: {model}}}
data: {{train: {data}, seq_len: {args.seq_len}}}
lora: {{rank: 8, alpha: 16}}
train: {{steps: {args.steps}, global_batch: {args.global_batch}, lr: 1.0e-4, \
checkpoint_every: {args.checkpoint_every}}}
resources: {{ranks: 1, device: cpu}}
max_restarts: {args.max_restarts}
output: {os.path.join(root, "runs", name)}
""")
    return path


def wait_for(predicate, what, timeout, period=0.25):
    deadline = time.time() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.time() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(period)


def submit_and_wait(cluster, spec):
    job_id = cluster.lathe("submit", spec).stdout.strip()

    def running():
        job = cluster.status(job_id)
        if job["state"] in ("failed", "succeeded", "cancelled"):
            raise RuntimeError(f"{job_id} ended: {job['reason']}")
        return job if job["progress"] and job["progress"]["step"] >= 1 else None
    job = wait_for(running, f"{job_id} to train", 300)
    return job_id, job["attempts"][-1]["placements"][0]["worker_id"]


def worker_of(attempt):
    return attempt["placements"][0]["worker_id"] if attempt["placements"] else None


def calibrate_checkpoint_load(bin_dir, root, task_path, checkpoints, repeats=5):
    """Seconds from spawn to the start event of the failure job's last task, fresh (empty
    output) and resumed (its newest checkpoint copied in), alternating; the difference of the
    medians is what loading the checkpoint costs."""
    with open(task_path) as f:
        task = json.load(f)
    newest = max((d for d in os.listdir(checkpoints) if d.startswith("step-")), default=None)
    if newest is None:
        return None
    results = {"fresh": [], "resume": []}
    resumed = set()
    for i in range(repeats):
        for kind in ("fresh", "resume"):
            out = os.path.join(root, "calibrate", f"{kind}-{i}")
            os.makedirs(out)
            if kind == "resume":
                shutil.copytree(os.path.join(checkpoints, newest),
                                os.path.join(out, "checkpoints", newest))
            task["spec"]["output"] = out
            path = os.path.join(root, "calibrate", f"{kind}-{i}.task.json")
            with open(path, "w") as f:
                json.dump(task, f)
            t0 = time.time()
            proc = subprocess.Popen([os.path.join(bin_dir, "lathe-worker"), "train", "--task",
                                     path, "--output", "json", "--threads", "1"],
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                    start_new_session=True)
            try:
                for line in proc.stdout:
                    event = json.loads(line)
                    if "start" in event:
                        results[kind].append(time.time() - t0)
                        resumed.add((kind, int(event["start"].get("resumed_from_step", 0))))
                        break
            finally:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                proc.stdout.close()
    if any(kind == "resume" and step == 0 for kind, step in resumed):
        print("calibration: the copied checkpoint was not resumed", file=sys.stderr)
        return None
    fresh, resume = statistics.median(results["fresh"]), statistics.median(results["resume"])
    return {"fresh_s": results["fresh"], "resume_s": results["resume"], "checkpoint": newest,
            "load_s": max(0.0, resume - fresh)}


def breakdown(kills, attempts, tail, job_id, mean_step_s, load_s):
    """One row per kill whose next attempt got one step past the step reached at the kill.
    Lost seconds: when that next step arrived, less when it would have arrived without the
    kill (the arrival of the step reached at the kill, plus one mean step)."""
    rows = []
    for kill in kills:
        g = kill["generation"]
        if g >= len(attempts):
            continue
        failed, after = attempts[g - 1], attempts[g]
        old, new = tail.get(job_id, g), tail.get(job_id, g + 1)
        reached = failed["progress"]["step"] if failed["progress"] else kill["step_seen"]
        resumed = after["resumed_from_step"]
        row = {"generation": g, "kill_at_s": kill["at_s"], "kill_ms": kill["t"],
               "step_at_kill": reached, "step_seen": kill["step_seen"],
               "resumed_from_step": resumed, "recomputed_steps": reached - resumed,
               "replaced_on": worker_of(after), "killed_on": worker_of(failed),
               "error": failed["error"][:120]}
        task = os.path.join(new["dir"], "task.json") if new else None
        if not (old and new and new["start"] and reached in old["steps"] and
                resumed + 1 in new["steps"] and reached + 1 in new["steps"] and
                os.path.exists(task)):
            row["incomplete"] = True
            rows.append(row)
            continue
        # The step time of the moment (the machine's load changes over the window): the
        # median of the killed attempt's last 20 steps, its first (warm-up) left out.
        recent = [v["seconds"] for k, v in old["steps"].items()
                  if reached - 20 < k <= reached and k != min(old["steps"])]
        step_s = statistics.median(recent) if recent else mean_step_s
        row["step_s"] = step_s
        t_old = old["steps"][reached]["t"]
        t_first = new["steps"][resumed + 1]["t"]
        t_task = os.stat(task).st_mtime_ns / 1e6
        start_and_load = (new["start"]["t"] - t_task) / 1000
        parts = {
            "step_in_flight": (kill["t"] - t_old) / 1000,
            "detection": (failed["ended_unix_ms"] - kill["t"]) / 1000,
            "placement": (after["started_unix_ms"] - failed["ended_unix_ms"]) / 1000,
            "delivery": (t_task - after["started_unix_ms"]) / 1000,
            "process_start": start_and_load - (load_s or 0.0),
            "checkpoint_load": load_s or 0.0,
            "first_step": (t_first - new["start"]["t"]) / 1000 - step_s,
            "recomputed": (reached - resumed) * step_s,
        }
        row.update(parts)
        row["total"] = (new["steps"][reached + 1]["t"] - t_old) / 1000 - step_s
        row["other"] = row["total"] - sum(parts.values())
        row["first_step_seconds"] = new["steps"][resumed + 1]["seconds"]
        rows.append(row)
    return rows


def checkpoint_writes(tail, job_id, generation, t0, t1):
    """Seconds from each step event to its checkpoint event (the write), in [t0, t1]."""
    run = tail.get(job_id, generation) or {"checkpoints": {}, "steps": {}}
    return [(t - run["steps"][step]["t"]) / 1000 for step, t in run["checkpoints"].items()
            if step in run["steps"] and t0 <= t <= t1]


COLUMNS = ["step_in_flight", "detection", "placement", "delivery", "process_start",
           "checkpoint_load", "first_step", "recomputed", "other", "total"]


def table(rows):
    head = ("| failure | kill at s | step at kill | resumed from | steps redone | "
            + " | ".join(c.replace("_", " ") + " s" for c in COLUMNS) + " |")
    lines = [head, "|" + "---|" * (5 + len(COLUMNS))]
    full = [r for r in rows if not r.get("incomplete")]
    for i, r in enumerate(rows, 1):
        if r.get("incomplete"):
            lines.append(f"| {i} | {r['kill_at_s']:.1f} | {r['step_at_kill']} | "
                         f"{r['resumed_from_step']} | {r['recomputed_steps']} | "
                         + " | ".join("n/a" for _ in COLUMNS) + " |")
            continue
        lines.append(f"| {i} | {r['kill_at_s']:.1f} | {r['step_at_kill']} | "
                     f"{r['resumed_from_step']} | {r['recomputed_steps']} | "
                     + " | ".join(f"{r[c]:.2f}" for c in COLUMNS) + " |")
    if full:
        mean = {c: statistics.mean(r[c] for r in full) for c in COLUMNS}
        redone = statistics.mean(r["recomputed_steps"] for r in full)
        lines.append(f"| **mean** | | | | {redone:.1f} | "
                     + " | ".join(f"**{mean[c]:.2f}**" for c in COLUMNS) + " |")
        share = " | ".join(f"{100 * mean[c] / mean['total']:.0f}%" for c in COLUMNS[:-1])
        lines.append(f"| share of total | | | | | {share} | 100% |")
    return "\n".join(lines)


def mean_step_seconds(tail, job_id, generations, t0, t1):
    """Mean `seconds` of the steps that arrived in [t0, t1], each attempt's first (warm-up)
    step left out."""
    seconds = []
    for g in generations:
        run = tail.get(job_id, g)
        if not run or not run["steps"]:
            continue
        first = min(run["steps"])
        seconds += [s["seconds"] for step, s in run["steps"].items()
                    if step != first and t0 <= s["t"] <= t1]
    return statistics.mean(seconds) if seconds else None


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bin-dir", default=os.path.join(HERE, "..", "build", "bin"))
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--kill-every", type=float, default=60.0, help="seconds")
    parser.add_argument("--checkpoint-every", type=int, default=25, help="steps")
    parser.add_argument("--steps", type=int, default=1_000_000, help="far beyond the window")
    parser.add_argument("--max-restarts", type=int, default=100)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--global-batch", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=MODEL["hidden"])
    parser.add_argument("--layers", type=int, default=MODEL["layers"])
    parser.add_argument("--vocab", type=int, default=MODEL["vocab"])
    parser.add_argument("--peak-flops", type=float, default=2.5e10,
                        help="each agent's --peak-flops (given, so no trainer measures it)")
    parser.add_argument("--no-calibrate", action="store_true",
                        help="skip the checkpoint-load measurement after the run")
    parser.add_argument("--json", help="write the raw numbers here")
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory")
    args = parser.parse_args()
    bin_dir = os.path.abspath(args.bin_dir)
    window = args.minutes * 60
    kills_planned = int(window // args.kill_every)
    if kills_planned > args.max_restarts:
        parser.error("more kills than --max-restarts")
    model_sizes = dict(MODEL, hidden=args.hidden, layers=args.layers, vocab=args.vocab)

    def on_signal(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)  # also where it was started with SIGINT ignored

    root = tempfile.mkdtemp(prefix="lathe-goodput-")
    print(f"scratch {root}; {machine()}; load average {load_averages()}", flush=True)
    load_before = load_averages()
    cluster = Cluster(root, bin_dir, args.peak_flops)
    tail = EventTail([os.path.join(root, w) for w in ("w1", "w2")])
    jobs = {}
    try:
        model, data = os.path.join(root, "model"), os.path.join(root, "train.jsonl")
        synth_model(bin_dir, model, model_sizes)
        synth_data(bin_dir, data, model_sizes["vocab"], args.seq_len)
        cluster.start(["w1", "w2"])
        tail.start()
        for name in ("baseline", "failure"):
            jobs[name] = submit_and_wait(cluster, write_spec(root, name, model, data, args))
            print(f"{name}: {jobs[name][0]} on {jobs[name][1]}", flush=True)
        (base_id, base_worker), (fail_id, fail_worker) = jobs["baseline"], jobs["failure"]
        if base_worker == fail_worker:
            raise RuntimeError("both jobs landed on the same worker")
        # A few steps in each, so that neither window end sees a warm-up step.
        wait_for(lambda: all((tail.last_step(j, 1) or 0) >= 3 for j in (base_id, fail_id)),
                 "3 steps of each job", 300)

        t0 = now_ms()
        start = {j: cluster.status(j) for j in (base_id, fail_id)}
        print(f"window: {args.minutes:g} min, a kill every {args.kill_every:g} s "
              f"({kills_planned} kills)", flush=True)
        kills = []
        for i in range(kills_planned):
            at = t0 + (i + 0.5) * args.kill_every * 1000
            time.sleep(max(0.0, (at - now_ms()) / 1000))
            job = cluster.status(fail_id)
            g = len(job["attempts"])
            pattern = f"/{fail_id}-g{g}-r0/"
            pids = wait_for(lambda: cluster.trainers(pattern), f"a trainer of {pattern}", 120,
                            period=0.05)
            step_seen = tail.last_step(fail_id, g)
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            t = now_ms()
            kills.append({"generation": g, "t": t, "at_s": (t - t0) / 1000, "pids": pids,
                          "step_seen": step_seen})
            print(f"  kill {i + 1}: {(t - t0) / 1000:6.1f} s, attempt {g} at step {step_seen}",
                  flush=True)
        time.sleep(max(0.0, (t0 + window * 1000 - now_ms()) / 1000))
        t1 = now_ms()
        end = {j: cluster.status(j) for j in (base_id, fail_id)}
        load_after = load_averages()

        def step(job):
            return job["progress"]["step"] if job["progress"] else 0
        span = (t1 - t0) / 1000
        base_steps = step(end[base_id]) - step(start[base_id])
        fail_steps = step(end[fail_id]) - step(start[fail_id])
        goodput = fail_steps / base_steps
        attempts = end[fail_id]["attempts"]
        base_step_s = mean_step_seconds(tail, base_id, [1], t0, t1)
        fail_step_s = mean_step_seconds(tail, fail_id, range(1, len(attempts) + 1), t0, t1)
        for j in (base_id, fail_id):
            cluster.lathe("cancel", j, check=False)
        # The coordinator's own record: every failure infrastructure, re-placed on its worker.
        placed = [worker_of(a) for a in attempts]
        failures = [a["failure"] for a in attempts[:-1]]
        last_task = os.path.join(root, fail_worker, f"{fail_id}-g{len(attempts)}-r0",
                                 "task.json")
        time.sleep(1)
        cluster.stop()
        tail.stop_flag.set()

        calibration = None
        if not args.no_calibrate:
            calibration = calibrate_checkpoint_load(
                bin_dir, root, last_task, os.path.join(root, "runs", "failure", "checkpoints"))
        load_s = calibration["load_s"] if calibration else None
        rows = breakdown(kills, attempts, tail, fail_id, fail_step_s, load_s)
        writes = checkpoint_writes(tail, base_id, 1, t0, t1)
        write_s = statistics.mean(writes) if writes else 0.0
        full = [r for r in rows if not r.get("incomplete")]
        mean = {c: statistics.mean(r[c] for r in full) for c in COLUMNS} if full else {}
        lost_total = (base_steps - fail_steps) * span / base_steps  # at the baseline's rate

        print()
        print(f"model {model_sizes}, LoRA rank 8, seq_len {args.seq_len}, global batch "
              f"{args.global_batch}, fp32, 1 thread per trainer; checkpoint_every "
              f"{args.checkpoint_every} steps")
        print(f"mean step (events' seconds, warm-up left out): baseline {base_step_s:.3f} s, "
              f"failure job {fail_step_s:.3f} s; a checkpoint every "
              f"{args.checkpoint_every * base_step_s:.1f} s")
        print(f"checkpoint write (step event -> checkpoint event), baseline: mean "
              f"{write_s:.3f} s over {len(writes)} checkpoints, "
              f"{100 * sum(writes) / span:.1f}% of the window (both jobs pay it)")
        print(f"window {span:.1f} s: baseline {base_steps} steps ({base_steps / span:.3f}/s), "
              f"failure job {fail_steps} steps ({fail_steps / span:.3f}/s), "
              f"{len(kills)} kills")
        base_attempts = len(end[base_id]["attempts"])
        print(f"failure job's attempts placed on {placed}, failures {sorted(set(failures))}; "
              f"the baseline's {base_attempts} attempt on {base_worker}")
        if base_attempts != 1 or any(w != fail_worker for w in placed):
            print("WARNING: the jobs did not stay apart (see the attempts in --json)")
        if calibration:
            resume = statistics.median(calibration["resume_s"])
            fresh = statistics.median(calibration["fresh_s"])
            print(f"checkpoint load: start event after {resume:.2f} s resumed "
                  f"({calibration['checkpoint']}) vs {fresh:.2f} s fresh (medians of "
                  f"{len(calibration['fresh_s'])}): {resume - fresh:+.3f} s, "
                  f"{load_s:.3f} s in the table")
        print()
        print(table(rows))
        print()
        if mean:
            print(f"lost per failure: {mean['total']:.2f} s measured (the table's total); "
                  f"{lost_total / max(1, len(kills)):.2f} s "
                  f"from the step counts ((baseline - failure steps) at the baseline's rate, "
                  f"over {len(kills)} kills)")
        verdict = "met" if goodput >= 0.85 else f"missed by {100 * (0.85 - goodput):.1f} points"
        print(f"goodput {100 * goodput:.1f}% (bar 85%: {verdict}); load average before "
              f"{load_before}, after {load_after}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"date": datetime.date.today().isoformat(), "machine": machine(),
                           "nproc": os.cpu_count(), "argv": sys.argv, "model": model_sizes,
                           "args": vars(args), "window_s": span,
                           "baseline": {"job": base_id, "worker": base_worker,
                                        "steps": base_steps, "step_s": base_step_s,
                                        "start": step(start[base_id]),
                                        "end": step(end[base_id])},
                           "failure": {"job": fail_id, "worker": fail_worker,
                                       "steps": fail_steps, "step_s": fail_step_s,
                                       "start": step(start[fail_id]),
                                       "end": step(end[fail_id]), "placed": placed,
                                       "failures": failures},
                           "checkpoint_writes_s": writes,
                           "goodput": goodput, "kills": kills, "breakdown": rows,
                           "mean": mean, "lost_per_failure_from_steps":
                               lost_total / max(1, len(kills)),
                           "calibration": calibration, "load_before": load_before,
                           "load_after": load_after, "attempts": attempts,
                           "events": {f"{j}-g{g}": run for (j, g), run in tail.runs.items()}},
                          f, indent=1)
    finally:
        tail.stop_flag.set()
        cluster.stop()
        if args.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
