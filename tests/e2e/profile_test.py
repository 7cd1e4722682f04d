#!/usr/bin/env python3
"""End to end, `lathe profile` (issue #33): a coordinator and two agents as real processes on
127.0.0.1, whose trainer is a stand-in script that does what the trainer's side of the
hand-off does (proto/lathe/v1/trainer.proto: it reads <rank dir>/profile/request.json, writes
the capture's files in <rank dir>/profile/<capture>/ and answers with a "profile" event). A
two-rank job is profiled on both ranks through the CLI, the capture is listed by `lathe
status` and fetched with `lathe profile --fetch`; a capture the trainers never answer fails
when the job is cancelled. Then the same with the real trainer (`lathe-worker train`): what a
user fetches opens in Perfetto (Chrome trace JSON, one process per rank, the engine's scopes)
and holds the memory timeline."""
import gzip
import json
import os
import stat
import time
import unittest

from services_test import TIMEOUT, ClusterTest

# Steps every 0.1 s until stopped; answers a profile request at its next step, unless it asks
# for 20 steps (a trainer that never answers).
FAKE_TRAINER = r"""#!/bin/sh
task=""
while [ $# -gt 0 ]; do
  case "$1" in --task) task="$2"; shift;; esac
  shift
done
run=$(dirname "$task")
rank=${run##*-r}
echo '{"start": {"total_steps": 100000}}'
step=0
while :; do
  step=$((step + 1))
  echo "{\"step\": {\"progress\": {\"step\": $step, \"total_steps\": 100000, \"loss\": 2.5}, \"tokens\": 64, \"seconds\": 0.1}}"
  request="$run/profile/request.json"
  if [ -f "$request" ] && ! grep -q '"steps": *"20"' "$request"; then
    id=$(sed -n 's/.*"capture_id": *"\([^"]*\)".*/\1/p' "$request")
    mkdir -p "$run/profile/$id"
    printf 'trace of %s on rank %s' "$id" "$rank" > "$run/profile/$id/trace.json"
    rm -f "$request"
    echo "{\"profile\": {\"capture_id\": \"$id\", \"first_step\": $((step + 1)), \"last_step\": $((step + 3)), \"files\": [\"$run/profile/$id/trace.json\"]}}"
  fi
  sleep 0.1
done
"""


class ProfileTest(ClusterTest):
    PREFIX = "lathe-e2e-profile-"

    @classmethod
    def configure(cls, cluster):
        trainer = os.path.join(cluster.root, "fake-trainer.sh")
        with open(trainer, "w") as f:
            f.write(FAKE_TRAINER)
        os.chmod(trainer, stat.S_IRWXU)
        cluster.worker_args += ["--trainer-binary", trainer]

    def capture(self, job_id, index):
        return self.status(job_id)["attempts"][-1]["profiles"][index]

    def wait_capture(self, job_id, index, state):
        deadline = time.time() + TIMEOUT
        while True:
            capture = self.capture(job_id, index)
            if capture["state"] == state:
                return capture
            self.assertLess(time.time(), deadline, capture)
            time.sleep(0.2)

    def test_a_capture_of_both_ranks_is_kept_listed_and_fetched(self):
        job_id = self.submit("profiled", steps=100000, ranks=2)
        self.wait_running(job_id)
        result = self.cluster.lathe("profile", job_id, "--all-ranks", "--steps", "3")
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("capture prof-1 of job", result.stdout)

        capture = self.wait_capture(job_id, 0, "done")
        self.assertEqual(capture["ranks"], [0, 1])
        # The agent sends each file gzip-compressed, as <name>.gz.
        self.assertEqual(sorted((f["rank"], f["name"]) for f in capture["files"]),
                         [(0, "trace.json.gz"), (1, "trace.json.gz")])
        self.assertEqual(capture["requested_by"], "e2e-client (client)")
        text = self.cluster.lathe("status", job_id)
        self.assertIn("prof-1 DONE  attempt #1  ranks 0,1  3 steps", text.stdout)
        stored = os.path.join(self.root, "lathe.db.logs", job_id, "attempt-1", "profile",
                              "prof-1", "rank-1", "trace.json.gz")
        self.assertTrue(os.path.isfile(stored), stored)

        out = os.path.join(self.root, "fetched")
        result = self.cluster.lathe("profile", "--fetch", job_id, out)
        self.assertEqual(result.returncode, 0, result.stderr)
        for rank in (0, 1):
            path = os.path.join(out, "prof-1", f"rank-{rank}", "trace.json.gz")
            with gzip.open(path, "rt") as f:
                self.assertEqual(f.read(), f"trace of prof-1 on rank {rank}")
            sizes = {f["rank"]: f["size"] for f in capture["files"]}
            self.assertEqual(os.path.getsize(path), sizes[rank])
        again = self.cluster.lathe("profile", "--fetch", job_id, out)
        self.assertEqual(again.returncode, 1)
        self.assertIn("exists; not overwritten", again.stderr)

        refused = self.cluster.lathe("profile", job_id, "--rank", "5")
        self.assertEqual(refused.returncode, 1)
        self.assertEqual(refused.stderr.strip(),
                         f"lathe: rank: attempt 1 of job {job_id} has ranks 0 to 1, not 5")
        # A worker's token may not ask for one.
        as_worker = self.cluster.lathe("profile", job_id, role="worker")
        self.assertEqual(as_worker.returncode, 1)

        # A capture the trainers never answer fails with its attempt, not pending forever.
        result = self.cluster.lathe("profile", job_id, "--steps", "20")
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual(self.capture(job_id, 1)["state"], "pending")
        busy = self.cluster.lathe("profile", job_id)
        self.assertEqual(busy.returncode, 1)
        self.assertIn("capture prof-2 is still pending", busy.stderr)
        self.assertEqual(self.cluster.lathe("cancel", job_id).returncode, 0)
        self.cluster.lathe("watch", job_id)
        failed = self.capture(job_id, 1)
        self.assertEqual(failed["state"], "failed", failed)
        self.assertIn("attempt 1 ended (cancelled) before every rank answered", failed["error"])
        late = self.cluster.lathe("profile", job_id)
        self.assertEqual(late.returncode, 1)
        self.assertIn("is cancelled, not running", late.stderr)



