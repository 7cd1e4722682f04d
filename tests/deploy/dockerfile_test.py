#!/usr/bin/env python3
"""deploy/docker's Dockerfiles against this build (no container engine runs here): every
script they run exists, every target they build is a binary of this build, every binary they
copy is one of those, each runtime stage installs a Debian package for every library the
copied binaries link (and nothing Debian lacks), and the entrypoint's flags are flags the
binary knows."""
import json
import os
import re
import shlex
import subprocess
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.environ.get("LATHE_BIN_DIR", os.path.join(ROOT, "build", "bin"))
DOCKER = os.path.join(ROOT, "deploy", "docker")
# In debian:bookworm-slim already.
BASE = {"libc6", "libstdc++6", "libgcc-s1", "zlib1g"}


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


def linked_packages(binary):
    """The Debian packages that provide the libraries `binary` links directly."""
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]",
                        subprocess.run(["readelf", "-d", binary], capture_output=True,
                                       text=True, check=True).stdout)
    paths = {}
    for line in subprocess.run(["ldd", binary], capture_output=True, text=True).stdout.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[1] == "=>":
            paths[parts[0]] = parts[2]
    packages = set()
    for name in needed:
        real = os.path.realpath(paths[name])
        owner = subprocess.run(["dpkg", "-S", real], capture_output=True, text=True)
        if owner.returncode != 0:
            owner = subprocess.run(["dpkg", "-S", real.replace("/usr/lib/", "/lib/", 1)],
                                   capture_output=True, text=True)
        assert owner.returncode == 0, f"{binary}: no package owns {real}"
        packages.add(owner.stdout.split(":")[0])
    return packages


class DockerfileTest(unittest.TestCase):
    def check(self, name):
        steps = instructions(os.path.join(DOCKER, name))
        runs = [arg for word, arg in steps if word == "RUN"]
        # The build stage: its script and its targets.
        build = runs[0]
        for script in re.findall(r"(scripts/[\w-]+)", build):
            self.assertTrue(os.access(os.path.join(ROOT, script), os.X_OK), script)
        targets = re.search(r"--target ([\w\- ]+)", build).group(1).split()
        for target in targets:
            self.assertTrue(os.access(os.path.join(BIN, target), os.X_OK),
                            f"{name}: --target {target} is no binary of this build")
        # What the image gets: the built binaries, and the packages they link.
        copied = []
        for word, arg in steps:
            if word == "COPY" and arg.startswith("--from=build"):
                sources = arg.split()[1:-1]
                for source in sources:
                    self.assertTrue(source.startswith("/src/build/bin/"), source)
                    copied.append(os.path.basename(source))
        self.assertEqual(sorted(copied), sorted(targets), f"{name}: copies what it builds")
        runtime = runs[1]
        installed = set(re.search(r"--no-install-recommends\s+(.+?)\s*&&", runtime).group(1).split())
        needed = set().union(*(linked_packages(os.path.join(BIN, b)) for b in copied)) - BASE
        self.assertEqual(needed - installed, set(), f"{name}: libraries the image would lack")
        for package in sorted(installed):
            known = subprocess.run(["apt-cache", "show", package], capture_output=True)
            self.assertEqual(known.returncode, 0, f"{name}: Debian has no package {package}")
        # The entrypoint and its default flags.
        entry = json.loads(dict(steps)["ENTRYPOINT"])
        command = json.loads(dict(steps)["CMD"])
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


if __name__ == "__main__":
    unittest.main()
