#!/usr/bin/env python3
"""Bad input to `lathe-worker train`: every case exits non-zero with one line on stderr that
names the field or file, and leaves no output behind."""
import json
import os
import shutil
import subprocess
import tempfile
import unittest

BIN = os.environ.get("LATHE_BIN_DIR", os.path.join(os.path.dirname(__file__), "../../build/bin"))


def run(*args):
    return subprocess.run([os.path.join(BIN, args[0]), *args[1:]], capture_output=True, text=True)


class WorkerTrainBadInputTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.root = tempfile.mkdtemp(prefix="lathe-cli-")
        cls.model = os.path.join(cls.root, "model")
        cls.data = os.path.join(cls.root, "train.jsonl")
        for cmd in (("lathe-synth", "model", "--out", cls.model, "--max-pos", "64"),
                    ("lathe-synth", "data", "--out", cls.data, "--records", "16")):
            result = run(*cmd)
            assert result.returncode == 0, result.stderr

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.root)

    def setUp(self):
        self.dir = tempfile.mkdtemp(dir=self.root)
        self.output = os.path.join(self.dir, "out")

    def spec(self, **overrides):
        spec = {
            "name": "bad-input",
            "model": {"path": self.model},
            "data": {"train": self.data, "seq_len": 32},
            "lora": {"rank": 4, "alpha": 8},
            "train": {"steps": 2, "global_batch": 2, "lr": 1e-3},
            "output": self.output,
        }
        for dotted, value in overrides.items():
            node = spec
            keys = dotted.split("__")
            for key in keys[:-1]:
                node = node[key]
            node[keys[-1]] = value
        return spec

    def write(self, name, text):
        path = os.path.join(self.dir, name)
        with open(path, "w") as f:
            f.write(text)
        return path

    def expect_error(self, spec_path, *fragments, flags=()):
        result = run("lathe-worker", "train", "--spec", spec_path, *flags)
        self.assertNotEqual(result.returncode, 0, result.stdout)
        lines = result.stderr.strip().splitlines()
        self.assertEqual(len(lines), 1, result.stderr)
        for fragment in fragments:
            self.assertIn(fragment, lines[0])
        self.assertFalse(os.path.exists(self.output), "bad input left output behind")

    def expect_spec_error(self, spec, *fragments):
        self.expect_error(self.write("job.json", json.dumps(spec)), *fragments)

    def copy_model(self):
        copy = os.path.join(self.dir, "model")
        shutil.copytree(self.model, copy)
        return copy

    def test_every_command_answers_help(self):
        # Issue #32: `lathe-synth model --help` said "unknown flag --help".
        for command in (("lathe-worker", "train"), ("lathe-worker", "score"),
                        ("lathe-worker", "merge"), ("lathe-synth", "model"),
                        ("lathe-synth", "data"), ("lathe-synth", "adapter"),
                        ("lathe-synth", "tokenizer")):
            for flag in ("--help", "-h"):
                result = run(*command, flag)
                self.assertEqual(result.returncode, 0, (command, flag, result.stderr))
                self.assertIn(f"usage: {command[0]} {command[1]} [flags]", result.stdout)
                self.assertIn("  --", result.stdout)

    def test_score_names_the_adapter_flag(self):
        # An adapter that does not fit the model: its errors name --adapter, not the spec's
        # lora.init_from (there is no spec).
        adapter = os.path.join(self.dir, "adapter")
        result = run("lathe-synth", "adapter", "--model", self.model, "--out", adapter,
                     "--rank", "4")
        self.assertEqual(result.returncode, 0, result.stderr)
        config_path = os.path.join(adapter, "adapter_config.json")
        with open(config_path) as f:
            config = json.load(f)
        config["r"] = 8  # the tensors have rank 4
        with open(config_path, "w") as f:
            json.dump(config, f)
        result = run("lathe-worker", "score", "--model", self.model, "--adapter", adapter,
                     "--data", self.data, "--seq-len", "32")
        self.assertNotEqual(result.returncode, 0, result.stdout)
        lines = result.stderr.strip().splitlines()
        self.assertEqual(len(lines), 1, result.stderr)
        self.assertTrue(lines[0].startswith("lathe-worker score: --adapter: "), lines[0])
        self.assertIn("adapter_model.safetensors", lines[0])
        self.assertIn("[4, 64] vs [8, 64]", lines[0])
        self.assertNotIn("lora.init_from", lines[0])

    def test_missing_spec(self):
        self.expect_error(os.path.join(self.dir, "nope.yaml"), "nope.yaml")

    def test_malformed_spec(self):
        self.expect_error(self.write("job.yaml", "name: [unclosed\n"), "job.yaml")

    def test_missing_required_field(self):
        spec = self.spec()
        del spec["data"]
        self.expect_spec_error(spec, "data.train")

    def test_missing_model_directory(self):
        self.expect_spec_error(self.spec(model__path=os.path.join(self.dir, "none")),
                               "model.path", "none")

    def test_malformed_config_json(self):
        model = self.copy_model()
        with open(os.path.join(model, "config.json"), "w") as f:
            f.write("{not json")
        self.expect_spec_error(self.spec(model__path=model), "model.path", "config.json")

    def test_missing_weights_file(self):
        model = self.copy_model()
        os.remove(os.path.join(model, "model.safetensors"))
        self.expect_spec_error(self.spec(model__path=model), "model.path", "model.safetensors")

    def test_truncated_weights(self):
        model = self.copy_model()
        path = os.path.join(model, "model.safetensors")
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) - 100)
        self.expect_spec_error(self.spec(model__path=model), "model.safetensors")

    def test_header_length_past_end_of_file(self):
        model = self.copy_model()
        with open(os.path.join(model, "model.safetensors"), "r+b") as f:
            f.write((1 << 40).to_bytes(8, "little"))
        self.expect_spec_error(self.spec(model__path=model), "model.safetensors", "header")

    def test_missing_tensor(self):
        model = self.copy_model()
        config_path = os.path.join(model, "config.json")
        with open(config_path) as f:
            config = json.load(f)
        config["num_hidden_layers"] += 1
        with open(config_path, "w") as f:
            json.dump(config, f)
        self.expect_spec_error(self.spec(model__path=model),
                               'tensor "model.layers.2.input_layernorm.weight" is missing')

    def test_missing_data_file(self):
        self.expect_spec_error(self.spec(data__train=os.path.join(self.dir, "none.jsonl")),
                               "data.train", "none.jsonl")

    def test_malformed_data_line(self):
        path = self.write("d.jsonl", '{"input_ids": [1, 2]}\n{"input_ids": [1,\n')
        self.expect_spec_error(self.spec(data__train=path), "data.train", "line 2")

    def test_empty_data_set(self):
        self.expect_spec_error(self.spec(data__train=self.write("d.jsonl", "\n")),
                               "data.train", "empty")

    def test_token_id_outside_vocabulary(self):
        path = self.write("d.jsonl", '{"input_ids": [1, 2, 256]}\n')
        self.expect_spec_error(self.spec(data__train=path), "data.train", "line 1",
                               "token id 256", "vocab_size 256")

    def test_unknown_target_module(self):
        self.expect_spec_error(self.spec(lora__targets=["q_proj", "qproj"]),
                               "lora.targets[1]", "qproj")

    def test_target_module_of_another_architecture(self):
        # Phi-3's fused qkv_proj is a projection name, but not one of this Llama's.
        self.expect_spec_error(self.spec(lora__targets=["q_proj", "qkv_proj"]),
                               "lora.targets", "qkv_proj", "is not a projection of this llama",
                               "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj")

    def test_rank_not_positive(self):
        self.expect_spec_error(self.spec(lora__rank=0), "lora.rank")

    def test_seq_len_above_max_position_embeddings(self):
        self.expect_spec_error(self.spec(data__seq_len=65), "data.seq_len", "65",
                               "max_position_embeddings 64")

    def expect_flag_error(self, spec, flags, *fragments):
        self.expect_error(self.write("job.json", json.dumps(spec)), *fragments, flags=flags)

    def test_several_ranks_without_a_place_to_meet(self):
        two = self.spec(resources={"ranks": 2, "device": "cpu"})
        self.expect_flag_error(two, ["--rank", "0", "--world-size", "2"], "--rendezvous-dir")

    def test_world_size_other_than_the_specs_ranks(self):
        self.expect_flag_error(self.spec(), ["--world-size", "2", "--rendezvous-dir", self.dir],
                               "resources.ranks: 1", "--world-size is 2")

    def test_bad_prefetch_and_collective_timeout(self):
        self.expect_flag_error(self.spec(), ["--prefetch", "maybe"], "--prefetch", "maybe")
        self.expect_flag_error(self.spec(), ["--collective-timeout", "0"],
                               "--collective-timeout")

    def test_two_ranks_meet_in_a_directory_and_shard_with_zero3(self):
        spec = self.write("job.json", json.dumps(self.spec(
            resources={"ranks": 2, "device": "cpu"}, strategy={"zero_stage": 3})))
        rendezvous = os.path.join(self.dir, "rendezvous")
        procs = [subprocess.Popen(
            [os.path.join(BIN, "lathe-worker"), "train", "--spec", spec, "--rank", str(r),
             "--world-size", "2", "--rendezvous-dir", rendezvous, "--threads", "1",
             "--collective-timeout", "30"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True) for r in range(2)]
        outs = []
        for proc in procs:
            out, err = proc.communicate(timeout=120)
            self.assertEqual(proc.returncode, 0, err)
            outs.append(out)
        self.assertTrue(os.path.isfile(os.path.join(self.output, "adapter",
                                                    "adapter_model.safetensors")))
        # Rank 0 names the adapter it wrote; rank 1 wrote none and names nothing (issue #32:
        # its log ended with an empty "model: " line).
        self.assertIn(f"adapter: {self.output}/adapter", outs[0])
        self.assertNotIn("model:", outs[1])
        self.assertNotIn("adapter:", outs[1])

    def test_auto_fields_are_planned_here_never_silently_zero(self):
        # Issue #30: `zero_stage: auto` (and `strategy: auto`) with --spec run the planner as
        # `lathe plan --local` does; it used to become stage 0 without a word.
        spec = self.write("job.json", json.dumps(self.spec(
            resources={"ranks": 1, "device": "cpu", "memory_per_rank": "8GiB"},
            strategy={"zero_stage": "auto", "offload_optimizer": False,
                      "activation_checkpointing": "auto"})))
        result = run("lathe-worker", "train", "--spec", spec, "--threads", "1")
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertRegex(result.stdout, r"(?m)^planner: ZeRO-\d+.*configurations that fit")
        fixed = self.write("fixed.json", json.dumps(self.spec(
            strategy={"zero_stage": 0, "activation_checkpointing": False}, train={
                "steps": 2, "global_batch": 2, "micro_batch": 1, "lr": 1e-3},
            output=os.path.join(self.dir, "fixed"))))
        result = run("lathe-worker", "train", "--spec", fixed, "--threads", "1")
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("plan: the spec's explicit strategy", result.stdout)

    def test_collectives_flag(self):
        self.expect_flag_error(self.spec(), ["--collectives", "mpi"], "--collectives", "mpi")
        self.expect_flag_error(self.spec(), ["--collectives", "nccl"], "--collectives",
                               "cuda")

    def test_usage_error_exits_2(self):
        result = run("lathe-worker", "train", "--no-such-flag")
        self.assertEqual(result.returncode, 2)
        self.assertIn("--no-such-flag", result.stderr)


if __name__ == "__main__":
    unittest.main()
