#!/usr/bin/env python3
"""The coordinator's gRPC port under a low limit on open files (issue #27, item 8). gRPC's
own listener stopped accepting for good after one `accept4: Too many open files`: under
`ulimit -n 256`, 400 idle TCP connections to the port left `lathe list` timing out after
they had closed, while /readyz went on saying ready.

- Soft and hard limit 256 (raising cannot help): 400 idle TCP connections are opened to the
  gRPC port. While they are open the port refuses new connections (they hold the 128
  descriptors it may use), and /readyz must say so (503 naming the refusals). Once they are
  closed, `lathe list` must work again within a few seconds, and no /readyz may have said
  ready while `lathe list` failed. On the old code `lathe list` never works again and
  /readyz says ready throughout.
- Soft limit 256 under a hard limit of 4,096: the coordinator raises its soft limit to the
  hard one (its /proc/<pid>/limits and its log line say so), and then serves `lathe list`
  while 400 idle connections are open.

The coordinator runs as a real process with tokens, its limits set before it execs; the
CLI is called as a user would."""
import json
import os
import re
import resource
import shutil
import socket
import tempfile
import time
import unittest
import urllib.error
import urllib.request

from services_test import Cluster, free_port, write_tokens

IDLE_CONNECTIONS = 400
RECOVERY = 10  # seconds after the idle connections closed in which `lathe list` must work


def readyz(port):
    """(status code, body) of the coordinator's /readyz; (None, why) when it did not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()
    except OSError as error:
        return None, repr(error)


class FdLimitTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        # This process holds the idle connections.
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = 4 * IDLE_CONNECTIONS
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE,
                               (want if hard == resource.RLIM_INFINITY else min(want, hard),
                                hard))

    def setUp(self):
        self.root = tempfile.mkdtemp(prefix="lathe-fd-limit-")
        self.cluster = None
        self.sockets = []

    def tearDown(self):
        self.close_idle()
        if self.cluster is not None:
            self.cluster.stop()
        if os.environ.get("LATHE_KEEP_E2E") is None:
            shutil.rmtree(self.root, ignore_errors=True)

    def start(self, soft, hard):
        """A coordinator whose limit on open files is (soft, hard) when it starts."""
        self.cluster = Cluster(self.root, write_tokens(self.root))
        self.metrics_port = free_port()
        self.cluster.coordinator_args += ["--metrics-listen", f"127.0.0.1:{self.metrics_port}"]
        self.cluster.coordinator_preexec = lambda: resource.setrlimit(resource.RLIMIT_NOFILE,
                                                                      (soft, hard))
        self.cluster.start_coordinator()

    def log_line(self, pattern):
        """The stopped coordinator's first log line matching `pattern` (its log reaches the
        file when its output ends, through a thread: waits for it a little)."""
        self.cluster.stop_coordinator()
        path = os.path.join(self.root, "coordinator.log")
        for _ in range(50):
            with open(path) as f:
                for line in f:
                    if re.search(pattern, line):
                        return line
            time.sleep(0.1)
        with open(path) as f:
            self.fail(f"no line matching {pattern!r} in the coordinator's log:\n{f.read()}")

    def open_limit(self):
        with open(f"/proc/{self.cluster.coordinator.pid}/limits") as f:
            line = next(line for line in f if line.startswith("Max open files"))
        return [int(n) for n in line.split()[3:5]]

    def open_idle(self):
        """IDLE_CONNECTIONS TCP connections to the gRPC port that send nothing."""
        for _ in range(IDLE_CONNECTIONS):
            s = socket.socket()
            self.sockets.append(s)
            s.connect(("127.0.0.1", self.cluster.port))

    def close_idle(self):
        for s in self.sockets:
            s.close()
        self.sockets = []

    def lathe_list(self):
        result = self.cluster.lathe("--output", "json", "list", timeout=60)
        return result.returncode, result.stderr.strip()

    def test_a_port_out_of_descriptors_refuses_says_so_and_serves_again(self):
        self.start(256, 256)
        self.assertEqual(self.open_limit(), [256, 256])
        self.assertEqual(self.lathe_list(), (0, ""))

        self.open_idle()
        # They take every descriptor the port may use: /readyz must come to say that the port
        # does not serve (its answer is kept for up to 2 s), well before the coordinator
        # closes them for not finishing their handshake (10 s).
        seen = []
        deadline = time.time() + 6
        while time.time() < deadline:
            seen.append(readyz(self.metrics_port))
            if seen[-1][0] == 503:
                break
            time.sleep(0.2)
        self.assertEqual(seen[-1][0], 503, seen)
        self.assertRegex(seen[-1][1], r"gRPC port .* does not serve: .*refuses connections: the "
                                      r"process is near its limit of 256 open files")
        self.close_idle()

        # Each look: /readyz, then `lathe list`. A port that has stopped accepting must not
        # be called ready.
        closed = time.time()
        looks = []
        while True:
            code, body = readyz(self.metrics_port)
            started = time.time()
            returncode, error = self.lathe_list()
            looks.append({"after_s": round(started - closed, 2), "readyz": code,
                          "reason": body.strip(), "list": returncode, "error": error})
            if returncode != 0:
                self.assertNotEqual(code, 200, f"/readyz said ready, `lathe list` failed: "
                                               f"{json.dumps(looks, indent=1)}")
            elif code == 200:
                break
            self.assertLess(time.time() - closed, RECOVERY,
                            f"the port did not serve again: {json.dumps(looks, indent=1)}")
            time.sleep(0.5)
        self.assertLess(looks[-1]["after_s"], RECOVERY, looks)
        self.assertIsNone(self.cluster.coordinator.poll())
        print(f"\n  /readyz during the idle connections: {seen[-1]}"
              f"\n  after they closed (seconds, /readyz, lathe list): "
              f"{[(look['after_s'], look['readyz'], look['list']) for look in looks]}")
        self.log_line(r"\[warning\] open files: limit 256 \(hard limit 256\): 128 for gRPC "
                      r"connections, .*raise the hard limit")
        self.log_line(r"\[warning\] gRPC port: refused \d+ connection")

    def test_b_the_soft_limit_is_raised_to_the_hard_one(self):
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        hard = 4096 if hard == resource.RLIM_INFINITY else min(hard, 4096)
        if hard <= 256:
            self.skipTest(f"this process's hard limit on open files is {hard}")
        self.start(256, hard)
        self.assertEqual(self.open_limit(), [hard, hard])
        self.open_idle()
        self.assertEqual(self.lathe_list(), (0, ""))
        self.assertEqual(readyz(self.metrics_port), (200, "ready\n"))
        self.log_line(rf"\[info\] open files: limit {hard} \(raised from 256; hard limit {hard}\)")


if __name__ == "__main__":
    unittest.main()
