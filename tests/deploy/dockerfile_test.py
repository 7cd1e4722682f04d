#!/usr/bin/env python3
"""deploy/docker's Dockerfiles against this build (no container engine runs here): every
script they run exists, every target they build is a binary of this build, every binary they
copy is one of those, each runtime stage provides every library the copied binaries load
(a Debian package it installs, or a file of the worker's staged directory) and installs no
package they do not link, Debian has each package, and the entrypoint's flags are flags the
binary knows.

The worker image's build stage is deploy/docker/build-worker, whose last step stages the
image's files (its binaries, the venv's libraries at their paths) in a directory that the
runtime stage copies to /. WorkerImageTest runs that step on this build (--stage-only, hard
links: no second build) and checks the staged directory as the image would have it: the
loader's search (each object's NEEDED through its own RUNPATH, $ORIGIN and absolute paths
taken inside the staged directory, then the system's libraries) finds every library there or
in a Debian package the image installs; the staged lathe-worker runs (`agent --help`) with
every library it maps staged or Debian's; and the CUDA toolkit wheels the script installs
where a machine has no /usr/local/cuda are the versions torch's cuda-toolkit pins."""
import functools
import importlib.metadata
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.environ.get("LATHE_BIN_DIR", os.path.join(ROOT, "build", "bin"))
BUILD = os.environ.get("LATHE_BUILD_DIR", os.path.dirname(BIN))
DOCKER = os.path.join(ROOT, "deploy", "docker")
BUILD_WORKER = os.path.join(DOCKER, "build-worker")
# Where WorkerImageTest stages the worker image's files (hard links into the build and the venv:
# the same file system as both, or else copies).
STAGE = os.environ.get("LATHE_WORKER_STAGE", os.path.join(BUILD, "worker-image-test"))
# The build stage's WORKDIR: the repository root there.
BUILD_ROOT = "/src"
# In debian:bookworm-slim already.
BASE = {"libc6", "libstdc++6", "libgcc-s1", "zlib1g"}
# Installed for what the binaries do rather than what they link.
UNLINKED = {"ca-certificates"}
# The directories the loader searches after an object's RUNPATH (and ldconfig's cache).
SYSTEM_DIRS = ["/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib", "/usr/lib"]


def instructions(path):
    """[(INSTRUCTION, argument text)] with continuation lines joined, comments dropped."""
    with open(path) as f:
        text = f.read()
    text = re.sub(r"\\\n", " ", "\n".join(l for l in text.splitlines()
                                          if not l.lstrip().startswith("#")))
    result = []
    for line in text.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            result.append((word.upper(), rest.strip()))
    return result


def stages(steps):
    """The steps of each stage, FROM first."""
    result = []
    for step in steps:
        if step[0] == "FROM":
            result.append([])
        result[-1].append(step)
    return result


def within(path, directory):
    return path == directory or path.startswith(directory.rstrip("/") + "/")


@functools.lru_cache(maxsize=None)
def dynamic(elf):
    """(NEEDED sonames, RUNPATH entries) of `elf`."""
    text = subprocess.run(["readelf", "-d", elf], capture_output=True, text=True,
                          check=True).stdout
    runpath = re.search(r"\((?:RUNPATH|RPATH)\)\s+Library r(?:un)?path: \[(.*?)\]", text)
    return (re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", text),
            runpath.group(1).split(":") if runpath else [])


def needed(elf):
    """The sonames `elf` links directly (its NEEDED entries)."""
    return dynamic(elf)[0]


@functools.lru_cache(maxsize=None)
def system_libraries():
    """{soname: path} of this machine's ldconfig cache (x86-64)."""
    paths = {}
    for line in subprocess.run(["ldconfig", "-p"], capture_output=True, text=True,
                               check=True).stdout.splitlines()[1:]:
        match = re.match(r"\s*(\S+) \((.*?)\) => (\S+)", line)
        if match and "x86-64" in match.group(2):
            paths.setdefault(match.group(1), match.group(3))
    return paths


