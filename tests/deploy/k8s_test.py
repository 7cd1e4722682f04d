#!/usr/bin/env python3
"""deploy/k8s (issue #14): every manifest validates against the Kubernetes OpenAPI schemas
(kubernetes-models, offline; deploy/k8s/validate), and the manifests run as they are: the
coordinator's and a worker's exact commands, arguments and environment started as local
processes on 127.0.0.1, with their volumes made of local directories (the Secret's and the
ConfigMap's keys written as files), their ports mapped to free local ones and the Service
names to those, and a job run through them. The one change: the worker runs `--device cpu`
(this machine has no GPU). So the manifests and the binaries' flags cannot drift apart."""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import unittest
import urllib.request

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.environ.get("LATHE_BIN_DIR", os.path.join(ROOT, "build", "bin"))
K8S = os.path.join(ROOT, "deploy", "k8s")
IMAGES = {"lathe-coordinator": "lathe-coordinator", "lathe-worker": "lathe-worker"}
TIMEOUT = 120


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def objects():
    """Every object of the kustomization's resources, by (kind, name)."""
    with open(os.path.join(K8S, "kustomization.yaml")) as f:
        resources = yaml.safe_load(f)["resources"]
    found = {}
    for resource in resources:
        with open(os.path.join(K8S, resource)) as f:
            for doc in yaml.safe_load_all(f):
                if doc:
                    found[(doc["kind"], doc["metadata"]["name"])] = doc
    return found


class Pod:
    """One container of a pod template, run as a local process."""

    def __init__(self, template, objects, root, name, services, command_for_image):
        spec = template["spec"]
        self.container = spec["containers"][0]
        self.name = name
        self.ports = {p["name"]: free_port() for p in self.container.get("ports", [])}
        # Volumes: local directories, Secrets and ConfigMaps written out as files.
        mounts = {}
        for volume in spec.get("volumes", []):
            path = os.path.join(root, name, volume["name"])
            os.makedirs(path, exist_ok=True)
            if "secret" in volume or "configMap" in volume:
                source = volume.get("secret") or volume["configMap"]
                kind = "Secret" if "secret" in volume else "ConfigMap"
                key_name = source.get("secretName") or source.get("name")
                data = objects[(kind, key_name)].get("stringData") or \
                    objects[(kind, key_name)].get("data")
                for item in source.get("items") or [{"key": k, "path": k} for k in data]:
                    with open(os.path.join(path, item["path"]), "w") as f:
                        f.write(data[item["key"]])
            elif "persistentVolumeClaim" in volume:
                claim = os.path.join(root, "pvc", volume["persistentVolumeClaim"]["claimName"])
                os.makedirs(claim, exist_ok=True)
                os.rmdir(path)
                os.symlink(claim, path)
            mounts[volume["name"]] = path
        self.paths = {m["mountPath"]: mounts[m["name"]] for m in self.container["volumeMounts"]}
        env = {}
        for variable in self.container.get("env", []):
            field = variable["valueFrom"]["fieldRef"]["fieldPath"]
            assert field == "metadata.name", field
            env[variable["name"]] = name
        self.args = [self.local(arg, env, services) for arg in self.container["args"]]
        self.command = command_for_image(self.container["image"].split(":")[0])
        self.process = None

    def local(self, arg, env, services):
        """The argument on this machine: $(VAR)s expanded, mount paths to their directories,
        bind addresses to 127.0.0.1 on this pod's ports, Service addresses to theirs."""
        arg = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg)
        for mount in sorted(self.paths, key=len, reverse=True):
            arg = arg.replace(f"={mount}/", f"={self.paths[mount]}/").replace(
                f"={mount}", f"={self.paths[mount]}")
        for port in self.container.get("ports", []):
            arg = arg.replace(f"0.0.0.0:{port['containerPort']}",
                              f"127.0.0.1:{self.ports[port['name']]}")
        for service, address in services.items():
            arg = arg.replace(f"={service}", f"={address}")
        return arg

    def start(self, log):
        self.process = subprocess.Popen(self.command + self.args, stdout=log,
                                        stderr=subprocess.STDOUT, start_new_session=True)

    def probe(self, probe):
        """The probe's HTTP status code."""
        get = self.container[probe]["httpGet"]
        url = f"http://127.0.0.1:{self.ports[get['port']]}{get['path']}"
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return response.status
        except urllib.error.HTTPError as error:
            return error.code
        except OSError:
            return None

    def stop(self):
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


