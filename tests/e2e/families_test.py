#!/usr/bin/env python3
"""The model families added for issue #31 (Gemma 2, Phi-3), through the services as a user runs them: a
coordinator and a worker agent as real processes, a scripts/demo-sized LoRA job submitted with
the `lathe` CLI on a synthetic model of the family (lathe-synth), and its exported adapter
loaded by PEFT over transformers' own model class for that directory. PEFT's model must give
the logits of the base model plus the adapter as Lathe trained it: the same as transformers'
base model with the adapter's update merged into its weights by hand, and different from the
base model's (the trained B is not zero).

Run by ctest (label e2e) with the project venv's Python (torch, transformers, peft), or:
  LATHE_BIN_DIR=build/bin .venv/bin/python tests/e2e/families_test.py -v
"""
import json
import os
import unittest

import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from services_test import TIMEOUT, ClusterTest, run

# Each family: lathe-synth's flags for a small model of it (a sliding and a global layer,
# tied embeddings where the family ties them).
FAMILIES = {
    "gemma2": ["--type", "gemma2", "--layers", "2", "--hidden", "64", "--heads", "4",
               "--kv-heads", "2", "--head-dim", "16", "--intermediate", "128",
               "--sliding-window", "8"],
    # Phi-4-mini-like: fused qkv_proj and gate_up_proj, partial rotary, LongRoPE, tied.
    "phi3": ["--type", "phi3", "--layers", "2", "--hidden", "64", "--heads", "4",
             "--kv-heads", "2", "--intermediate", "128", "--partial-rotary", "0.75",
             "--longrope", "16", "--tied"],
}


class FamiliesTest(ClusterTest):
    PREFIX, MAX_POS, RECORDS, WORKERS = "lathe-families-", 128, 32, ("w1",)

    def train(self, family):
        """Trains a LoRA job on a `family` model through the services; returns the model
        directory and the adapter directory."""
        model = os.path.join(self.root, f"model-{family}")
        result = run("lathe-synth", "model", "--out", model, "--max-pos", str(self.MAX_POS),
                     *FAMILIES[family])
        self.assertEqual(result.returncode, 0, result.stderr)
        name = f"{family}-lora"
        spec = os.path.join(self.root, f"{name}.yaml")
        output = os.path.join(self.root, "runs", name)
        with open(spec, "w") as f:
            f.write(f"""name: {name}
model: {{path: {model}}}
data: {{train: {self.data}, seq_len: 32}}
lora: {{rank: 4, alpha: 8}}
train: {{steps: 8, global_batch: 4, lr: 1.0e-2}}
resources: {{ranks: 1, device: cpu}}
output: {output}
""")
        submitted = self.cluster.lathe("submit", spec)
        self.assertEqual(submitted.returncode, 0, submitted.stderr)
        job_id = submitted.stdout.strip()
        watched = self.cluster.lathe("watch", job_id, timeout=TIMEOUT)
        self.assertEqual(watched.returncode, 0, watched.stdout + watched.stderr)
        job = self.status(job_id)
        self.assertEqual(job["state"], "succeeded", json.dumps(job)[:2000])
        adapter = os.path.join(output, "adapter")
        self.assertTrue(os.path.isfile(os.path.join(adapter, "adapter_config.json")), adapter)
        return model, adapter

    def check_peft_loads(self, model_dir, adapter_dir):
        torch.manual_seed(0)
        ids = torch.randint(0, 256, (1, 24))
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            base_logits = base(ids).logits
        peft = PeftModel.from_pretrained(base, adapter_dir).eval()
        with torch.no_grad():
            peft_logits = peft(ids).logits
        self.assertGreater((peft_logits - base_logits).abs().max().item(), 1e-4,
                           "the trained adapter changes nothing")

        # The same adapter merged by hand into a fresh copy of the base model.
        with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
            config = json.load(f)
        tensors = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
        merged = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        parameters = dict(merged.named_parameters())
        scale = config["lora_alpha"] / config["r"]
        touched = 0
        for name, a in tensors.items():
            if ".lora_A." not in name:
                continue
            b = tensors[name.replace(".lora_A.", ".lora_B.")]
            weight = name.replace("base_model.model.", "", 1).replace(".lora_A.weight", ".weight")
            with torch.no_grad():
                parameters[weight] += scale * (b @ a)
            touched += 1
        self.assertGreater(touched, 0)
        with torch.no_grad():
            merged_logits = merged(ids).logits
        torch.testing.assert_close(peft_logits, merged_logits, rtol=1e-4, atol=1e-4)

    def test_gemma2_lora_through_the_services_loads_in_peft(self):
        model, adapter = self.train("gemma2")
        self.check_peft_loads(model, adapter)

    def test_phi3_lora_through_the_services_loads_in_peft(self):
        model, adapter = self.train("phi3")
        self.check_peft_loads(model, adapter)


if __name__ == "__main__":
    unittest.main()
