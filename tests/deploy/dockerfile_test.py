#!/usr/bin/env python3
"""deploy/docker's Dockerfiles against this build (no container engine runs here): every
script they run exists, every target they build is a binary of this build, every binary they
copy is one of those, each runtime stage provides every library the copied binaries load
(a Debian package it installs, or a directory it copies from the build stage's venv at the
same path) and installs no package they do not link, Debian has each package, and the
entrypoint's flags are flags the binary knows."""
import functools
import json
import os
import re
import shlex
import subprocess
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.environ.get("LATHE_BIN_DIR", os.path.join(ROOT, "build", "bin"))
DOCKER = os.path.join(ROOT, "deploy", "docker")
# The build stage's WORKDIR: the repository root there.
BUILD_ROOT = "/src"
# In debian:bookworm-slim already.
BASE = {"libc6", "libstdc++6", "libgcc-s1", "zlib1g"}
# Installed for what the binaries do rather than what they link.
UNLINKED = {"ca-certificates"}


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


def on_host(path):
    """A build-stage path as this checkout has it (its /src is the repository root)."""
    if path == BUILD_ROOT or path.startswith(BUILD_ROOT + "/"):
        return ROOT + path[len(BUILD_ROOT):]
    return path


def within(path, directory):
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def needed(elf):
    """The sonames `elf` links directly (its NEEDED entries)."""
    return re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]",
                      subprocess.run(["readelf", "-d", elf], capture_output=True,
                                     text=True, check=True).stdout)


@functools.lru_cache(maxsize=None)
def loaded(binary):
    """{soname: path} for every library the loader maps for `binary` here (ldd: the direct
    ones and theirs), None for one it cannot find."""
    paths = {}
    for line in subprocess.run(["ldd", binary], capture_output=True, text=True).stdout.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[1] == "=>":
            paths[parts[0]] = os.path.normpath(parts[2]) if parts[2].startswith("/") else None
    return paths


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
    """What the runtime stage (the last) gives the binaries: (copied binaries, directories
    copied from the build stage as this checkout has them, Debian packages installed,
    problems with its COPY lines)."""
    runtime = stages(steps)[-1]
    binaries, directories, problems = [], [], []
    for word, arg in runtime:
        if word == "COPY" and arg.startswith("--from=build"):
            *sources, destination = arg.split()[1:]
            for source in sources:
                if source.startswith(BUILD_ROOT + "/build/bin/"):
                    binaries.append(os.path.basename(source))
                elif os.path.normpath(source) == os.path.normpath(destination):
                    directories.append(on_host(os.path.normpath(source)))
                else:
                    problems.append(f"COPY {source} {destination}: a library directory moves "
                                    "(the RUNPATHs name the build stage's paths)")
    runs = " && ".join(arg for word, arg in runtime if word == "RUN")
    match = re.search(r"--no-install-recommends\s+(.+?)\s*(&&|$)", runs)
    installed = set(match.group(1).split()) if match else set()
    return binaries, directories, installed, problems


def library_problems(steps, binaries):
    """Every library that `binaries` (names in BIN) would lack in the image that `steps`
    build, every package it installs that none of them links, and its COPY lines' problems:
    [] when the image serves them."""
    _, directories, installed, problems = image(steps)
    packages = set()
    for binary in binaries:
        path = os.path.join(BIN, binary)
        libraries = loaded(path)
        direct = set(needed(path))
        copied = []
        for name, where in sorted(libraries.items()):
            if where is None:
                problems.append(f"{binary}: ldd finds no {name} here")
            elif any(within(where, d) or within(os.path.realpath(where), os.path.realpath(d))
                     for d in directories):
                copied.append(where)
            elif owner(where) is not None:
                if name in direct:
                    packages.add(owner(where))
            else:
                problems.append(f"{binary}: {name} ({where}) is neither a Debian package's "
                                "nor in a directory the image copies from the build stage")
        # What the copied libraries link from Debian (apt's dependencies do not bring it).
        for library in copied:
            for name in needed(library):
                if libraries.get(name) and owner(libraries[name]):
                    packages.add(owner(libraries[name]))
    packages -= BASE
    if packages - installed:
        problems.append(f"libraries the image would lack: {sorted(packages - installed)}")
    if installed - packages - UNLINKED:
        problems.append(f"packages nothing links: {sorted(installed - packages - UNLINKED)}")
    return problems


class DockerfileTest(unittest.TestCase):
    def check(self, name):
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
        copied, _, installed, _ = image(steps)
        self.assertEqual(sorted(copied), sorted(targets), f"{name}: copies what it builds")
        self.assertEqual(library_problems(steps, copied), [], name)
        for package in sorted(installed):
            known = subprocess.run(["apt-cache", "show", package], capture_output=True)
            self.assertEqual(known.returncode, 0, f"{name}: Debian has no package {package}")
        # The entrypoint and its default flags.
        entry = json.loads(dict(runtime)["ENTRYPOINT"])
        command = json.loads(dict(runtime)["CMD"])
        self.assertIn(entry[0], copied)
        usage = subprocess.run([os.path.join(BIN, entry[0]), *entry[1:], "--help"],
                               capture_output=True, text=True)
        known_flags = set(re.findall(r"--([a-z][a-z-]+)", usage.stdout + usage.stderr))
        for flag in (a[2:] for a in command if a.startswith("--")):
            self.assertIn(flag, known_flags, f"{name}: {shlex.join(entry)} has no --{flag}")

    def test_coordinator_image(self):
        self.check("Dockerfile.coordinator")

    def test_worker_image(self):
        self.check("Dockerfile.worker")

    def test_worker_image_checks_fail_without_its_parts(self):
        """The library check itself: without any one of the worker image's venv COPY lines,
        or with a package nothing links, it fails."""
        steps = instructions(os.path.join(DOCKER, "Dockerfile.worker"))
        binaries = image(steps)[0]
        self.assertEqual(library_problems(steps, binaries), [])
        venv = [i for i, (word, arg) in enumerate(steps)
                if word == "COPY" and arg.startswith("--from=build") and "/.venv/" in arg]
        self.assertGreater(len(venv), 0, "the worker image copies no venv libraries")
        for i in venv:
            self.assertNotEqual(library_problems(steps[:i] + steps[i + 1:], binaries), [],
                                f"passes without COPY {steps[i][1]}")
        extra = [(word, arg.replace("--no-install-recommends",
                                    "--no-install-recommends libopenblas0-openmp"))
                 for word, arg in steps]
        self.assertNotEqual(library_problems(extra, binaries), [],
                            "passes with a package nothing links")


if __name__ == "__main__":
    unittest.main()