class K8sManifestsTest(unittest.TestCase):
    def test_manifests_validate_against_the_kubernetes_schemas(self):
        validator = os.path.join(K8S, "validate")
        self.assertTrue(os.path.isdir(os.path.join(validator, "node_modules")),
                        "run scripts/install-deps (npm ci in deploy/k8s/validate)")
        result = subprocess.run(["node", os.path.join(validator, "validate.mjs"), K8S],
                                capture_output=True, text=True)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        self.assertEqual(result.stdout.count(": valid\n"), 10, result.stdout)

    def test_the_manifests_commands_run_a_job(self):
        found = objects()
        root = tempfile.mkdtemp(prefix="lathe-k8s-")
        pods = []
        try:
            def command_for_image(image):
                # What each image runs (deploy/docker): its ENTRYPOINT with this build.
                return {"lathe-coordinator": [os.path.join(BIN, "lathe-coordinator")],
                        "lathe-worker": [os.path.join(BIN, "lathe-worker"), "agent"]}[image]

            coordinator = Pod(found[("Deployment", "lathe-coordinator")]["spec"]["template"],
                              found, root, "lathe-coordinator-0", {}, command_for_image)
            service = found[("Service", "lathe-coordinator")]
            grpc_port = next(p for p in service["spec"]["ports"] if p["name"] == "grpc")
            address = f"127.0.0.1:{coordinator.ports[grpc_port['targetPort']]}"
            worker = Pod(found[("StatefulSet", "lathe-worker")]["spec"]["template"], found,
                         root, "lathe-worker-0",
                         {f"lathe-coordinator:{grpc_port['port']}": address}, command_for_image)
            self.assertIn("--device=cuda", worker.args)
            worker.args[worker.args.index("--device=cuda")] = "--device=cpu"  # no GPU here
            pods = [coordinator, worker]
            with open(os.path.join(root, "coordinator.log"), "w") as log:
                coordinator.start(log)
            with open(os.path.join(root, "worker.log"), "w") as log:
                worker.start(log)
            deadline = time.time() + TIMEOUT
            while not all(p.probe("readinessProbe") == 200 for p in pods):
                for p in pods:
                    self.assertIsNone(p.process.poll(), self.log(root, p))
                self.assertLess(time.time(), deadline, "not ready: " + self.log(root, worker))
                time.sleep(0.2)
            for p in pods:
                self.assertEqual(p.probe("livenessProbe"), 200)

            # A job under /data, submitted with the Secret's client token.
            data = coordinator.paths["/data"]
            run = lambda *args: subprocess.run(  # noqa: E731
                [os.path.join(BIN, args[0]), *args[1:]], capture_output=True, text=True,
                timeout=TIMEOUT)
            self.assertEqual(run("lathe-synth", "model", "--out", f"{data}/model",
                                 "--max-pos", "64").returncode, 0)
            self.assertEqual(run("lathe-synth", "data", "--out", f"{data}/train.jsonl",
                                 "--records", "16").returncode, 0)
            with open(f"{data}/job.yaml", "w") as f:
                f.write(f"""name: from-k8s
model: {{path: {data}/model}}
data: {{train: {data}/train.jsonl, seq_len: 32}}
lora: {{rank: 4, alpha: 8}}
train: {{steps: 4, global_batch: 2}}
resources: {{device: cpu}}
output: {data}/out
""")
            tokens = found[("Secret", "lathe-tokens")]["stringData"]["tokens"]
            client = next(line.split()[2] for line in tokens.splitlines()
                          if line.startswith("client "))
            lathe = ["lathe", "--coordinator", address, "--token", client]
            submitted = run(*lathe, "submit", f"{data}/job.yaml")
            self.assertEqual(submitted.returncode, 0, submitted.stderr)
            job = submitted.stdout.strip()
            watched = run(*lathe, "watch", job)
            self.assertEqual(watched.returncode, 0, watched.stdout + self.log(root, worker))
            status = json.loads(run(*lathe, "--output", "json", "status", job).stdout)
            self.assertEqual(status["state"], "succeeded")
            self.assertEqual(status["attempts"][0]["placements"][0]["worker_id"],
                             "lathe-worker-0")
        finally:
            for p in reversed(pods):
                p.stop()
            shutil.rmtree(root, ignore_errors=True)

    @staticmethod
    def log(root, pod):
        path = os.path.join(root, "coordinator.log" if "coordinator" in pod.name else
                            "worker.log")
        with open(path) as f:
            return f.read()[-3000:]


if __name__ == "__main__":
    unittest.main()