class RealTrainerProfileTest(ClusterTest):
    """The real trainer's capture, fetched as a user would (docs/observability.md)."""
    PREFIX = "lathe-e2e-profile-real-"

    def test_a_running_jobs_capture_opens_in_perfetto(self):
        job_id = self.submit("traced", steps=100000, ranks=2)
        self.addCleanup(lambda: (self.cluster.lathe("cancel", job_id),
                                 self.cluster.lathe("watch", job_id)))
        self.wait_running(job_id)
        result = self.cluster.lathe("profile", job_id, "--all-ranks", "--steps", "2", "--memory")
        self.assertEqual(result.returncode, 0, result.stderr)
        deadline = time.time() + TIMEOUT
        while True:
            capture = self.status(job_id)["attempts"][-1]["profiles"][0]
            if capture["state"] != "pending":
                break
            self.assertLess(time.time(), deadline, capture)
            time.sleep(0.2)
        self.assertEqual(capture["state"], "done", capture)
        self.assertEqual(sorted((f["rank"], f["name"]) for f in capture["files"]),
                         [(0, "rank-0.memory.json.gz"), (0, "rank-0.trace.json.gz"),
                          (1, "rank-1.memory.json.gz"), (1, "rank-1.trace.json.gz")])
        for result in capture["results"]:
            self.assertEqual(result["last_step"] - result["first_step"], 1, result)
            self.assertEqual(result["error"], "", result)

        out = os.path.join(self.root, "fetched")
        fetched = self.cluster.lathe("profile", "--fetch", job_id, out)
        self.assertEqual(fetched.returncode, 0, fetched.stderr)
        for rank in (0, 1):
            directory = os.path.join(out, "prof-1", f"rank-{rank}")
            # Perfetto opens the .json.gz as it is.
            with gzip.open(os.path.join(directory, f"rank-{rank}.trace.json.gz"), "rt") as f:
                events = json.load(f)["traceEvents"]
            processes = {e["args"]["name"] for e in events
                         if e.get("ph") == "M" and e.get("name") == "process_name"}
            self.assertIn(f"lathe rank {rank}", processes)
            names = {e.get("name", "") for e in events if e.get("ph") == "X"}
            for scope in ("data/batch", "forward", "forward/block.0", "loss", "backward",
                          "optimizer"):
                self.assertIn(scope, names, f"rank {rank}")
            self.assertTrue(any(n.startswith("step.") for n in names), f"rank {rank}")
            self.assertTrue(any(n.startswith("comm/") for n in names), f"rank {rank}")
            with gzip.open(os.path.join(directory, f"rank-{rank}.memory.json.gz"), "rt") as f:
                memory = json.load(f)
            self.assertEqual(memory["rank"], rank)
            self.assertGreater(len(memory["events"]), 0)
            self.assertEqual(memory["peak"]["bytes"],
                             max(s["peak_bytes"] for s in memory["steps"]))
            self.assertLessEqual(len(memory["peak"]["top_blocks"]), 10)


if __name__ == "__main__":
    unittest.main(verbosity=2)
