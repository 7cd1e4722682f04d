#!/usr/bin/env python3
"""`lathe-worker train` answering profile requests (docs/observability.md, "Profiling"): a
ProfileRequest (protobuf JSON) at <profile dir>/request.json is taken before the next step,
the next `steps` steps are profiled and one TrainerProfile event lists the files: a Chrome
trace with every engine scope and the rank in its process name, and a memory timeline whose
peak is the steps' reported peak (Progress.memory.total) within 1%. A bad request is answered
with an error and training finishes.

Run by ctest (label integration), or by hand:
  LATHE_BIN_DIR=build/bin .venv/bin/python tests/train/profile_request_test.py -v
"""
import json
import os
import shutil
import subprocess
import tempfile
import unittest

BIN = os.environ.get("LATHE_BIN_DIR", os.path.join(os.path.dirname(__file__), "../../build/bin"))

SCOPES = ["step.1", "step.2", "data/batch", "data/collate", "forward", "forward/embeddings",
          "forward/block.0", "forward/block.1", "loss", "backward", "optimizer"]


class ProfileRequestTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.root = tempfile.mkdtemp(prefix="lathe-profile-")
        cls.model = os.path.join(cls.root, "model")
        cls.data = os.path.join(cls.root, "train.jsonl")
        for args in (("model", "--out", cls.model), ("data", "--out", cls.data, "--records", "64")):
            subprocess.run([os.path.join(BIN, "lathe-synth"), *args], check=True,
                           capture_output=True)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.root, ignore_errors=True)

    def train(self, name, request=None, extra=()):
        """Runs a 4-step LoRA job with `request` (text) waiting in its profile directory;
        returns (events, profile dir)."""
        spec = os.path.join(self.root, f"{name}.yaml")
        with open(spec, "w") as f:
            f.write(f"""name: {name}
model: {{path: {self.model}}}
data: {{train: {self.data}, seq_len: 32}}
method: lora
lora: {{rank: 4, alpha: 8}}
train: {{steps: 4, global_batch: 2, lr: 1.0e-3}}
strategy: {{zero_stage: 0}}
output: {os.path.join(self.root, name)}
""")
        profile_dir = os.path.join(self.root, f"{name}-profile")
        os.makedirs(profile_dir)
        if request is not None:
            # As the agent writes it: a temporary file renamed into place.
            with open(os.path.join(profile_dir, "request.json.tmp"), "w") as f:
                f.write(request)
            os.rename(os.path.join(profile_dir, "request.json.tmp"),
                      os.path.join(profile_dir, "request.json"))
        done = subprocess.run(
            [os.path.join(BIN, "lathe-worker"), "train", "--spec", spec, "--output", "json",
             "--threads", "1", "--peak-flops", "1e10", "--profile-dir", profile_dir, *extra],
            capture_output=True, text=True)
        self.assertEqual(done.returncode, 0, done.stderr)
        events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        self.assertIn("done", events[-1])
        return events, profile_dir

    def test_a_request_gives_a_trace_and_a_memory_timeline(self):
        events, profile_dir = self.train(
            "traced", json.dumps({"capture_id": "cap-1", "steps": "2", "memory": True}))
        profiles = [e["profile"] for e in events if "profile" in e]
        self.assertEqual(len(profiles), 1)
        profile = profiles[0]
        self.assertEqual(profile["capture_id"], "cap-1")
        self.assertEqual(profile["error"], "")
        self.assertEqual((int(profile["first_step"]), int(profile["last_step"])), (1, 2))
        capture = os.path.join(profile_dir, "cap-1")
        self.assertEqual(profile["files"], [os.path.join(capture, "rank-0.trace.json"),
                                            os.path.join(capture, "rank-0.memory.json")])
        self.assertFalse(os.path.exists(os.path.join(profile_dir, "request.json")))
        # The event comes after step 2's and before step 3's.
        kinds = [next(iter(e)) for e in events]
        self.assertEqual(kinds.index("profile"), kinds.index("step") + 2)

        with open(profile["files"][0]) as f:
            trace = json.load(f)
        self.assertIsInstance(trace["traceEvents"], list)
        names = {e.get("name") for e in trace["traceEvents"] if e.get("ph") == "X"}
        for scope in SCOPES:
            self.assertIn(scope, names)
        self.assertNotIn("step.3", names)
        process_names = [e["args"]["name"] for e in trace["traceEvents"]
                         if e.get("ph") == "M" and e.get("name") == "process_name"]
        self.assertIn("lathe rank 0", process_names)

        with open(profile["files"][1]) as f:
            memory = json.load(f)
        steps = [e["step"]["progress"] for e in events if "step" in e][:2]
        reported = max(int(p["memory"]["total"]) for p in steps)
        self.assertAlmostEqual(memory["peak"]["bytes"], reported, delta=0.01 * reported)
        self.assertEqual(sum(memory["peak"]["at_peak"].values()), memory["peak"]["bytes"])
        self.assertLessEqual(len(memory["peak"]["top_blocks"]), 10)
        self.assertIn("backward", {e["scope"] for e in memory["events"]})

    def test_a_bad_request_is_answered_and_training_finishes(self):
        events, _ = self.train("bad", "{not json")
        profiles = [e["profile"] for e in events if "profile" in e]
        self.assertEqual(len(profiles), 1)
        self.assertIn("not a profile request", profiles[0]["error"])
        self.assertEqual(profiles[0]["files"], [])
        self.assertEqual(int(events[-1]["done"]["steps"]), 4)

        events, _ = self.train("zero", json.dumps({"capture_id": "z", "steps": 0}))
        profiles = [e["profile"] for e in events if "profile" in e]
        self.assertEqual(len(profiles), 1)
        self.assertIn("steps: 0", profiles[0]["error"])
        self.assertIn("done", events[-1])

    def test_each_rank_names_its_process_and_its_gradient_sum(self):
        spec = os.path.join(self.root, "two.yaml")
        with open(spec, "w") as f:
            f.write(f"""name: two
model: {{path: {self.model}}}
data: {{train: {self.data}, seq_len: 32}}
method: lora
lora: {{rank: 4, alpha: 8}}
train: {{steps: 3, global_batch: 2, lr: 1.0e-3}}
resources: {{ranks: 2}}
strategy: {{zero_stage: 0}}
output: {os.path.join(self.root, "two")}
""")
        meet = os.path.join(self.root, "two-rendezvous")
        os.makedirs(meet)
        ranks = [subprocess.Popen(
            [os.path.join(BIN, "lathe-worker"), "train", "--spec", spec, "--output", "json",
             "--threads", "1", "--peak-flops", "1e10", "--rank", str(rank), "--world-size", "2",
             "--rendezvous-dir", meet, "--profile-steps", "1",
             "--profile-dir", os.path.join(self.root, f"two-profile-{rank}")],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
        for rank, proc in enumerate(ranks):
            out, err = proc.communicate(timeout=240)
            self.assertEqual(proc.returncode, 0, err)
            events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
            profile = next(e["profile"] for e in events if "profile" in e)
            self.assertEqual(profile["error"], "")
            self.assertTrue(profile["files"][0].endswith(f"/rank-{rank}.trace.json"))
            with open(profile["files"][0]) as f:
                trace = json.load(f)["traceEvents"]
            names = {e.get("name") for e in trace if e.get("ph") == "X"}
            self.assertIn("comm/all_reduce/gradients", names)
            self.assertIn("comm/all_reduce/scalars", names)
            process_names = [e["args"]["name"] for e in trace
                             if e.get("ph") == "M" and e.get("name") == "process_name"]
            self.assertIn(f"lathe rank {rank}", process_names)

    def test_profile_steps_profiles_the_first_steps(self):
        events, profile_dir = self.train("local", None, ("--profile-steps", "1"))
        profiles = [e["profile"] for e in events if "profile" in e]
        self.assertEqual(len(profiles), 1)
        self.assertEqual(profiles[0]["error"], "")
        self.assertTrue(profiles[0]["capture_id"].startswith("local-"))
        self.assertEqual(len(profiles[0]["files"]), 1)
        self.assertTrue(profiles[0]["files"][0].startswith(profile_dir + "/"))


if __name__ == "__main__":
    unittest.main()