def loaded(binary, root=None):
    """{soname: path on this machine, or None where none is found} for every library the
    loader maps for `binary`, in an image whose / is `root` on this machine (None: this
    machine's /): breadth first from the binary, each object's NEEDED looked up in its own
    RUNPATH ($ORIGIN: its directory in the image; with a root, every directory inside it),
    then among the system's libraries; a soname loaded once serves every later NEEDED of it,
    as glibc's loader does."""
    def in_image(path):
        return path[len(root):] if root and within(path, root) else path

    found, queue = {}, [binary]
    while queue:
        obj = queue.pop(0)
        names, runpath = dynamic(obj)
        origin = os.path.dirname(in_image(obj))
        for name in names:
            if name in found:
                continue
            where = None
            for entry in runpath:
                directory = entry.replace("${ORIGIN}", origin).replace("$ORIGIN", origin)
                if not directory.startswith("/"):
                    continue
                candidate = (root or "") + os.path.join(directory, name)
                if os.path.exists(candidate):
                    where = candidate
                    break
            if where is None:
                where = system_libraries().get(name) or next(
                    (os.path.join(d, name) for d in SYSTEM_DIRS
                     if os.path.exists(os.path.join(d, name))), None)
            found[name] = os.path.normpath(where) if where else None
            if where:
                queue.append(where)
    return found


@functools.lru_cache(maxsize=None)
def owner(path):
    """The Debian package that owns the library at `path`, or None."""
    real = os.path.realpath(path)
    for candidate in (real, real.replace("/usr/lib/", "/lib/", 1)):
        result = subprocess.run(["dpkg", "-S", candidate], capture_output=True, text=True)
        if result.returncode == 0:
            return result.stdout.split(":")[0]
    return None


def image(steps):
    """What the runtime stage (the last) gives the binaries: (binaries copied from the build
    directory's bin/, the build stage's staged directory if it copies it to /, Debian packages
    installed, problems with its COPY lines)."""
    runtime = stages(steps)[-1]
    build_run = " && ".join(arg for word, arg in stages(steps)[0] if word == "RUN")
    staged = re.search(r"build-worker\b[^&]*--stage\s+(\S+)", build_run)
    binaries, stage, problems = [], None, []
    for word, arg in runtime:
        if word == "COPY" and arg.startswith("--from=build"):
            *sources, destination = arg.split()[1:]
            for source in sources:
                if source.startswith(BUILD_ROOT + "/build/bin/"):
                    binaries.append(os.path.basename(source))
                elif staged and os.path.normpath(source) == os.path.normpath(
                        staged.group(1)) and destination == "/":
                    stage = staged.group(1)
                else:
                    problems.append(f"COPY {source} {destination}: neither a binary of "
                                    "/src/build/bin nor build-worker's --stage directory to /")
    runs = " && ".join(arg for word, arg in runtime if word == "RUN")
    match = re.search(r"--no-install-recommends\s+(.+?)\s*(&&|$)", runs)
    installed = set(match.group(1).split()) if match else set()
    return binaries, stage, installed, problems


def library_problems(installed, binaries, root=None):
    """Every library that `binaries` (paths on this machine) would lack in an image whose /
    is `root` (None: the binaries alone, on Debian's libraries) and that installs the Debian
    packages `installed`, and every package of those that none of them links: [] when the
    image serves them."""
    problems, packages = [], set()
    for path in binaries:
        binary = os.path.basename(path)
        libraries = loaded(path, root)
        direct = set(needed(path))
        staged = []
        for name, where in sorted(libraries.items()):
            if where is None:
                problems.append(f"{binary}: the loader finds no {name}")
            elif root and within(where, root):
                staged.append(where)
            elif owner(where) is not None:
                if name in direct:
                    packages.add(owner(where))
            else:
                problems.append(f"{binary}: {name} ({where}) is neither a Debian package's "
                                "nor a staged file")
        # What the staged libraries link from Debian (apt's dependencies do not bring it).
        for library in staged:
            for name in needed(library):
                where = libraries.get(name)
                if where and not within(where, root) and owner(where):
                    packages.add(owner(where))
    packages -= BASE
    if packages - installed:
        problems.append(f"libraries the image would lack: {sorted(packages - installed)}")
    if installed - packages - UNLINKED:
        problems.append(f"packages nothing links: {sorted(installed - packages - UNLINKED)}")
    return problems


