#!/usr/bin/env python3
"""End to end over TLS: a coordinator serving TLS with mutual TLS for workers, two agents with
certificates of their own, a two-rank job whose trainers meet through the coordinator's
rendezvous over TLS, and the connections that must be refused. The certificates are made
here with openssl."""
import json
import os
import subprocess
import threading
import time
import unittest

from services_test import ClusterTest, run


def openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_certificates(directory):
    """A CA, a server certificate for 127.0.0.1, a worker certificate, and a rogue CA's
    worker certificate; returns their paths by name."""
    def ca(name):
        openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                "-subj", f"/CN={name}", "-keyout", f"{name}.key", "-out", f"{name}.pem",
                cwd=directory)

    def leaf(name, issuer, extensions):
        with open(os.path.join(directory, f"{name}.ext"), "w") as f:
            f.write(extensions)
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
                "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=directory)
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{issuer}.pem",
                "-CAkey", f"{issuer}.key", "-CAcreateserial", "-days", "2",
                "-extfile", f"{name}.ext", "-out", f"{name}.pem", cwd=directory)

    ca("lathe-ca")
    ca("rogue-ca")
    leaf("server", "lathe-ca", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    leaf("worker", "lathe-ca", "extendedKeyUsage=clientAuth\n")
    leaf("rogue", "rogue-ca", "extendedKeyUsage=clientAuth\n")
    return {name: os.path.join(directory, name) for name in
            ("lathe-ca", "rogue-ca", "server", "worker", "rogue")}


class TlsTest(ClusterTest):
    PREFIX = "lathe-tls-"

    @classmethod
    def configure(cls, cluster):
        c = cls.certs = make_certificates(cls.root)
        cluster.coordinator_args = ["--tls-cert", c["server"] + ".pem",
                                    "--tls-key", c["server"] + ".key",
                                    "--tls-client-ca", c["lathe-ca"] + ".pem"]
        cluster.worker_args = ["--tls-ca", c["lathe-ca"] + ".pem",
                               "--tls-cert", c["worker"] + ".pem",
                               "--tls-key", c["worker"] + ".key"]
        cluster.cli_args = ["--tls-ca", c["lathe-ca"] + ".pem"]

    def test_a_two_rank_job_runs_over_tls(self):
        spec = self.spec("over-tls", steps=3, ranks=2)
        submitted = self.cluster.lathe("submit", spec)
        self.assertEqual(submitted.returncode, 0, submitted.stderr)
        job_id = submitted.stdout.strip()
        watch = self.cluster.lathe("watch", job_id)
        self.assertEqual(watch.returncode, 0, watch.stdout + watch.stderr)
        job = json.loads(self.cluster.lathe("--output", "json", "status", job_id).stdout)
        self.assertEqual({p["worker_id"] for p in job["attempts"][-1]["placements"]},
                         {"w1", "w2"})

    def test_connections_without_the_right_certificates_are_refused(self):
        c, address = self.certs, self.cluster.address
        token = ["--token-file", self.cluster.tokens["client"]]
        # Plaintext to a TLS port, and TLS that does not trust the server's CA.
        for tls in ([], ["--tls-ca", c["rogue-ca"] + ".pem"]):
            listed = run("lathe", "--coordinator", address, *token, *tls, "list", timeout=60)
            self.assertEqual(listed.returncode, 1, listed.stdout)
            self.assertIn("cannot reach the coordinator", listed.stderr)
        # A worker without a client certificate gets through TLS but not to RegisterWorker;
        # one whose certificate another CA signed does not get through the handshake.
        worker_token = ["--token-file", self.cluster.tokens["worker"]]
        for name, tls, expected in (
                ("no-cert", ["--tls-ca", c["lathe-ca"] + ".pem"],
                 "needs a client certificate signed by the coordinator's --tls-client-ca"),
                ("rogue", ["--tls-ca", c["lathe-ca"] + ".pem", "--tls-cert",
                           c["rogue"] + ".pem", "--tls-key", c["rogue"] + ".key"],
                 "registering with the coordinator failed: UNAVAILABLE")):
            agent = subprocess.Popen(
                [os.path.join(os.environ.get("LATHE_BIN_DIR", ""), "lathe-worker"), "agent",
                 "--coordinator", address, "--worker-id", name, *worker_token, *tls,
                 "--work-dir", os.path.join(self.root, name)],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            lines = []
            reader = threading.Thread(target=lambda: lines.extend(agent.stdout))
            reader.start()
            deadline = time.time() + 30
            while not any(expected in line for line in lines) and time.time() < deadline:
                time.sleep(0.1)
            agent.terminate()
            agent.wait(timeout=30)
            reader.join()
            output = "".join(lines)
            self.assertIn(expected, output)
            self.assertNotIn(f"worker={name} registered", output)
        workers = json.loads(self.cluster.lathe("--output", "json", "workers").stdout)
        self.assertEqual(sorted(w["worker_id"] for w in workers), ["w1", "w2"])
        # Bad TLS flags are one-line usage errors.
        missing = run("lathe", "--coordinator", address, *token, "--tls-ca",
                      os.path.join(self.root, "nope.pem"), "list")
        self.assertEqual(missing.returncode, 2)
        self.assertIn("--tls-ca", missing.stderr)
        self.assertIn("nope.pem", missing.stderr)
        half = run("lathe-coordinator", "--insecure-no-auth", "--db", ":memory:",
                   "--listen", "127.0.0.1:0", "--tls-cert", c["server"] + ".pem")
        self.assertEqual(half.returncode, 1)
        self.assertIn("--tls-cert needs --tls-key", half.stderr)


if __name__ == "__main__":
    unittest.main()
