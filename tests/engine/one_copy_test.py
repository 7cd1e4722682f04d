#!/usr/bin/env python3
"""One copy of each library in a trainer process (issue #26). The worker links pip's torch
2.11, whose wheel carries its own gloo, oneDNN, protobuf, fmt and NCCL, beside Debian's gloo,
oneDNN, protobuf and fmt and the toolkit's NCCL headers. Two copies of one library in one
process, with symbols of one binding to code of the other, corrupt memory (horovod saw
`malloc(): memory corruption` with two gloos). docs/architecture.md, "One copy of each
library", says which copy each library is; this test holds the process to it:

- a 2-rank gloo job (data parallel, then ZeRO-3) runs, and each rank's /proc/<pid>/maps
  names at most one file per library, and exactly one for those it must load;
- every gloo symbol that Lathe's own code binds (LD_DEBUG=bindings) binds to Debian's
  libgloo, the library its headers describe, never to the copy inside libtorch_cpu; every
  libstdc++ symbol to Debian's libstdc++, never to the parts of a newer one that libtorch
  exports (a call of std::filesystem::remove_all through libtorch.so's copy crashed);
- libtorch and CUDA's runtime are the venv's, and no OpenBLAS is mapped beside the BLAS
  symbols libtorch_cpu exports (one libgomp.so.1: whichever the loader found first)."""
import collections
import glob
import json
import os
import re
import shutil
import subprocess
import tempfile
import unittest

BIN = os.environ.get("LATHE_BIN_DIR", os.path.join(os.path.dirname(__file__), "../../build/bin"))

# Library families by file name: lib<name>.so[.N...] or lib<name>-<hash>.so (auditwheel).
FAMILIES = ["gloo", "dnnl", "protobuf", "fmt", "spdlog", "gomp", "nccl", "openblas", "blas",
            "torch", "torch_cpu", "torch_cuda", "c10", "c10_cuda", "cudart", "cudnn", "cublas",
            "tcmalloc_minimal", "stdc++", "grpc++", "absl_base"]
# What a trainer on a machine without a GPU must map, once each.
REQUIRED = ["gloo", "dnnl", "torch_cpu", "torch_cuda", "c10", "cudart", "gomp",
            "tcmalloc_minimal"]


def family(path):
    match = re.match(r"lib(.+?)(?:-[0-9a-f]{8})?\.so(?:\.[0-9.]+)?$", os.path.basename(path))
    return match.group(1) if match else None


def mapped_libraries(pid):
    """{family: set of real paths} of the shared objects mapped into process `pid`."""
    found = collections.defaultdict(set)
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            fields = line.split(None, 5)
            if len(fields) < 6 or ".so" not in fields[5]:
                continue
            path = fields[5].strip().removesuffix(" (deleted)")
            name = family(path)
            if name in FAMILIES:
                found[name].add(os.path.realpath(path))
    return found


def libstdcxx_symbols():
    """The symbols that the system's libstdc++.so.6 defines (without their versions)."""
    path = subprocess.run(["/bin/sh", "-c", "ldconfig -p | grep -m1 'libstdc++.so.6 (.*x86-64'"],
                          capture_output=True, text=True).stdout.split("=>")[-1].strip()
    names = subprocess.run(["nm", "-D", "--defined-only", path], capture_output=True, text=True,
                           check=True).stdout.split()
    return {name.split("@")[0] for name in names[2::3]}


class OneCopyTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.root = tempfile.mkdtemp(prefix="lathe-one-copy-")
        cls.model = os.path.join(cls.root, "model")
        cls.data = os.path.join(cls.root, "train.jsonl")
        for args in (["model", "--out", cls.model, "--max-pos", "64"],
                     ["data", "--out", cls.data, "--records", "64"]):
            subprocess.run([os.path.join(BIN, "lathe-synth"), *args], check=True,
                           capture_output=True)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.root)

    def run_two_ranks(self, name, strategy):
        """Starts a 2-rank job, waits for each rank's first step, and returns each rank's
        mapped libraries and rank 0's LD_DEBUG bindings file; the ranks are then stopped."""
        job = os.path.join(self.root, name)
        os.makedirs(job)
        spec = os.path.join(job, "job.json")
        with open(spec, "w") as f:
            json.dump({"name": name, "model": {"path": self.model},
                       "data": {"train": self.data, "seq_len": 32},
                       "lora": {"rank": 4, "alpha": 8},
                       # Enough steps that the ranks are still running when they are read.
                       "train": {"steps": 100000, "global_batch": 2, "lr": 1e-3},
                       "resources": {"ranks": 2, "device": "cpu"}, "strategy": strategy,
                       "output": os.path.join(job, "out")}, f)
        bindings = os.path.join(job, "bindings")
        procs = []
        for rank in range(2):
            env = dict(os.environ)
            if rank == 0:
                env.update(LD_DEBUG="bindings", LD_DEBUG_OUTPUT=bindings)
            procs.append(subprocess.Popen(
                [os.path.join(BIN, "lathe-worker"), "train", "--spec", spec, "--rank", str(rank),
                 "--world-size", "2", "--rendezvous-dir", os.path.join(job, "rendezvous"),
                 "--threads", "1", "--collective-timeout", "60", "--output", "json"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
        try:
            maps = []
            for proc in procs:
                # The first step event: the collectives have run, every library is in.
                for line in proc.stdout:
                    if '"step"' in line:
                        break
                else:
                    self.fail(f"rank exited before a step: {proc.wait()} {proc.stderr.read()}")
                maps.append(mapped_libraries(proc.pid))
        finally:
            for proc in procs:
                proc.kill()
                proc.communicate()
        return maps, glob.glob(bindings + ".*")

    def check_maps(self, maps):
        for rank, found in enumerate(maps):
            for name, paths in found.items():
                self.assertEqual(len(paths), 1, f"rank {rank}: {name} mapped from {sorted(paths)}")
            for name in REQUIRED:
                self.assertIn(name, found, f"rank {rank}: lib{name} is not mapped")
            # Lathe's gloo is Debian's; the wheel's lives inside libtorch_cpu, not as a file.
            self.assertTrue(next(iter(found["gloo"])).startswith("/usr/lib"), found["gloo"])
            # libtorch is pip's torch (the CUDA build), and CUDA's runtime the wheel's.
            for name in ("torch_cpu", "torch_cuda", "cudart"):
                self.assertIn("/site-packages/", next(iter(found[name])), found[name])
            # No OpenBLAS: libtorch_cpu exports BLAS symbols of its own (cblas_*, saxpy_, ...).
            self.assertNotIn("openblas", found)
            self.assertNotIn("blas", found)

    def check_bindings(self, files):
        """Lathe's code (the executable: its libraries are static) binds every gloo symbol to
        Debian's libgloo and every symbol that libstdc++.so.6 defines to libstdc++.so.6, never
        to the copies that libtorch_cpu (gloo) and libtorch (parts of libstdc++) export."""
        self.assertTrue(files, "LD_DEBUG wrote no bindings")
        binding = re.compile(r"binding file (\S+) \[\d+\] to (\S+) \[\d+\]: \w+ symbol `([^']+)'")
        libstdcxx = None
        counts = collections.Counter()
        for path in files:
            with open(path, errors="replace") as f:
                for line in f:
                    match = binding.search(line)
                    if not match or os.path.basename(match.group(1)) != "lathe-worker":
                        continue
                    source, target, symbol = match.groups()
                    if "4gloo" in symbol:
                        counts["gloo"] += 1
                        self.assertEqual(family(target), "gloo", f"{symbol} bound to {target}")
                    if symbol.startswith("_ZNSt10filesystem") or symbol.startswith("_ZSt"):
                        if libstdcxx is None:
                            libstdcxx = libstdcxx_symbols()
                        if symbol in libstdcxx:
                            counts["stdc++"] += 1
                            self.assertEqual(family(target), "stdc++",
                                             f"{symbol} bound to {target}")
        self.assertGreater(counts["gloo"], 0, "no gloo symbol of Lathe's was bound")
        self.assertGreater(counts["stdc++"], 0, "no libstdc++ symbol of Lathe's was bound")

    def test_data_parallel(self):
        maps, bindings = self.run_two_ranks("dp", {"zero_stage": 0})
        self.check_maps(maps)
        self.check_bindings(bindings)

    def test_zero3(self):
        maps, _ = self.run_two_ranks("zero3", {"zero_stage": 3})
        self.check_maps(maps)


if __name__ == "__main__":
    unittest.main()
