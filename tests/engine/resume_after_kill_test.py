#!/usr/bin/env python3
"""`lathe-worker train` SIGKILLed between two checkpoints and started again, once per
optimizer: it resumes from its newest checkpoint and ends with the uninterrupted run's
weights, bit for bit (docs/training.md, "Checkpoints and resume"). Full fine-tuning of the
synthetic model, so that 8-bit AdamW quantizes its larger tensors (>= 4096 elements) and
Adafactor factors its matrices.

Run by ctest (label integration), or by hand:
  LATHE_BIN_DIR=build/bin .venv/bin/python tests/engine/resume_after_kill_test.py -v
"""
import json
import os
import shutil
import signal
import subprocess
import tempfile
import unittest

BIN = os.environ.get("LATHE_BIN_DIR", os.path.join(os.path.dirname(__file__), "../../build/bin"))
STEPS, EVERY, KILL_AT = 300, 10, 25
OPTIMIZERS = {
    "adamw": "",
    "adamw8bit": "",
    "adafactor": ", adafactor_beta1: 0.9",
    "sgd": ", sgd_momentum: 0.9, sgd_nesterov: true",
}


def train_command(spec):
    return [os.path.join(BIN, "lathe-worker"), "train", "--spec", spec, "--output", "json",
            "--threads", "1", "--peak-flops", "1e10"]


class ResumeAfterKillTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.root = tempfile.mkdtemp(prefix="lathe-resume-")
        cls.model = os.path.join(cls.root, "model")
        cls.data = os.path.join(cls.root, "train.jsonl")
        for args in (("model", "--out", cls.model), ("data", "--out", cls.data, "--records", "64")):
            subprocess.run([os.path.join(BIN, "lathe-synth"), *args], check=True,
                           capture_output=True)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.root, ignore_errors=True)

    def spec(self, name, optimizer, extra):
        path = os.path.join(self.root, f"{name}.yaml")
        with open(path, "w") as f:
            f.write(f"""name: {name}
model: {{path: {self.model}}}
data: {{train: {self.data}, seq_len: 32}}
method: full
train: {{steps: {STEPS}, global_batch: 2, lr: 1.0e-3, weight_decay: 0.01,
         checkpoint_every: {EVERY}, optimizer: {optimizer}{extra}}}
strategy: {{zero_stage: 0}}
output: {os.path.join(self.root, name)}
""")
        return path

    def weights(self, name):
        with open(os.path.join(self.root, name, "model", "model.safetensors"), "rb") as f:
            return f.read()

    def test_each_optimizer_resumes_bit_identically(self):
        for optimizer, extra in OPTIMIZERS.items():
            with self.subTest(optimizer=optimizer):
                straight = self.spec(f"{optimizer}-straight", optimizer, extra)
                done = subprocess.run(train_command(straight), capture_output=True, text=True)
                self.assertEqual(done.returncode, 0, done.stderr)

                killed = self.spec(f"{optimizer}-killed", optimizer, extra)
                # Events are read one at a time: the trainer cannot run further ahead than the
                # pipe holds (~64 KiB, far fewer than STEPS - KILL_AT events), so the kill
                # lands mid-run however fast the steps are.
                trainer = subprocess.Popen(train_command(killed), stdout=subprocess.PIPE,
                                           stderr=subprocess.DEVNULL, text=True)
                for line in trainer.stdout:
                    step = json.loads(line).get("step")
                    if step is not None and int(step["progress"]["step"]) >= KILL_AT:
                        trainer.send_signal(signal.SIGKILL)
                        break
                trainer.stdout.close()
                self.assertEqual(trainer.wait(), -signal.SIGKILL)

                again = subprocess.run(train_command(killed), capture_output=True, text=True)
                self.assertEqual(again.returncode, 0, again.stderr)
                start = json.loads(again.stdout.splitlines()[0])["start"]
                self.assertGreaterEqual(int(start["resumed_from_step"]), KILL_AT - EVERY + 1)
                self.assertEqual(self.weights(f"{optimizer}-killed"),
                                 self.weights(f"{optimizer}-straight"))


if __name__ == "__main__":
    unittest.main()
