#!/usr/bin/env python3
"""The README's first command, end to end: scripts/demo with this build's binaries
(LATHE_BIN_DIR), so that a change to flags, the CLI's output or the daemons that breaks the
quick start fails CI. Checks that it exits 0, that the job succeeded with its progress and
MFU shown, that the adapter is where it says, and that the adapter lowers the eval loss; and
that --prometheus starts a Prometheus on the demo's daemons and --profile captures 3 steps of
the running job and fetches a trace that Perfetto opens."""
import gzip
import json
import os
import re
import shutil
import subprocess
import tempfile
import unittest

SOURCE = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


class DemoTest(unittest.TestCase):
    def test_demo_trains_an_adapter_through_the_services(self):
        work = tempfile.mkdtemp(prefix="lathe-demo-e2e-")
        try:
            result = subprocess.run([os.path.join(SOURCE, "scripts", "demo"), work],
                                    capture_output=True, text=True, timeout=300)
            out = result.stdout
            self.assertEqual(result.returncode, 0, out[-3000:] + result.stderr[-3000:])
            self.assertIn("SUCCEEDED", out)
            # `lathe plan` through the coordinator: the chosen strategy and the alternatives.
            self.assertRegex(out, r"plan +1 rank on cpu, ZeRO-0")
            self.assertRegex(out, r"considered +ZERO +OFFLOAD .*\n +0 .* chosen")
            self.assertRegex(out, r"progress +step 60/60 .*MFU \d+\.\d%")
            # What runs the step's products, chosen once by the trainer (oneDNN on the CPU).
            self.assertRegex(out, r"progress +step 60/60 .*  products onednn f32 \S+")
            # `lathe plan --history`: the job's predicted peak against its measured one.
            self.assertRegex(out, r"\ndemo-lora-\w+ +#1 +SUCCEEDED +\S+ \S+ +\S+ \S+ +\S+ \S+ +[-+]")
            self.assertIn("corrections later plans apply", out)
            adapter = os.path.join(work, "run", "adapter")
            for name in ("adapter_model.safetensors", "adapter_config.json"):
                self.assertTrue(os.path.isfile(os.path.join(adapter, name)), name)
            self.assertIn(f"The adapter is in {adapter}", out)
            self.assertRegex(out, r"== metrics \(Prometheus, docs/observability.md\) while the "
                                  r"demo runs: http://127\.0\.0\.1:\d+/metrics")
            losses = [float(x) for x in re.findall(r"^loss (\d+\.\d+) over", out, re.M)]
            self.assertEqual(len(losses), 2, out[-2000:])
            base, tuned = losses
            self.assertLess(tuned, base - 0.1)
        finally:
            if os.environ.get("LATHE_KEEP_E2E") is None:
                shutil.rmtree(work, ignore_errors=True)

    def test_demo_with_prometheus_and_profile(self):
        """--prometheus: a Prometheus scraping the demo's daemons, with the alert rules;
        --profile: `lathe profile` on the running job, and the capture fetched."""
        work = tempfile.mkdtemp(prefix="lathe-demo-e2e-")
        try:
            result = subprocess.run([os.path.join(SOURCE, "scripts", "demo"), "--prometheus",
                                     "--profile", work], input="\n", capture_output=True,
                                    text=True, timeout=300)
            out = result.stdout
            self.assertEqual(result.returncode, 0, out[-3000:] + result.stderr[-3000:])
            self.assertIn("SUCCEEDED", out)
            self.assertRegex(out, r"== prometheus on http://127\.0\.0\.1:\d+")
            with open(os.path.join(work, "prometheus.log")) as f:
                log = f.read()
            self.assertIn("Server is ready to receive web requests", log)
            self.assertIn("Completed loading of configuration file", log)

            self.assertRegex(out, r"capture prof-1 of job demo-lora-\w+")
            self.assertRegex(out, r"prof-1 DONE +attempt #1 +rank 0 +3 steps \+ memory")
            trace = os.path.join(work, "profile", "prof-1", "rank-0", "rank-0.trace.json.gz")
            self.assertIn(f"Open {trace} in https://ui.perfetto.dev", out)
            with gzip.open(trace, "rt") as f:
                events = json.load(f)["traceEvents"]
            self.assertIn("lathe rank 0", {e["args"]["name"] for e in events
                                           if e.get("name") == "process_name"})
            self.assertIn("forward/block.3", {e.get("name") for e in events})
            with gzip.open(os.path.join(os.path.dirname(trace), "rank-0.memory.json.gz"),
                           "rt") as f:
                self.assertGreater(json.load(f)["peak"]["bytes"], 0)
        finally:
            if os.environ.get("LATHE_KEEP_E2E") is None:
                shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    unittest.main()
