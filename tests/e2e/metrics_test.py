#!/usr/bin/env python3
"""The daemons' /metrics under a real Prometheus (issue #14): a cluster whose coordinator
and worker agent serve --metrics-listen, Debian's `prometheus` scraping both every 0.5 s on
127.0.0.1, and a job run through it. The test reads the figures back through Prometheus'
HTTP query API: the running job's step and token counters (rising, never reset: what rate()
needs) and its memory by component, the same step and loss as `lathe status` once it ended,
the job counted as succeeded, each daemon's lathe_build_info; and `promtool check metrics`
passes on what the coordinator serves."""
import json
import os
import re
import shutil
import subprocess
import time
import unittest
import urllib.parse
import urllib.request

import grpc

from services_test import TIMEOUT, ClusterTest, free_port, stop_process

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STEPS = 2000  # of the watched job

COMPONENTS = {"weights", "trainable", "gradients", "optimizer", "activations", "logits",
              "comm_buffers", "overhead"}


def http_get(url):
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


class MetricsTest(ClusterTest):
    PREFIX, MAX_POS, RECORDS, WORKERS = "lathe-metrics-", 128, 64, ("w1",)

    @classmethod
    def configure(cls, cluster):
        # Distinct ports: free_port may hand out one again until a process binds it.
        ports = {cluster.port}
        while len(ports) < 4:
            ports.add(free_port())
        cls.metrics_port, cls.worker_metrics_port, cls.prometheus_port = sorted(
            ports - {cluster.port})
        cluster.coordinator_args += ["--metrics-listen", f"127.0.0.1:{cls.metrics_port}"]
        cluster.worker_args += ["--metrics-listen", f"127.0.0.1:{cls.worker_metrics_port}"]

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.prometheus = None
        prometheus = shutil.which("prometheus")
        if prometheus is None:
            cls.tearDownClass()
            raise AssertionError("no prometheus binary: scripts/install-deps installs it")
        config = os.path.join(cls.root, "prometheus.yml")
        with open(config, "w") as f:
            f.write(f"""global: {{scrape_interval: 500ms, scrape_timeout: 400ms}}
scrape_configs:
  - job_name: lathe-coordinator
    static_configs: [{{targets: ["127.0.0.1:{cls.metrics_port}"]}}]
  - job_name: lathe-worker
    static_configs: [{{targets: ["127.0.0.1:{cls.worker_metrics_port}"]}}]
""")
        cls.prometheus_log = open(os.path.join(cls.root, "prometheus.log"), "w")
        cls.prometheus = subprocess.Popen(
            [prometheus, f"--config.file={config}",
             f"--storage.tsdb.path={os.path.join(cls.root, 'tsdb')}",
             f"--web.listen-address=127.0.0.1:{cls.prometheus_port}"],
            stdout=cls.prometheus_log, stderr=subprocess.STDOUT)

    @classmethod
    def tearDownClass(cls):
        if getattr(cls, "prometheus", None) is not None:
            stop_process(cls.prometheus, timeout=20)
            cls.prometheus_log.close()
        super().tearDownClass()

    def query(self, promql):
        """The instant vector of `promql` as {frozenset(labels): value}."""
        url = (f"http://127.0.0.1:{self.prometheus_port}/api/v1/query?" +
               urllib.parse.urlencode({"query": promql}))
        answer = json.loads(http_get(url))
        self.assertEqual(answer["status"], "success", answer)
        return {frozenset(r["metric"].items()): float(r["value"][1])
                for r in answer["data"]["result"]}

    def wait_query(self, promql, check, what):
        """Polls `promql` until check(result) holds; returns the result."""
        deadline = time.time() + TIMEOUT
        while True:
            try:
                result = self.query(promql)
            except OSError:  # Prometheus still starting
                result = None
            if result is not None and check(result):
                return result
            self.assertLess(time.time(), deadline, f"{what}: {promql} gave {result}")
            time.sleep(0.25)

    def range_values(self, counter, job):
        """Every scraped sample of `counter` for `job` in the last 10 minutes, oldest first."""
        url = (f"http://127.0.0.1:{self.prometheus_port}/api/v1/query?" +
               urllib.parse.urlencode({"query": f'{counter}{{job_id="{job}"}}[10m]'}))
        answer = json.loads(http_get(url))
        self.assertEqual(answer["status"], "success", answer)
        result = answer["data"]["result"]
        self.assertEqual(len(result), 1, result)
        return result[0]["values"]

    def status(self, job_id):
        shown = self.cluster.lathe("--output", "json", "status", job_id)
        self.assertEqual(shown.returncode, 0, shown.stderr)
        return json.loads(shown.stdout)

    def test_health_and_readiness(self):
        for port in (self.metrics_port, self.worker_metrics_port):  # the worker: registered
            base = f"http://127.0.0.1:{port}"
            self.assertEqual(http_get(f"{base}/healthz"), "ok\n")
            self.assertEqual(http_get(f"{base}/readyz"), "ready\n")
        # The standard grpc.health.v1 service, without a token: HealthCheckResponse
        # {status: SERVING} is the two bytes 08 01.
        with grpc.insecure_channel(self.cluster.address) as channel:
            check = channel.unary_unary("/grpc.health.v1.Health/Check")
            self.assertEqual(check(b"", timeout=10), b"\x08\x01")

    def logs(self, job, *flags, want=None):
        """`lathe logs JOB FLAGS`'s output; with `want`, polled until it holds that (a worker
        sends a rank's log about every second)."""
        deadline = time.time() + 20
        while True:
            shown = self.cluster.lathe("logs", job, *flags)
            self.assertEqual(shown.returncode, 0, shown.stderr)
            if want is None or want in shown.stdout:
                return shown.stdout
            self.assertLess(time.time(), deadline, f"no {want!r} in the log: {shown.stdout}")
            time.sleep(0.3)

    def test_logs_of_a_run_and_of_a_failure(self):
        # A run: its step lines, while it runs (--follow, until it ends) and after.
        submitted = self.cluster.lathe("submit", self.spec("logged", steps=30))
        self.assertEqual(submitted.returncode, 0, submitted.stderr)
        job = submitted.stdout.strip()
        followed = self.cluster.lathe("logs", job, "--follow", timeout=TIMEOUT)
        self.assertEqual(followed.returncode, 0, followed.stderr)
        self.assertIn("step    30/30", followed.stdout)
        self.assertIn("done: 30 steps", followed.stdout)
        self.assertEqual(self.logs(job, "--attempt", "1", "--rank", "0"), followed.stdout)

        # A failure: the reason has the log's last lines and says how to see all of it, with
        # no path on the worker's host.
        submitted = self.cluster.lathe("submit", self.spec("diverged", steps=5, lr="1.0e+308"))
        self.assertEqual(submitted.returncode, 0, submitted.stderr)
        failing = submitted.stdout.strip()
        self.assertEqual(self.cluster.lathe("watch", failing).returncode, 1)
        reason = self.status(failing)["reason"]
        self.assertIn("the run diverged", reason)
        self.assertIn(f"lathe logs {failing} --attempt 1 --rank 0", reason)
        self.assertNotIn(self.root, reason)
        self.assertIn("the run diverged", self.logs(failing, want="the run diverged"))

        # Bad requests name what is wrong.
        bad_rank = self.cluster.lathe("logs", job, "--rank", "3")
        self.assertEqual(bad_rank.returncode, 1)
        self.assertIn(f"rank: attempt 1 of job {job} has ranks 0 to 0, not 3", bad_rank.stderr)
        unknown = self.cluster.lathe("logs", "nope-123456")
        self.assertEqual(unknown.returncode, 1)
        self.assertIn("job nope-123456 not found", unknown.stderr)

    def test_prometheus_sees_the_job_run_and_succeed(self):
        # Long enough (about 5 ms a step here) for Prometheus to scrape its counters rising.
        submitted = self.cluster.lathe("submit", self.spec("watched", steps=STEPS))
        self.assertEqual(submitted.returncode, 0, submitted.stderr)
        job = submitted.stdout.strip()

        # While it runs: its counters rise (rate() above 0) and a memory series per component.
        self.wait_query(f'lathe_job_tokens_total{{job_id="{job}"}}',
                        lambda r: r and max(r.values()) > 0, "tokens of the running job")
        self.wait_query(f'rate(lathe_job_steps_total{{job_id="{job}"}}[1m])',
                        lambda r: r and max(r.values()) > 0, "steps/s of the running job")
        self.wait_query(f'rate(lathe_job_tokens_total{{job_id="{job}"}}[1m])',
                        lambda r: r and max(r.values()) > 0, "tokens/s of the running job")
        memory = self.wait_query(f'lathe_job_memory_peak_bytes{{job_id="{job}"}}',
                                 lambda r: len(r) == len(COMPONENTS), "memory by component")
        self.assertEqual({dict(labels)["component"] for labels in memory}, COMPONENTS)
        self.assertGreater(max(memory.values()), 0)
        predicted = self.query(f'lathe_job_memory_predicted_bytes{{job_id="{job}"}}')
        self.assertEqual(len(predicted), len(COMPONENTS))
        self.assertEqual(self.query('lathe_workers{state="ready"}'),
                         {frozenset({"__name__": "lathe_workers", "state": "ready",
                                     "instance": f"127.0.0.1:{self.metrics_port}",
                                     "job": "lathe-coordinator"}.items()): 1.0})

        # The worker's view of its rank: tokens/s and the step time histogram.
        self.wait_query(f'lathe_rank_tokens_per_second{{job_id="{job}",rank="0"}}',
                        lambda r: r and max(r.values()) > 0, "the rank's tokens/s")
        self.wait_query(f'lathe_rank_step_duration_seconds_count{{job_id="{job}"}}',
                        lambda r: r and max(r.values()) >= 1, "the rank's step times")

        # What both daemons serve passes promtool's checks.
        for port in (self.metrics_port, self.worker_metrics_port):
            text = http_get(f"http://127.0.0.1:{port}/metrics")
            checked = subprocess.run(["promtool", "check", "metrics"], input=text,
                                     capture_output=True, text=True)
            self.assertEqual(checked.returncode, 0, checked.stdout + checked.stderr)

        # Once it ended: counted as succeeded, and the same figures as `lathe status`.
        deadline = time.time() + TIMEOUT
        while self.status(job)["state"] != "succeeded":
            self.assertLess(time.time(), deadline, "the job did not succeed")
            time.sleep(0.2)
        progress = self.status(job)["progress"]
        # (The class's other tests run jobs too: counted at least once, this one by its id.)
        self.wait_query(f'lathe_job_info{{job_id="{job}",state="succeeded"}}',
                        lambda r: list(r.values()) == [1.0], "the job shown as succeeded")
        self.wait_query('lathe_jobs{state="succeeded"}', lambda r: min(r.values()) >= 1,
                        "the job counted as succeeded")
        self.wait_query('lathe_attempts_ended_total{result="succeeded"}',
                        lambda r: min(r.values()) >= 1, "its attempt counted as ended")
        step = self.wait_query(f'lathe_job_step{{job_id="{job}"}}',
                               lambda r: list(r.values()) == [progress["step"]], "the last step")
        self.assertEqual(list(step.values()), [float(STEPS)])
        loss = self.query(f'lathe_job_loss{{job_id="{job}"}}')
        self.assertAlmostEqual(list(loss.values())[0], progress["loss"], places=5)
        # The counters: every step counted once (one attempt, from step 0), never going down
        # between scrapes (no reset for rate() to mend), the tokens too.
        self.wait_query(f'lathe_job_steps_total{{job_id="{job}"}}',
                        lambda r: list(r.values()) == [float(STEPS)], "the steps counted")
        for counter in ("lathe_job_steps_total", "lathe_job_tokens_total"):
            values = [float(v) for _, v in self.range_values(counter, job)]  # every scrape
            self.assertGreater(len(values), 2, counter)
            self.assertEqual(values, sorted(values), f"{counter} went down")
            self.assertGreater(values[-1], 0, counter)
            resets = self.query(f'resets({counter}{{job_id="{job}"}}[10m])')
            self.assertEqual(list(resets.values()), [0.0], counter)
        self.assertEqual(self.query(f'lathe_job_tokens_per_second{{job_id="{job}"}}'), {},
                         "the gauge the counter replaced")
        # Both daemons say which build they are.
        builds = self.query("lathe_build_info")
        self.assertEqual(sorted(dict(labels)["daemon"] for labels in builds),
                         ["agent", "coordinator"])
        self.assertEqual(set(builds.values()), {1.0})
        self.assertEqual(len({dict(labels)["git_commit"] for labels in builds}), 1)
        # Every unary call the CLI made is timed, by method and code.
        calls = self.query('lathe_rpc_duration_seconds_count{method="SubmitJob",code="OK"}')
        self.assertGreaterEqual(list(calls.values())[0], 1.0)
        self.check_dashboard_and_alerts(job)

    def exported_names(self):
        """Every metric name the two daemons serve (a histogram's _bucket/_sum/_count too)."""
        names = set()
        for port in (self.metrics_port, self.worker_metrics_port):
            for line in http_get(f"http://127.0.0.1:{port}/metrics").splitlines():
                if line.startswith("# TYPE "):
                    _, _, name, kind = line.split()
                    names.add(name)
                    if kind == "histogram":
                        names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
        return names

    def check_dashboard_and_alerts(self, job):
        """Every PromQL expression of deploy/ names only metrics the binaries export, and
        Prometheus parses each of the dashboard's (with the job picked)."""
        exported = self.exported_names()
        with open(os.path.join(ROOT, "deploy", "grafana", "lathe.json")) as f:
            dashboard = json.load(f)
        exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
        self.assertGreater(len(exprs), 20)
        variables = [v["definition"] for v in dashboard["templating"]["list"]
                     if v.get("definition")]
        with open(os.path.join(ROOT, "deploy", "prometheus", "lathe-alerts.yml")) as f:
            rules = re.findall(r"expr: \|?\s*\n?((?:.+\n?)+?)(?=\s+(?:for|labels):)", f.read())
        self.assertEqual(len(rules), 5, rules)
        for text in exprs + variables + rules:
            for name in re.findall(r"\blathe_[a-z_]+", text):
                self.assertIn(name, exported, f"{name} in {text!r} is not exported")
        for expr in exprs:
            url = (f"http://127.0.0.1:{self.prometheus_port}/api/v1/query?" +
                   urllib.parse.urlencode({"query": expr.replace("$job_id", job)}))
            answer = json.loads(http_get(url))
            self.assertEqual(answer["status"], "success", (expr, answer))


if __name__ == "__main__":
    unittest.main()