def known_flags(command):
    """The --flags `command --help` prints."""
    usage = subprocess.run([*command, "--help"], capture_output=True, text=True)
    return set(re.findall(r"--([a-z][a-z-]+)", usage.stdout + usage.stderr))


def check_packages_exist(test, name, installed):
    for package in sorted(installed):
        known = subprocess.run(["apt-cache", "show", package], capture_output=True)
        test.assertEqual(known.returncode, 0, f"{name}: Debian has no package {package}")


class DockerfileTest(unittest.TestCase):
    def test_coordinator_image(self):
        name = "Dockerfile.coordinator"
        steps = instructions(os.path.join(DOCKER, name))
        build, runtime = stages(steps)[0], stages(steps)[-1]
        # The build stage: its script and its targets.
        self.assertIn(("WORKDIR", BUILD_ROOT), build)
        build_run = " && ".join(arg for word, arg in build if word == "RUN")
        for script in re.findall(r"(scripts/[\w-]+)", build_run):
            self.assertTrue(os.access(os.path.join(ROOT, script), os.X_OK), script)
        targets = re.search(r"--target ([\w\- ]+)", build_run).group(1).split()
        for target in targets:
            self.assertTrue(os.access(os.path.join(BIN, target), os.X_OK),
                            f"{name}: --target {target} is no binary of this build")
        # What the image gets: the built binaries, what they load, nothing more.
        copied, stage, installed, problems = image(steps)
        self.assertEqual(problems, [], name)
        self.assertIsNone(stage)
        self.assertEqual(sorted(copied), sorted(targets), f"{name}: copies what it builds")
        self.assertEqual(library_problems(installed, [os.path.join(BIN, b) for b in copied]),
                         [], name)
        check_packages_exist(self, name, installed)
        # The entrypoint and its default flags.
        entry = json.loads(dict(runtime)["ENTRYPOINT"])
        command = json.loads(dict(runtime)["CMD"])
        self.assertIn(entry[0], copied)
        flags = known_flags([os.path.join(BIN, entry[0]), *entry[1:]])
        for flag in (a[2:] for a in command if a.startswith("--")):
            self.assertIn(flag, flags, f"{name}: {shlex.join(entry)} has no --{flag}")


