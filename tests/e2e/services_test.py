#!/usr/bin/env python3
"""End to end: a coordinator and two worker agents as real processes on 127.0.0.1, driven
through the `lathe` CLI. Every process the test starts is stopped in tearDown, whatever
happens."""
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import unittest

BIN = os.environ.get("LATHE_BIN_DIR", os.path.join(os.path.dirname(__file__), "../../build/bin"))
TIMEOUT = 120  # seconds for any one job to finish on a loaded 2-core machine
COLLECTIVE_TIMEOUT = 8  # seconds a trainer's collective waits for a peer (agent flag)
PEAK_FLOPS = 2.5e10  # each worker's configured device peak, MFU's denominator


def lora_flops_per_token(config, rank, seq_len):
    """docs/training.md "MFU", written again from the formula: LoRA on all seven projections."""
    h, i = config["hidden_size"], config["intermediate_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    d = config.get("head_dim") or h // heads
    shapes = [(h, heads * d), (h, kv * d), (h, kv * d), (heads * d, h), (h, i), (h, i), (i, h)]
    weights = sum(a * b for a, b in shapes)
    adapters = sum(rank * (a + b) for a, b in shapes)
    attention = 2 * (seq_len + 1) * heads * d
    layers = config["num_hidden_layers"]
    frozen = layers * 2 * weights + 2 * config["vocab_size"] * h
    trained = layers * (2 * adapters + attention)
    return 2 * frozen + 3 * trained


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(*args, timeout=TIMEOUT):
    return subprocess.run([os.path.join(BIN, args[0]), *args[1:]], capture_output=True,
                          text=True, timeout=timeout)


# Who holds a token: key -> (role, name, worker ids). "worker" acts for every id starting with
# "w" (the agents' ids), "worker-b" only for "wb" (issue #27: one worker token must not act
# for another's ranks); "bob" is a second client, who must not see e2e-client's jobs.
TOKEN_HOLDERS = {"client": ("client", "e2e-client", ""), "worker": ("worker", "e2e-worker", "w*"),
                 "admin": ("admin", "e2e-admin", ""), "bob": ("client", "e2e-bob", ""),
                 "worker-b": ("worker", "e2e-worker-b", "wb")}


def write_tokens(directory):
    """A token file for the coordinator and one file per holder's token; returns their
    paths (by TOKEN_HOLDERS' keys, and "file")."""
    tokens = {key: f"{key}-e2e-" + os.urandom(12).hex() for key in TOKEN_HOLDERS}
    paths = {"file": os.path.join(directory, "tokens")}
    with open(paths["file"], "w") as f:
        for key, token in tokens.items():
            role, name, ids = TOKEN_HOLDERS[key]
            f.write(f"{role} {name} {token} {ids}\n")
    for role, token in tokens.items():
        paths[role] = os.path.join(directory, f"{role}.token")
        with open(paths[role], "w") as f:
            f.write(token + "\n")
    return paths


def stop_process(process, timeout):
    """SIGTERM, then SIGKILL after `timeout` seconds; nothing when it already ended."""
    if process is None or process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


class Cluster:
    def __init__(self, root, tokens):
        self.root = root
        self.tokens = tokens  # write_tokens' paths
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.db = os.path.join(root, "lathe.db")
        self.coordinator = None
        self.workers = {}
        # More flags for each kind of process (tls_test.py adds TLS's).
        self.coordinator_args, self.worker_args, self.cli_args = [], [], []
        # Run in the coordinator's process before it execs (fd_limit_test.py sets its limits).
        self.coordinator_preexec = None

    def start_coordinator(self):
        with open(os.path.join(self.root, "coordinator.log"), "a") as log:
            self.coordinator = subprocess.Popen(
                [os.path.join(BIN, "lathe-coordinator"), "--listen", self.address, "--db",
                 self.db, "--allowed-roots", self.root, "--auth-tokens", self.tokens["file"],
                 "--heartbeat-interval", "0.5", "--heartbeat-timeout", "5",
                 *self.coordinator_args],
                stdout=subprocess.PIPE, stderr=log, text=True,
                preexec_fn=self.coordinator_preexec)
        line = self.coordinator.stdout.readline()
        assert "listening on" in line, f"coordinator did not start: {line!r}"
        # The log goes on on stdout: drain it into the log file, or the coordinator would
        # block once the pipe is full.
        def drain(stdout, path):
            with stdout, open(path, "a") as log:
                for rest in stdout:
                    log.write(rest)
        threading.Thread(target=drain, args=(self.coordinator.stdout, os.path.join(
            self.root, "coordinator.log")), daemon=True).start()

    def stop_coordinator(self):
        stop_process(self.coordinator, timeout=10)

    def start_worker(self, worker_id):
        with open(os.path.join(self.root, f"{worker_id}.log"), "a") as log:
            self.workers[worker_id] = subprocess.Popen(
                [os.path.join(BIN, "lathe-worker"), "agent", "--coordinator", self.address,
                 "--worker-id", worker_id, "--token-file", self.tokens["worker"],
                 "--slots", "1", "--trainer-threads", "1",
                 "--peak-flops", str(PEAK_FLOPS),
                 "--collective-timeout", str(COLLECTIVE_TIMEOUT),
                 "--work-dir", os.path.join(self.root, worker_id), *self.worker_args],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def stop(self):
        for process in self.workers.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.workers.values():
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        self.stop_coordinator()

    def lathe(self, *args, timeout=TIMEOUT, role="client"):
        return run("lathe", "--coordinator", self.address, "--token-file", self.tokens[role],
                   *self.cli_args, *args, timeout=timeout)


class ClusterTest(unittest.TestCase):
    """A cluster for the whole class under a new temporary root: a synthetic model and data
    set (cls.model, cls.data), a coordinator and the agents named by WORKERS, all stopped
    (and the root removed unless $LATHE_KEEP_E2E is set) at the end."""
    PREFIX, MAX_POS, RECORDS, WORKERS = "lathe-e2e-", 64, 16, ("w1", "w2")

    @classmethod
    def configure(cls, cluster):
        """Extra flags for the cluster's processes, before they start."""

    @classmethod
    def setUpClass(cls):
        cls.root = tempfile.mkdtemp(prefix=cls.PREFIX)
        cls.model = os.path.join(cls.root, "model")
        cls.data = os.path.join(cls.root, "train.jsonl")
        for cmd in (("lathe-synth", "model", "--out", cls.model, "--max-pos", str(cls.MAX_POS)),
                    ("lathe-synth", "data", "--out", cls.data, "--records", str(cls.RECORDS))):
            result = run(*cmd)
            assert result.returncode == 0, result.stderr
        cls.cluster = Cluster(cls.root, write_tokens(cls.root))
        try:
            cls.configure(cls.cluster)
            cls.cluster.start_coordinator()
            for worker in cls.WORKERS:
                cls.cluster.start_worker(worker)
            cls.wait_for_workers(len(cls.WORKERS))
        except Exception:
            cls.cluster.stop()
            raise

    @classmethod
    def tearDownClass(cls):
        cls.cluster.stop()
        if os.environ.get("LATHE_KEEP_E2E") is None:
            shutil.rmtree(cls.root, ignore_errors=True)

    @classmethod
    def wait_for_workers(cls, n):
        deadline = time.time() + 30
        while time.time() < deadline:
            result = cls.cluster.lathe("--output", "json", "workers")
            if result.returncode == 0:
                ready = [w for w in json.loads(result.stdout or "[]") if w["state"] == "ready"]
                if len(ready) >= n:
                    return
            time.sleep(0.2)
        raise AssertionError(f"fewer than {n} workers registered")

    def spec(self, name, steps=4, ranks=1, extra="", train="", lr="1.0e-3"):
        """A LoRA job spec on the class's model and data, written to <root>/<name>.yaml."""
        path = os.path.join(self.root, f"{name}.yaml")
        with open(path, "w") as f:
            f.write(f"""name: {name}
model: {{path: {self.model}}}
data: {{train: {self.data}, seq_len: 32}}
lora: {{rank: 4, alpha: 8}}
train: {{steps: {steps}, global_batch: 2, lr: {lr}{train}}}
resources: {{ranks: {ranks}, device: cpu}}
output: {os.path.join(self.root, "runs", name)}
{extra}""")
        return path

    def submit(self, name, steps=4, ranks=1, extra="", train="", lr="1.0e-3"):
        result = self.cluster.lathe("submit", self.spec(name, steps, ranks, extra, train, lr))
        self.assertEqual(result.returncode, 0, result.stderr)
        job_id = result.stdout.strip()
        self.assertTrue(job_id.startswith(name), job_id)
        return job_id

    def status(self, job_id):
        result = self.cluster.lathe("--output", "json", "status", job_id)
        self.assertEqual(result.returncode, 0, result.stderr)
        return json.loads(result.stdout)

    def list_jobs(self):
        result = self.cluster.lathe("--output", "json", "list")
        self.assertEqual(result.returncode, 0, result.stderr)
        return {job["job_id"]: job for job in json.loads(result.stdout)}

    def wait_running(self, job_id):
        deadline = time.time() + TIMEOUT
        while time.time() < deadline:
            job = self.status(job_id)
            if job["progress"] is not None and job["progress"]["step"] >= 1:
                return job
            self.assertNotIn(job["state"], ("failed", "succeeded"), job)
            time.sleep(0.2)
        self.fail(f"{job_id} never reported progress")

    def running_until_cleanup(self, name):
        """A job of many steps, running (its first step reported), cancelled at cleanup
        whatever the test asserts: (job id, its status)."""
        job_id = self.submit(name, steps=100000)
        self.addCleanup(lambda: (self.cluster.lathe("cancel", job_id),
                                 self.cluster.lathe("watch", job_id)))
        return job_id, self.wait_running(job_id)


class ServicesTest(ClusterTest):
    MAX_POS, RECORDS = 128, 64

    def trainer_pids(self, job_id):
        # The trainer runs `lathe-worker train --task <work>/<job_id>-g<generation>-r<rank>/...`.
        result = subprocess.run(["pgrep", "-f", "--", f"/{job_id}-g"], capture_output=True,
                                text=True)
        return [int(p) for p in result.stdout.split()]

    def train_until(self, job_id, generation, step, deadline):
        """Waits until attempt `generation` of a one-rank job runs and reported `step`, and
        returns the job's attempts with its trainer stopped (SIGSTOP): the caller does what
        it came for, then continues it (SIGCONT) if it still lives. A step takes a few
        milliseconds, less than one `lathe status`: the trainer runs only in short bursts
        between two looks, and stays stopped until the caller acts, or it could run to the
        job's end first on a fast machine or after a slow look."""
        trainer = f"/{job_id}-g{generation}-r0/"
        while True:
            self.signal_processes(trainer, signal.SIGSTOP)
            attempts = self.status(job_id)["attempts"]
            progress = attempts[-1]["progress"] if attempts else None
            if len(attempts) == generation and attempts[-1]["state"] == "running" and \
                    progress and progress["step"] >= step:
                return attempts
            self.signal_processes(trainer, signal.SIGCONT)
            self.assertLess(time.time(), deadline, attempts)
            time.sleep(0.02)

    def signal_processes(self, pattern, signum):
        """Sends `signum` to every process whose command line contains `pattern`."""
        result = subprocess.run(["pgrep", "-f", "--", pattern], capture_output=True, text=True)
        for pid in result.stdout.split():
            try:
                os.kill(int(pid), signum)
            except ProcessLookupError:
                pass

    def adapter_bytes(self, job_id):
        with open(os.path.join(self.status(job_id)["adapter_path"],
                               "adapter_model.safetensors"), "rb") as f:
            return f.read()

    def expect_adapter(self, job_id):
        job = self.status(job_id)
        self.assertEqual(job["state"], "succeeded", job)
        adapter = job["adapter_path"]
        self.assertTrue(os.path.isfile(os.path.join(adapter, "adapter_model.safetensors")))
        score = run("lathe-worker", "score", "--model", self.model, "--adapter", adapter,
                    "--data", self.data, "--seq-len", "32", "--output", "json", "--threads", "1")
        self.assertEqual(score.returncode, 0, score.stderr)
        self.assertGreater(json.loads(score.stdout)["targets"], 0)

    def test_1_jobs_run_to_success(self):
        first = self.submit("single")
        watch = self.cluster.lathe("watch", first)
        self.assertEqual(watch.returncode, 0, watch.stdout + watch.stderr)
        self.expect_adapter(first)

        pair = [self.submit("pair-a"), self.submit("pair-b")]
        for job_id in pair:
            watch = self.cluster.lathe("watch", job_id)
            self.assertEqual(watch.returncode, 0, watch.stdout + watch.stderr)
            self.expect_adapter(job_id)
        jobs = self.list_jobs()
        for job_id in [first] + pair:
            self.assertEqual(jobs[job_id]["state"], "succeeded")
            self.assertIn("final_loss", jobs[job_id])
            self.assertGreater(jobs[job_id]["final_loss"], 0)

    def test_1a_the_trainer_runs_the_coordinators_plan(self):
        job_id = self.submit("planned", extra="strategy: {activation_checkpointing: true}\n")
        self.assertEqual(self.cluster.lathe("watch", job_id).returncode, 0)
        job = self.status(job_id)
        self.assertEqual(job["state"], "succeeded", job)
        plan = job["plan"]
        self.assertEqual(plan["micro_batch"], 2)  # micro_batch auto, chosen at submit
        self.assertTrue(plan["activation_checkpointing"])
        # The plan the trainer says it ran: the first TrainerEvent it printed.
        worker = job["attempts"][-1]["placements"][0]["worker_id"]
        events = os.path.join(self.root, worker, f"{job_id}-g1-r0", "events.jsonl")
        with open(events) as f:
            lines = [json.loads(line) for line in f]
        ran = lines[0]["start"]["plan"]
        self.assertEqual(int(ran["strategy"]["micro_batch"]), plan["micro_batch"])
        self.assertEqual(int(ran["gradient_accumulation"]), plan["gradient_accumulation"])
        self.assertTrue(ran["strategy"]["activation_checkpointing"])
        self.assertIn("done", lines[-1])

    def test_1b_two_ranks_train_data_parallel_across_both_workers(self):
        job_id = self.submit("two-ranks", ranks=2)
        watch = self.cluster.lathe("watch", job_id)
        self.assertEqual(watch.returncode, 0, watch.stdout + watch.stderr)
        job = self.status(job_id)
        workers = {p["worker_id"] for p in job["attempts"][-1]["placements"]}
        self.assertEqual(workers, {"w1", "w2"})
        self.expect_adapter(job_id)
        # Same spec on one rank: the same data order and update, so the same loss.
        single = [j for j in self.list_jobs().values() if j["spec"]["name"] == "single"][0]
        self.assertAlmostEqual(job["final_loss"], single["final_loss"], delta=1e-4)

    def step_losses(self, job_id):
        """Rank 0's per-step losses, from the events its agent kept."""
        job = self.status(job_id)
        placement = [p for p in job["attempts"][-1]["placements"] if int(p.get("rank", 0)) == 0][0]
        events = os.path.join(self.root, placement["worker_id"],
                              f"{job_id}-g{len(job['attempts'])}-r0", "events.jsonl")
        with open(events) as f:
            lines = [json.loads(line) for line in f]
        return [float(e["step"]["progress"]["loss"]) for e in lines if "step" in e]

    def test_1c_zero3_on_two_ranks_gives_the_single_rank_losses(self):
        job_id = self.submit("zero3", ranks=2, extra="strategy: {zero_stage: 3}\n")
        watch = self.cluster.lathe("watch", job_id)
        self.assertEqual(watch.returncode, 0, watch.stdout + watch.stderr)
        job = self.status(job_id)
        self.assertEqual(job["plan"]["zero_stage"], 3)
        self.assertEqual({p["worker_id"] for p in job["attempts"][-1]["placements"]},
                         {"w1", "w2"})
        self.expect_adapter(job_id)
        single = [j for j in self.list_jobs().values() if j["spec"]["name"] == "single"][0]
        want = self.step_losses(single["job_id"])
        got = self.step_losses(job_id)
        self.assertEqual(len(got), len(want))
        for g, w in zip(got, want):
            self.assertAlmostEqual(g, w, delta=1e-5 * abs(w))

    def expect_every_rank_exits(self, job_id, stop):
        """`stop` one trainer of a running two-rank ZeRO-3 job: the attempt fails and every
        rank's process is gone within the collective timeout (plus the agents' grace)."""
        self.wait_running(job_id)
        pids = self.trainer_pids(job_id)
        self.assertEqual(len(pids), 2, pids)
        stop(pids[0])
        start = time.time()
        watch = self.cluster.lathe("watch", job_id)
        self.assertEqual(watch.returncode, 1, watch.stdout)
        self.assertEqual(self.status(job_id)["state"], "failed")
        while self.trainer_pids(job_id) and time.time() - start < COLLECTIVE_TIMEOUT + 15:
            time.sleep(0.2)
        self.assertEqual(self.trainer_pids(job_id), [])
        self.assertLess(time.time() - start, COLLECTIVE_TIMEOUT + 15)

    def test_1d_plans_learn_from_the_measured_peaks(self):
        # test_1 ran "single" (one rank, the defaults): its attempt's peak was measured.
        history = self.cluster.lathe("--output", "json", "plan", "--history")
        self.assertEqual(history.returncode, 0, history.stderr)
        history = json.loads(history.stdout)
        single = [a for a in history["attempts"] if a["job_id"].startswith("single-")]
        self.assertEqual(len(single), 1, history)
        self.assertGreater(single[0]["measured"]["total"], 0)
        self.assertGreater(single[0]["predicted"]["total"], 0)
        corrections = {c["calibration_key"]: c for c in history["corrections"]}
        self.assertIn(single[0]["calibration_key"], corrections)
        # The coordinator's plan of the same job applies what it learned.
        plan = self.cluster.lathe("--output", "json", "plan", self.spec("single-again"))
        self.assertEqual(plan.returncode, 0, plan.stderr)
        plan = json.loads(plan.stdout)["plan"]
        self.assertEqual(plan["calibration_key"], single[0]["calibration_key"])
        correction = corrections[plan["calibration_key"]]
        self.assertAlmostEqual(plan["memory_correction"], correction["factor"], places=6)
        text = self.cluster.lathe("plan", "--history")
        self.assertEqual(text.returncode, 0, text.stderr)
        self.assertIn("corrections later plans apply", text.stdout)

    def test_2a_a_killed_rank_ends_its_whole_attempt(self):
        job_id = self.submit("zero3-killed", steps=100000, ranks=2,
                             extra="strategy: {zero_stage: 3}\nmax_restarts: 0\n")
        self.expect_every_rank_exits(job_id, lambda pid: os.kill(pid, signal.SIGKILL))

    def test_2b_a_hung_rank_ends_its_whole_attempt(self):
        job_id = self.submit("zero3-stopped", steps=100000, ranks=2,
                             extra="strategy: {zero_stage: 3}\nmax_restarts: 0\n")
        self.expect_every_rank_exits(job_id, lambda pid: os.kill(pid, signal.SIGSTOP))
        self.assertIn("timed out", self.status(job_id)["reason"].lower())

    def test_2_a_killed_trainer_restarts_from_its_checkpoint(self):
        # The same job twice, one of them SIGKILLed mid-run: restarted from its newest
        # checkpoint, it ends with the uninterrupted run's adapter, bit for bit (fp32, CPU).
        train = ", checkpoint_every: 20"
        reference = self.submit("uninterrupted", steps=300, train=train)
        job_id = self.submit("killed", steps=300, train=train)
        self.train_until(job_id, 1, 25, time.time() + TIMEOUT)
        pids = self.trainer_pids(job_id)
        self.assertEqual(len(pids), 1, pids)
        os.kill(pids[0], signal.SIGKILL)
        for one in (reference, job_id):
            watch = self.cluster.lathe("watch", one)
            self.assertEqual(watch.returncode, 0, watch.stdout + watch.stderr)
        job = self.status(job_id)
        self.assertEqual(job["state"], "succeeded", job)
        self.assertEqual(job["restarts"], 1)
        first, second = job["attempts"]
        self.assertEqual(first["failure"], "infrastructure")
        self.assertIn("signal 9", first["error"])
        self.assertGreaterEqual(second["resumed_from_step"], 20)
        self.assertEqual(second["resumed_from_step"] % 20, 0)
        shown = self.cluster.lathe("status", job_id)
        self.assertIn(f"resumed from step {second['resumed_from_step']}", shown.stdout)
        self.assertIn("restarts     1 of 3", shown.stdout)
        self.assertEqual(self.adapter_bytes(reference), self.adapter_bytes(job_id))

    def test_2c_a_user_error_is_not_retried(self):
        job_id = self.submit("diverges", steps=50, lr="1.0e+308",
                             extra="max_restarts: 2\n")
        watch = self.cluster.lathe("watch", job_id)
        self.assertEqual(watch.returncode, 1, watch.stdout)
        job = self.status(job_id)
        self.assertEqual(job["state"], "failed")
        self.assertEqual(job["restarts"], 0)
        self.assertEqual(len(job["attempts"]), 1)
        self.assertEqual(job["attempts"][0]["failure"], "user")
        # Both agents still serve: two more jobs run at once.
        again = [self.submit("after-failure-a"), self.submit("after-failure-b")]
        for other in again:
            self.assertEqual(self.cluster.lathe("watch", other).returncode, 0)

    def test_2d_a_paused_worker_cannot_touch_the_next_attempts_checkpoints(self):
        # A zombie: attempt 1's worker, agent and trainer, is paused (SIGSTOP) until the job
        # has moved on as attempt 2 elsewhere, then resumed (SIGCONT). Its agent learns that
        # the attempt is over and stops the trainer, which checkpoints on the way out: the
        # fence refuses that write (worker/engine/checkpoint.h).
        job_id = self.submit("zombie", steps=100000, train=", checkpoint_every: 20")
        checkpoints = os.path.join(self.root, "runs", "zombie", "checkpoints")
        deadline = time.time() + TIMEOUT
        while not os.path.isdir(os.path.join(checkpoints, "step-00000020")):
            self.assertLess(time.time(), deadline, "no checkpoint of step 20")
            time.sleep(0.05)
        [zombie] = self.trainer_pids(job_id)
        worker = self.status(job_id)["attempts"][-1]["placements"][0]["worker_id"]
        paused = [zombie, self.cluster.workers[worker].pid]
        for pid in paused:
            os.kill(pid, signal.SIGSTOP)
        try:
            while True:
                job = self.status(job_id)
                attempts, progress = job["attempts"], job["progress"]
                if len(attempts) == 2 and attempts[1]["state"] == "running" and progress and \
                        progress["step"] > attempts[1]["resumed_from_step"]:
                    break
                self.assertLess(time.time(), deadline, (job["reason"], attempts))
                time.sleep(0.1)
        finally:
            for pid in reversed(paused):
                os.kill(pid, signal.SIGCONT)
        resumed = attempts[1]["resumed_from_step"]
        self.assertGreaterEqual(resumed, 20)
        self.assertNotEqual(attempts[1]["placements"][0]["worker_id"], worker)
        while zombie in self.trainer_pids(job_id):
            self.assertLess(time.time(), deadline, "the resumed zombie kept running")
            time.sleep(0.1)
        # Refused by the fence, or its half-written save removed by attempt 2's pruning.
        with open(os.path.join(self.root, worker, f"{job_id}-g1-r0", "trainer.log")) as f:
            self.assertRegex(f.read(), "checkpoint at step [0-9]+: .*(attempt 2 has taken over"
                             "|No such file)")
        self.assertEqual(self.cluster.lathe("cancel", job_id).returncode, 0)
        self.cluster.lathe("watch", job_id)
        # Attempt 1 wrote what attempt 2 resumed from; everything after is attempt 2's.
        writers = {}
        for name in os.listdir(checkpoints):
            if name.startswith("step-"):
                with open(os.path.join(checkpoints, name, "state.json")) as f:
                    state = json.load(f)
                writers[state["step"]] = state["attempt"]["generation"]
        self.assertEqual(writers[max(writers)], 2, writers)
        for step, generation in writers.items():
            self.assertEqual(generation, 1 if step <= resumed else 2, writers)

    def test_2e_ten_kills_in_one_job_change_nothing(self):
        # Ten SIGKILLs at random steps in one job, of its trainer or of its worker agent: it
        # ends at exactly its step count with the uninterrupted run's adapter, bit for bit,
        # and no failure recomputes more than checkpoint_every steps.
        # Far more steps than the kills need (the last falls before step 220): a new
        # attempt's trainer can start during one of train_until's looks and run unstopped
        # until the next, and a look can take seconds when the cluster shares the machine
        # with other tests. CI saw attempts run their last 130 and 310 steps (4 ms each)
        # unseen with 240 and 480 steps; 1,780 steps after the last kill take about 8 s.
        steps, every = 2000, 10
        train = f", checkpoint_every: {every}"
        reference = self.submit("chaos-reference", steps=steps, train=train)
        job_id = self.submit("chaos", steps=steps, train=train, extra="max_restarts: 10\n")
        rng = random.Random(10)
        deadline = time.time() + 4 * TIMEOUT
        for kill in range(10):
            target = 20 * (kill + 1) + rng.randrange(20)
            attempts = self.train_until(job_id, kill + 1, target, deadline)
            trainer = f"/{job_id}-g{kill + 1}-r0/"
            if kill % 2 == 0:
                self.signal_processes(trainer, signal.SIGKILL)  # stopped or not
            else:
                worker = attempts[-1]["placements"][0]["worker_id"]
                self.cluster.workers[worker].kill()
                self.cluster.workers[worker].wait()
                # The trainer finds its agent gone at its next step (or was killed with it).
                self.signal_processes(trainer, signal.SIGCONT)
                self.cluster.start_worker(worker)
        for one in (reference, job_id):
            watch = self.cluster.lathe("watch", one, timeout=4 * TIMEOUT)
            self.assertEqual(watch.returncode, 0, watch.stdout + watch.stderr)
        job = self.status(job_id)
        self.assertEqual(job["restarts"], 10)
        self.assertEqual(job["progress"]["step"], steps)
        attempts = job["attempts"]
        for failed, after in zip(attempts, attempts[1:]):
            self.assertEqual(failed["failure"], "infrastructure", failed)
            recomputed = failed["progress"]["step"] - after["resumed_from_step"]
            self.assertLessEqual(recomputed, every, (failed, after))
        self.assertEqual(self.adapter_bytes(reference), self.adapter_bytes(job_id))

    def test_3_cancel_stops_the_trainer(self):
        job_id = self.submit("cancelled", steps=100000)
        self.wait_running(job_id)
        self.assertTrue(self.trainer_pids(job_id))
        # While it runs: MFU is the model FLOPs per token times tokens/s over the peak.
        with open(os.path.join(self.model, "config.json")) as f:
            config = json.load(f)
        progress = self.status(job_id)["progress"]
        self.assertGreater(progress["tokens_per_second"], 0)
        expected = (lora_flops_per_token(config, 4, 32) * progress["tokens_per_second"]
                    / PEAK_FLOPS)
        self.assertAlmostEqual(progress["mfu"], expected, delta=1e-9 * expected)
        self.assertGreater(progress["mfu"], 0)
        shown = self.cluster.lathe("status", job_id)
        self.assertRegex(shown.stdout, r"MFU \d+\.\d%")  # a later step than `progress`'s
        result = self.cluster.lathe("cancel", job_id)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual(self.status(job_id)["state"], "cancelled")
        deadline = time.time() + 20
        while self.trainer_pids(job_id) and time.time() < deadline:
            time.sleep(0.1)
        self.assertEqual(self.trainer_pids(job_id), [])

    def test_4_bad_input(self):
        bad = self.spec("bad")
        with open(bad, "a") as f:
            f.write("method: lorax\n")
        result = self.cluster.lathe("submit", bad)
        self.assertEqual(result.returncode, 1)
        self.assertIn("method", result.stderr)
        # What the engine cannot run is refused at submit: one line naming the field, no job.
        before = set(self.list_jobs())
        for name, extra, field in (("mezo-zero1", "method: mezo\nstrategy: {zero_stage: 1}\n",
                                    "strategy.zero_stage: 1 with method mezo"),):
            result = self.cluster.lathe("submit", self.spec(name, extra=extra))
            self.assertEqual(result.returncode, 1, result.stdout)
            self.assertEqual(result.stdout, "")
            self.assertEqual(len(result.stderr.strip().splitlines()), 1, result.stderr)
            self.assertIn(f"the coordinator refused the job: spec: {field} is not supported",
                          result.stderr)
        self.assertEqual(set(self.list_jobs()), before)
        missing = self.cluster.lathe("status", "no-such-job")
        self.assertEqual(missing.returncode, 1)
        self.assertIn("not found", missing.stderr)
        unreachable = run("lathe", "--coordinator", f"127.0.0.1:{free_port()}", "list")
        self.assertEqual(unreachable.returncode, 1)
        self.assertEqual(len(unreachable.stderr.strip().splitlines()), 1, unreachable.stderr)
        self.assertIn("cannot reach the coordinator", unreachable.stderr)
        self.assertEqual(run("lathe", "frobnicate").returncode, 2)

    def test_4e_bad_weights_and_data_are_refused_at_submit(self):
        # Issue #32: what the trainer would refuse a second after starting is refused at
        # submit, before the queue: one line naming the field, the file and the line; no job.
        before = set(self.list_jobs())
        broken = os.path.join(self.root, "broken.jsonl")
        with open(broken, "w") as f:
            f.write('{"input_ids": [1, 2]}\n\n{"input_ids": [1,\n')
        bare = os.path.join(self.root, "bare-model")
        os.makedirs(bare, exist_ok=True)
        shutil.copy(os.path.join(self.model, "config.json"), bare)
        for name, old, new, message in (
                ("broken-line", self.data, broken,
                 f"spec: data.train: {broken}: line 3: not valid JSON"),
                ("no-weights", self.model, bare,
                 f"spec: model.path: {bare}: neither model.safetensors nor "
                 "model.safetensors.index.json exists")):
            path = self.spec(name)
            with open(path) as f:
                text = f.read().replace(old, new)
            with open(path, "w") as f:
                f.write(text)
            result = self.cluster.lathe("submit", path)
            self.assertEqual(result.returncode, 1, result.stdout)
            self.assertEqual(result.stdout, "")
            self.assertEqual(len(result.stderr.strip().splitlines()), 1, result.stderr)
            self.assertIn(f"the coordinator refused the job: {message}", result.stderr)
        self.assertEqual(set(self.list_jobs()), before)
        # A bad id past the bound (1000 lines) is the trainer's to find: the job fails, and
        # its reason says the error once.
        late = os.path.join(self.root, "late.jsonl")
        with open(self.data) as f:
            first = f.readline()
        with open(late, "w") as f:
            f.write(first * 1000 + '{"input_ids": [1, 999999]}\n')
        path = self.spec("late-bad-id")
        with open(path) as f:
            text = f.read().replace(self.data, late)
        with open(path, "w") as f:
            f.write(text)
        result = self.cluster.lathe("submit", path)
        self.assertEqual(result.returncode, 0, result.stderr)
        job_id = result.stdout.strip()
        self.assertEqual(self.cluster.lathe("watch", job_id).returncode, 1)
        job = self.status(job_id)
        self.assertEqual(job["state"], "failed", job)
        error = f"{late}: line 1001: input_ids[1]: token id 999999 is outside the vocabulary"
        self.assertEqual(job["reason"].count(error), 1, job["reason"])
        self.assertEqual(job["reason"].count("token id 999999"), 1, job["reason"])

    def test_4b_every_call_needs_the_right_token(self):
        # No token, an unknown one, a worker's: refused with one line, exit 1.
        plain = run("lathe", "--coordinator", self.cluster.address, "list")
        self.assertEqual(plain.returncode, 1)
        self.assertIn("no bearer token", plain.stderr)
        wrong = run("lathe", "--coordinator", self.cluster.address, "--token",
                    "not-a-token-0123456789", "list")
        self.assertEqual(wrong.returncode, 1)
        self.assertEqual(wrong.stderr, "lathe: unknown token\n")
        as_worker = self.cluster.lathe("list", role="worker")
        self.assertEqual(as_worker.returncode, 1)
        self.assertIn("e2e-worker (worker) may not call ListJobs", as_worker.stderr)
        self.assertEqual(self.cluster.lathe("list", role="admin").returncode, 0)
        # A worker agent with a client's token is refused at registration and says so.
        agent = subprocess.run(
            [os.path.join(BIN, "lathe-worker"), "agent", "--coordinator", self.cluster.address,
             "--worker-id", "impostor", "--token-file", self.cluster.tokens["client"],
             "--work-dir", os.path.join(self.root, "impostor")],
            capture_output=True, text=True, timeout=30)
        self.assertNotEqual(agent.returncode, 0)
        self.assertIn("e2e-client (client) may not call RegisterWorker", agent.stderr)
        # The coordinator will not start without tokens unless told to run open.
        unsafe = run("lathe-coordinator", "--db", ":memory:", "--listen", "127.0.0.1:0")
        self.assertEqual(unsafe.returncode, 2)
        self.assertIn("--auth-tokens FILE is required", unsafe.stderr)
        with open(self.cluster.tokens["client"]) as token, \
                open(os.path.join(self.root, "coordinator.log")) as log:
            self.assertNotIn(token.read().strip(), log.read())

    def test_4a_device_rates_change_the_plans(self):
        rates = os.path.join(self.root, "rates.json")
        with open(rates, "w") as f:
            f.write('{"cpu": {"flops": -1}}')
        bad = run("lathe-coordinator", "--db", ":memory:", "--listen", "127.0.0.1:0",
                  "--insecure-no-auth", "--device-rates", rates)
        self.assertEqual(bad.returncode, 2)
        self.assertEqual(bad.stderr, f"lathe-coordinator: --device-rates: {rates}: cpu.flops: "
                                     "must be > 0, got -1\n")
        default = self.cluster.lathe("--output", "json", "plan", self.spec("rated"))
        self.assertEqual(default.returncode, 0, default.stderr)
        # Twice the default CPU rate (80 GFLOP/s, planner/device_pools.cc): one
        # rank's compute-bound step halves.
        with open(rates, "w") as f:
            f.write('{"cpu": {"flops": 1.6e11}}')
        other = Cluster(os.path.join(self.root, "rated"), self.cluster.tokens)
        os.makedirs(other.root)
        with open(os.path.join(other.root, "coordinator.log"), "w") as log:
            process = subprocess.Popen(
                [os.path.join(BIN, "lathe-coordinator"), "--listen", other.address, "--db",
                 ":memory:", "--allowed-roots", self.root, "--auth-tokens",
                 self.cluster.tokens["file"], "--device-rates", rates],
                stdout=subprocess.PIPE, stderr=log,
                text=True)
        try:
            self.assertIn("listening on", process.stdout.readline())
            faster = other.lathe("--output", "json", "plan", self.spec("rated"))
            self.assertEqual(faster.returncode, 0, faster.stderr)
        finally:
            process.terminate()
            process.wait(timeout=10)
            process.stdout.close()
        ratio = (json.loads(faster.stdout)["tokens_per_second"] /
                 json.loads(default.stdout)["tokens_per_second"])
        self.assertAlmostEqual(ratio, 2.0, places=3)

    def test_4b_one_coordinator_per_database_and_port(self):
        # Issue #27: a second coordinator on the running one's database refuses to start,
        # naming the holder; on its port (no SO_REUSEPORT) it cannot listen.
        same_db = run("lathe-coordinator", "--db", self.cluster.db, "--listen", "127.0.0.1:0",
                      "--insecure-no-auth", "--allowed-roots", self.root)
        self.assertNotEqual(same_db.returncode, 0)
        self.assertIn(f"{self.cluster.db} is in use by another coordinator "
                      f"(pid {self.cluster.coordinator.pid})", same_db.stderr)
        same_port = run("lathe-coordinator", "--db", ":memory:", "--listen",
                        self.cluster.address, "--insecure-no-auth")
        self.assertNotEqual(same_port.returncode, 0)
        self.assertIn(f"cannot listen on {self.cluster.address}", same_port.stderr)
        # The running coordinator still answers.
        self.assertEqual(self.cluster.lathe("list").returncode, 0)

    def test_4c_a_stopped_coordinator_charges_no_job(self):
        # Issue #27: SIGSTOP of the coordinator for longer than the heartbeat timeout (5 s
        # here), then SIGCONT: the workers get a fresh heartbeat window (before, the first
        # check after the stall declared them lost), and the running job keeps its attempt.
        job_id, _ = self.running_until_cleanup("stalled")
        coordinator = self.cluster.coordinator.pid
        os.kill(coordinator, signal.SIGSTOP)
        try:
            time.sleep(8)
        finally:
            os.kill(coordinator, signal.SIGCONT)
        time.sleep(3)  # heartbeat checks, and several heartbeats, after the stall
        job = self.status(job_id)
        self.assertEqual(job["state"], "running", job)
        self.assertEqual(len(job["attempts"]), 1, job)
        workers = self.cluster.lathe("--output", "json", "workers")
        self.assertEqual(workers.returncode, 0, workers.stderr)
        for worker in json.loads(workers.stdout):
            self.assertNotEqual(worker["state"], "lost", worker)

    def test_4d_a_second_agent_cannot_take_a_live_workers_id(self):
        # Issue #27: an agent started under the worker id of a live one is refused with a
        # clear error and takes nothing over: the running job keeps its attempt.
        job_id, job = self.running_until_cleanup("duplicate-id")
        worker = job["attempts"][-1]["placements"][0]["worker_id"]
        impostor = subprocess.Popen(
            [os.path.join(BIN, "lathe-worker"), "agent", "--coordinator", self.cluster.address,
             "--worker-id", worker, "--token-file", self.cluster.tokens["worker"],
             "--slots", "4", "--work-dir", os.path.join(self.root, "duplicate")],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            time.sleep(4)
        finally:
            impostor.kill()
            output, _ = impostor.communicate()
        self.assertIn(f"worker {worker} is registered by a live agent", output)
        job = self.status(job_id)
        self.assertEqual(job["state"], "running", job)
        self.assertEqual(len(job["attempts"]), 1, job)

    def test_5_a_restarted_coordinator_keeps_every_job(self):
        def history():
            result = self.cluster.lathe("--output", "json", "plan", "--history")
            self.assertEqual(result.returncode, 0, result.stderr)
            return json.loads(result.stdout)
        corrections = history()["corrections"]
        self.assertGreater(len(corrections), 0)
        before = self.list_jobs()
        self.assertGreaterEqual(len(before), 3)
        self.cluster.stop_coordinator()
        self.cluster.start_coordinator()
        after = self.list_jobs()
        self.assertEqual(set(after), set(before))
        # The planner's corrections are rebuilt from the stored attempts.
        self.assertEqual(history()["corrections"], corrections)
        for job_id, job in before.items():
            self.assertEqual(after[job_id]["state"], job["state"], job_id)
            self.assertEqual(after[job_id].get("final_loss"), job.get("final_loss"), job_id)
        # The agents register again and take new work.
        self.wait_for_workers(2)
        job_id = self.submit("after-restart")
        self.assertEqual(self.cluster.lathe("watch", job_id).returncode, 0)
        self.expect_adapter(job_id)

    def test_6_draining_a_worker_moves_its_job_without_a_restart(self):
        job_id = self.submit("drained", steps=300, train=", checkpoint_every: 1000")
        job = self.wait_running(job_id)
        worker = job["attempts"][-1]["placements"][0]["worker_id"]
        refused = self.cluster.lathe("workers", "drain", worker)  # a client token
        self.assertEqual(refused.returncode, 1)
        self.assertIn("(admin only)", refused.stderr)
        drained = self.cluster.lathe("workers", "drain", worker, role="admin")
        self.assertEqual(drained.returncode, 0, drained.stderr)
        self.assertIn(f"worker {worker} is draining", drained.stdout)
        watch = self.cluster.lathe("watch", job_id)
        self.assertEqual(watch.returncode, 0, watch.stdout + watch.stderr)
        job = self.status(job_id)
        self.assertEqual(job["state"], "succeeded", job)
        self.assertEqual(job["restarts"], 0)  # a drain is not the job's failure
        first, second = job["attempts"]
        self.assertIn(f"worker {worker} is being drained", first["error"])
        self.assertNotEqual(second["placements"][0]["worker_id"], worker)
        # The stopped trainer checkpointed on SIGTERM: the next attempt resumed from there.
        self.assertGreater(second["resumed_from_step"], 0)
        workers = json.loads(self.cluster.lathe("--output", "json", "workers").stdout)
        self.assertEqual({w["worker_id"]: w["state"] for w in workers}[worker], "draining")
        alive = self.cluster.lathe("workers", "remove", worker, role="admin")
        self.assertEqual(alive.returncode, 1)
        self.assertIn("is not lost", alive.stderr)


if __name__ == "__main__":
    unittest.main()
