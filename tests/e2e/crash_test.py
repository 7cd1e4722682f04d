#!/usr/bin/env python3
"""The coordinator killed with SIGKILL at random moments, ten times, during a burst of 200
submissions: every acknowledged job is there after the restarts (none lost), none twice
(the CLI retries with the same request id), and the jobs that were running carry on in
their first attempt (their agents register again and report what they run)."""
import json
import random
import threading
import time
import unittest

from services_test import TIMEOUT, ClusterTest

SUBMISSIONS = 200
KILLS = 10


class CrashTest(ClusterTest):
    PREFIX = "lathe-crash-"

    def jobs(self):
        listed = self.cluster.lathe("--output", "json", "list")
        self.assertEqual(listed.returncode, 0, listed.stderr)
        return json.loads(listed.stdout)

    def status(self, job_id):
        shown = self.cluster.lathe("--output", "json", "status", job_id)
        self.assertEqual(shown.returncode, 0, shown.stderr)
        return json.loads(shown.stdout)

    def test_kill_9_during_a_burst_of_submissions(self):
        # Two long jobs, one on each worker, running before the first kill.
        running = []
        for name in ("long-a", "long-b"):
            submitted = self.cluster.lathe("submit", self.spec(name, steps=10**6))
            self.assertEqual(submitted.returncode, 0, submitted.stderr)
            running.append(submitted.stdout.strip())
        deadline = time.time() + TIMEOUT
        while not all((self.status(j)["progress"] or {}).get("step", 0) >= 1 for j in running):
            self.assertLess(time.time(), deadline, "the long jobs did not start")
            time.sleep(0.2)

        specs = [self.spec(f"burst-{i}", steps=5) for i in range(SUBMISSIONS)]
        acknowledged = {}  # i -> job id
        tries = [0]

        def submit_all():
            for i, spec in enumerate(specs):
                while True:  # until acknowledged, always with the same request id
                    tries[0] += 1
                    result = self.cluster.lathe("submit", spec, "--request-id", f"burst-{i}",
                                                timeout=60)
                    if result.returncode == 0:
                        acknowledged[i] = result.stdout.strip()
                        break
                    time.sleep(0.05)

        submitter = threading.Thread(target=submit_all)
        submitter.start()
        rng = random.Random(9)
        for _ in range(KILLS):
            time.sleep(rng.uniform(0.2, 1.5))
            self.cluster.coordinator.kill()  # SIGKILL
            self.cluster.coordinator.wait()
            self.cluster.start_coordinator()
        submitter.join(timeout=10 * TIMEOUT)
        self.assertFalse(submitter.is_alive())
        self.assertEqual(len(acknowledged), SUBMISSIONS)
        self.assertGreater(tries[0], SUBMISSIONS, "no submission was ever interrupted")

        jobs = self.jobs()
        by_name = {}
        for job in jobs:
            by_name.setdefault(job["name"], []).append(job["job_id"])
        for i, job_id in acknowledged.items():
            self.assertEqual(by_name.get(f"burst-{i}"), [job_id], f"burst-{i}")
        self.assertEqual(len(jobs), SUBMISSIONS + len(running))

        # The agents come back and the long jobs go on in their first attempt.
        for job_id in running:
            before = self.status(job_id)
            deadline = time.time() + TIMEOUT
            while True:
                job = self.status(job_id)
                self.assertEqual(job["state"], "running", job["reason"])
                self.assertEqual(len(job["attempts"]), 1, job["attempts"])
                if job["progress"]["step"] > before["progress"]["step"] + 5:
                    break
                self.assertLess(time.time(), deadline, "no progress after the restarts")
                time.sleep(0.2)


if __name__ == "__main__":
    unittest.main()