class WorkerImageTest(unittest.TestCase):
    """Dockerfile.worker and what deploy/docker/build-worker stages for it from this build."""

    @classmethod
    def setUpClass(cls):
        cls.steps = instructions(os.path.join(DOCKER, "Dockerfile.worker"))
        staged = subprocess.run([BUILD_WORKER, "--stage-only", "--build-dir", BUILD,
                                 "--stage", STAGE], capture_output=True, text=True)
        if staged.returncode != 0:
            raise AssertionError(f"build-worker --stage-only failed: {staged.stderr}")
        cls.bin = os.path.join(STAGE, "usr", "local", "bin")

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(STAGE, ignore_errors=True)

    def staged_binaries(self):
        return [os.path.join(self.bin, b) for b in sorted(os.listdir(self.bin))]

    def library_dirs(self):
        """The staged library directories (the venv's torch/lib and nvidia/*/lib), in the
        image's paths."""
        with open(os.path.join(STAGE, "usr/local/share/lathe-worker/files.txt")) as f:
            files = f.read().split()
        return sorted({os.path.dirname(f) for f in files if ".so" in os.path.basename(f)})

    def test_the_dockerfile_builds_with_the_script_and_copies_its_stage(self):
        build = stages(self.steps)[0]
        self.assertIn(("WORKDIR", BUILD_ROOT), build)
        build_run = " && ".join(arg for word, arg in build if word == "RUN")
        self.assertIn("deploy/docker/build-worker", build_run)
        self.assertTrue(os.access(BUILD_WORKER, os.X_OK), BUILD_WORKER)
        copied, stage, installed, problems = image(self.steps)
        self.assertEqual(problems, [])
        self.assertEqual(copied, [], "binaries come from the stage")
        self.assertIsNotNone(stage, "the runtime stage copies no build-worker --stage to /")
        check_packages_exist(self, "Dockerfile.worker", installed)

    def test_the_stage_has_the_binaries_and_the_venvs_libraries(self):
        self.assertEqual(sorted(os.listdir(self.bin)), ["lathe-agent", "lathe-worker"])
        for binary in self.staged_binaries():
            self.assertTrue(os.path.samefile(binary, os.path.join(BIN, os.path.basename(binary)))
                            or open(binary, "rb").read() == open(
                                os.path.join(BIN, os.path.basename(binary)), "rb").read(),
                            f"{binary} is not this build's")
        dirs = self.library_dirs()
        self.assertTrue(any(d.endswith("/torch/lib") for d in dirs), dirs)
        self.assertTrue(any(d.endswith("/nvidia/cu13/lib") for d in dirs), dirs)
        # Each at the path lathe-worker's RUNPATH names, and nothing but shared libraries.
        runpath = {os.path.normpath(e) for e in dynamic(os.path.join(BIN, "lathe-worker"))[1]}
        self.assertTrue(runpath & set(dirs), f"RUNPATH {runpath}, staged {dirs}")
        for path, _, files in os.walk(STAGE):
            for file in files:
                if within(path, os.path.join(STAGE, "usr/local")):
                    continue
                self.assertRegex(file, r"\.so(\.[\d.]+)?$", os.path.join(path, file))

    def test_every_library_is_staged_or_debians(self):
        _, _, installed, _ = image(self.steps)
        binaries = self.staged_binaries()
        self.assertEqual(library_problems(installed, binaries, STAGE), [])
        # As in the image, Debian's libgomp serves libtorch_cpu (oneDNN loads it first) and
        # the wheel's copy goes unused; no library comes from this machine's venv or CUDA.
        libraries = loaded(os.path.join(self.bin, "lathe-worker"), STAGE)
        self.assertEqual(owner(libraries["libgomp.so.1"]), "libgomp1")
        self.assertTrue(within(libraries["libtorch_cuda.so"], STAGE), libraries)

    def test_the_library_check_fails_without_its_parts(self):
        """Without any one staged library directory, with a package nothing links, or without
        a package one links, the check fails."""
        _, _, installed, _ = image(self.steps)
        binaries = self.staged_binaries()
        for directory in self.library_dirs():
            hidden = STAGE + directory + ".hidden"
            os.rename(STAGE + directory, hidden)
            try:
                self.assertNotEqual(library_problems(installed, binaries, STAGE), [],
                                    f"passes without {directory}")
            finally:
                os.rename(hidden, STAGE + directory)
        self.assertNotEqual(library_problems(installed | {"libopenblas0-openmp"}, binaries,
                                             STAGE), [], "passes with a package nothing links")
        self.assertNotEqual(library_problems(installed - {"libdnnl2"}, binaries, STAGE), [],
                            "passes without libdnnl2")

    def run_staged(self, *args):
        """The staged lathe-worker with `args`, the staged library directories on
        LD_LIBRARY_PATH (where the image has them on its RUNPATH; this machine's RUNPATH
        names the venv's: an approximation, which loaded() makes exact): (result, [every
        library it mapped that is neither staged nor Debian's])."""
        dirs = [STAGE + d for d in self.library_dirs()]
        env = dict(os.environ, LD_LIBRARY_PATH=":".join(dirs), LD_DEBUG="libs")
        result = subprocess.run([os.path.join(self.bin, "lathe-worker"), *args],
                                capture_output=True, text=True, env=env, timeout=120)
        mapped = set(re.findall(r"calling init: (\S+)", result.stderr))
        problems = [p for p in sorted(mapped)
                    if not within(p, STAGE) and owner(p) is None and not within(p, self.bin)]
        return result, mapped, problems

    def test_the_staged_worker_runs(self):
        result, mapped, problems = self.run_staged("agent", "--help")
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr[-3000:])
        self.assertTrue(any(within(p, STAGE) and p.endswith("/libtorch_cuda.so")
                            for p in mapped), sorted(mapped))
        self.assertEqual(problems, [], "libraries from neither the stage nor Debian")
        self.assertIn("--coordinator", result.stdout + result.stderr)
        # The entrypoint and its default flags, against the staged binary.
        runtime = stages(self.steps)[-1]
        entry = json.loads(dict(runtime)["ENTRYPOINT"])
        command = json.loads(dict(runtime)["CMD"])
        self.assertEqual(entry, ["lathe-worker", "agent"])
        flags = set(re.findall(r"--([a-z][a-z-]+)", result.stdout + result.stderr))
        for flag in (a[2:] for a in command if a.startswith("--")):
            self.assertIn(flag, flags, f"Dockerfile.worker: {shlex.join(entry)} has no --{flag}")
        trainer, _, problems = self.run_staged("--help")
        self.assertEqual(trainer.returncode, 0, trainer.stderr[-3000:])
        self.assertEqual(problems, [])
        # The run's checks can fail. Without the staged torch/lib, lathe-worker takes libtorch
        # from its RUNPATH on this machine (the venv's, which the image lacks), and libtorch
        # the rest from beside itself: it runs, on libraries that are not staged. Without the
        # staged nvidia/cu13/lib, libtorch_cuda finds no cuFile ($ORIGIN/../../nvidia/cu13/lib;
        # this machine's CUDA has none) and it does not start.
        for suffix, runs in (("/torch/lib", True), ("/nvidia/cu13/lib", False)):
            directory = STAGE + next(d for d in self.library_dirs() if d.endswith(suffix))
            os.rename(directory, directory + ".hidden")
            try:
                broken, _, problems = self.run_staged("--help")
            finally:
                os.rename(directory + ".hidden", directory)
            if runs:
                self.assertTrue(any(p.endswith("/libtorch_cuda.so") for p in problems),
                                f"without {suffix}: {problems}")
            else:
                self.assertNotEqual(broken.returncode, 0, f"runs without {suffix}")
                self.assertIn("error while loading shared libraries", broken.stderr)

    def test_the_toolkit_wheels_are_torchs_versions(self):
        """deploy/docker/cuda-toolkit.txt pins what torch's cuda-toolkit names (this venv's)."""
        requires = importlib.metadata.metadata("cuda-toolkit").get_all("Requires-Dist")
        torch_pins = {}
        for line in requires:
            match = re.match(r"([\w-]+)==([\d.]+?)(?:\.\*)?;", line)
            if match:
                torch_pins[match.group(1)] = match.group(2)
        self.assertIn("nvidia-cuda-nvcc", torch_pins, requires)
        with open(os.path.join(DOCKER, "cuda-toolkit.txt")) as f:
            pins = re.findall(r"^([\w-]+)==([\d.]+) --hash=sha256:[0-9a-f]{64}$", f.read(),
                              re.MULTILINE)
        self.assertEqual(len(pins), 4, "cuda-toolkit.txt: four pinned, hashed wheels")
        for name, version in pins:
            self.assertEqual(version, torch_pins.get(name),
                             f"deploy/docker/cuda-toolkit.txt: {name}=={version}, torch's "
                             f"cuda-toolkit {importlib.metadata.version('cuda-toolkit')} "
                             f"names {torch_pins.get(name)}")


if __name__ == "__main__":
    unittest.main()
