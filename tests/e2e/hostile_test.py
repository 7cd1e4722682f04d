#!/usr/bin/env python3
"""Hostile callers against a running coordinator: 1,000 random requests (every method, every
field filled at random: huge, negative and NaN numbers, unknown enum values, '..' paths, long
strings, many repeated entries) with no token, a wrong token or each role's, plus oversized
messages and bytes that are no protobuf at all. The coordinator must answer each with the
right status code, never crash, and keep its memory bounded. The requests are built from the
protos' descriptors (modules generated here with protoc), so a new field is fuzzed too.

And issue #27's cross-worker and cross-client cases against a job running on a real agent:
another worker's token reports its rank done, writes its log, reads and writes its
rendezvous keys and registers under its id; its own worker forges a log offset; another
client reads, lists, watches and cancels it. Each is refused, and the job runs on."""
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import unittest

import grpc

from services_test import TOKEN_HOLDERS, ClusterTest

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "../..")
REQUESTS = 1000
RSS_BOUND_MIB = 256  # the coordinator's resident memory after the barrage

CLIENT, WORKER, ADMIN = "client", "worker", "admin"
ROLES = {  # method -> roles allowed (common/rpc/auth.h)
    **{m: {CLIENT, ADMIN} for m in ("SubmitJob", "GetJob", "ListJobs", "CancelJob", "WatchJob",
                                    "PlanJob", "GetPlanHistory", "GetLogs", "ListWorkers",
                                    "ProfileJob", "GetProfileFile")},
    **{m: {WORKER} for m in ("RegisterWorker", "Heartbeat", "ReportProgress", "AppendLogs",
                             "UploadProfile", "ReportProfile", "Set", "Get", "Wait", "Add")},
    **{m: {ADMIN} for m in ("DrainWorker", "RemoveWorker")},
}
# What a caller with the right token may be answered: the request's own fault, or that what
# it names does not exist or is not in a state for it, or that it waited (Wait, WatchJob), or
# (a worker) that the worker id or attempt it names is not one its token acts for.
ANSWERS = {grpc.StatusCode.OK, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
           grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ALREADY_EXISTS,
           grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.OUT_OF_RANGE,
           grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}


def generate_protos(out):
    os.makedirs(out)
    subprocess.run(["protoc", "-I", os.path.join(REPO, "proto"), "--python_out", out,
                    *[os.path.join(REPO, "proto/lathe/v1", p)
                      for p in ("job.proto", "coordinator.proto", "trainer.proto")]],
                   check=True)
    sys.path.insert(0, out)
    from lathe.v1 import coordinator_pb2
    return coordinator_pb2


class Filler:
    """Random values for a protobuf message, field by field."""
    def __init__(self, rng):
        self.rng = rng

    def string(self):
        r = self.rng
        return r.choice(["", "job-1", "w1", "../../etc/passwd", "/etc/shadow", "a" * 300,
                         "x" * r.randint(1000, 300000), "\u00e9\u4e2d\U0001f600", "\x00\x01",
                         "".join(chr(r.randint(1, 0xd7ff)) for _ in range(r.randint(1, 40)))])

    def integer(self, field):
        r, T = self.rng, field.type
        bits = 32 if T in (field.TYPE_INT32, field.TYPE_SINT32, field.TYPE_SFIXED32,
                           field.TYPE_UINT32, field.TYPE_FIXED32) else 64
        unsigned = T in (field.TYPE_UINT32, field.TYPE_FIXED32, field.TYPE_UINT64,
                         field.TYPE_FIXED64)
        low, high = (0, 2**bits - 1) if unsigned else (-2**(bits - 1), 2**(bits - 1) - 1)
        return max(low, min(high, r.choice([0, 1, -1, 2, 7, 4096, high, low,
                                           r.randint(low, high)])))

    def value(self, field, depth):
        r, T = self.rng, field.type
        if T == field.TYPE_MESSAGE:
            return self.message(field.message_type._concrete_class, depth + 1) \
                if depth < 4 else None
        if T == field.TYPE_STRING:
            return self.string()
        if T == field.TYPE_BYTES:
            return os.urandom(r.randint(0, 64))
        if T == field.TYPE_BOOL:
            return r.random() < 0.5
        if T in (field.TYPE_DOUBLE, field.TYPE_FLOAT):
            return r.choice([0.0, -1.0, 0.5, 1e308 if T == field.TYPE_DOUBLE else 3e38,
                             math.nan, math.inf, -math.inf, r.uniform(-1e6, 1e6)])
        if T == field.TYPE_ENUM:
            values = [v.number for v in field.enum_type.values]
            return r.choice(values + [99, -5])
        return self.integer(field)

    def message(self, cls, depth=0):
        message = cls()
        for field in message.DESCRIPTOR.fields:
            if self.rng.random() < 0.35:
                continue
            target = getattr(message, field.name)
            if field.message_type is not None and field.message_type.GetOptions().map_entry:
                key_field, value_field = field.message_type.fields
                for _ in range(self.rng.choice([1, 2, 40])):
                    key, value = self.value(key_field, depth), self.value(value_field, depth)
                    if value is None:
                        continue
                    if value_field.message_type is not None:
                        target[key].CopyFrom(value)
                    else:
                        target[key] = value
            elif field.label == field.LABEL_REPEATED:
                for _ in range(self.rng.choice([1, 1, 3, 200])):
                    value = self.value(field, depth)
                    if value is None:
                        continue
                    if field.message_type is not None:
                        target.add().CopyFrom(value)
                    else:
                        target.append(value)
            else:
                value = self.value(field, depth)
                if value is None:
                    continue
                if field.message_type is not None:
                    target.CopyFrom(value)
                else:
                    setattr(message, field.name, value)
        return message


def rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024


class HostileTest(ClusterTest):
    PREFIX, WORKERS = "lathe-hostile-", ()

    @classmethod
    def configure(cls, cluster):
        cls.pb = generate_protos(os.path.join(cls.root, "py"))
        cls.tokens = {}
        for role in (CLIENT, WORKER, ADMIN):
            with open(cluster.tokens[role]) as f:
                cls.tokens[role] = f.read().strip()

    def call(self, channel, service, method, request, token, timeout=5):
        """The status code of one call (a stream: of its first answer)."""
        self.details = ""
        path = f"/lathe.v1.{service.name}/{method.name}"
        metadata = [("authorization", f"Bearer {token}")] if token else []
        response = method.output_type._concrete_class
        try:
            if method.client_streaming or method.server_streaming:
                # The first answer, then the stream is cancelled: left open, the streams
                # would pile up past the server's 64 per connection (RESOURCE_EXHAUSTED).
                if method.client_streaming:
                    stream = channel.stream_stream(path, lambda m: m.SerializeToString(),
                                                   response.FromString)(
                        iter([request]), timeout=2, metadata=metadata)
                else:
                    stream = channel.unary_stream(path, lambda m: m.SerializeToString(),
                                                  response.FromString)(
                        request, timeout=2, metadata=metadata)
                try:
                    next(stream, None)
                finally:
                    stream.cancel()
            else:
                channel.unary_unary(path, lambda m: m.SerializeToString(),
                                    response.FromString)(request, timeout=timeout,
                                                         metadata=metadata)
            return grpc.StatusCode.OK
        except grpc.RpcError as error:
            self.details = error.details()  # for the assertion's message
            return error.code()

    def test_random_oversized_and_garbage_requests(self):
        rng = random.Random(1000)
        filler = Filler(rng)
        methods = [(service, method)
                   for service in self.pb.DESCRIPTOR.services_by_name.values()
                   for method in service.methods]
        pid = self.cluster.coordinator.pid
        seen = {}
        with grpc.insecure_channel(self.cluster.address,
                                   options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
            for i in range(REQUESTS):
                service, method = rng.choice(methods)
                request = filler.message(method.input_type._concrete_class)
                who = rng.choice([None, "wrong", CLIENT, WORKER, ADMIN])
                token = {None: None, "wrong": "wrong-token-" + "z" * 20}.get(who) \
                    if who in (None, "wrong") else self.tokens[who]
                code = self.call(ch, service, method, request, token)
                seen.setdefault(method.name, set()).add(code.name)
                if request.ByteSize() > 4 << 20:  # the server's message limit, before all else
                    expected = {grpc.StatusCode.RESOURCE_EXHAUSTED}
                elif who in (None, "wrong"):
                    expected = {grpc.StatusCode.UNAUTHENTICATED}
                elif who not in ROLES[method.name]:
                    expected = {grpc.StatusCode.PERMISSION_DENIED}
                elif who == WORKER:
                    expected = ANSWERS
                else:
                    expected = ANSWERS - {grpc.StatusCode.PERMISSION_DENIED}
                self.assertIn(code, expected,
                              (i, method.name, who, self.details[:300], str(request)[:300]))
            # Over the 4 MiB limit: refused before any handler runs.
            for service, method in methods:
                big = method.input_type._concrete_class()
                strings = [f for f in big.DESCRIPTOR.fields
                           if f.type == f.TYPE_STRING and f.label != f.LABEL_REPEATED]
                if not strings or method.client_streaming:
                    continue
                setattr(big, strings[0].name, "x" * (5 << 20))
                code = self.call(ch, service, method, big, self.tokens[CLIENT])
                self.assertEqual(code, grpc.StatusCode.RESOURCE_EXHAUSTED, method.name)
            # Bytes that are no protobuf.
            for _ in range(50):
                service, method = rng.choice([m for m in methods
                                              if not m[1].client_streaming and
                                              not m[1].server_streaming])
                garbage = bytes(rng.randrange(256) for _ in range(rng.randint(1, 2000)))
                try:
                    ch.unary_unary(f"/lathe.v1.{service.name}/{method.name}")(
                        garbage, timeout=5, metadata=[("authorization",
                                                       f"Bearer {self.tokens[ADMIN]}")])
                    code = grpc.StatusCode.OK
                except grpc.RpcError as error:
                    code = error.code()
                # gRPC refuses what does not parse: INTERNAL from a sync handler
                # (RendezvousService), UNIMPLEMENTED from a callback one (1.51's choice).
                self.assertIn(code, ANSWERS | {grpc.StatusCode.INTERNAL,
                                               grpc.StatusCode.UNIMPLEMENTED,
                                               grpc.StatusCode.PERMISSION_DENIED}, method.name)
        self.assertIsNone(self.cluster.coordinator.poll(), "the coordinator died")
        listed = self.cluster.lathe("list")
        self.assertEqual(listed.returncode, 0, listed.stderr)
        rss = rss_mib(pid)
        print(f"coordinator RSS after the barrage: {rss:.0f} MiB; codes per method: {seen}",
              file=sys.stderr)
        self.assertLess(rss, RSS_BOUND_MIB)


class CrossWorkerTest(ClusterTest):
    """Issue #27's findings, replayed against a job running on agent wa: each must be refused
    and the job must run on, its attempt and restarts untouched."""
    PREFIX, WORKERS = "lathe-cross-", ("wa",)

    @classmethod
    def configure(cls, cluster):
        cls.pb = generate_protos(os.path.join(cls.root, "py"))
        cls.tokens = {}
        for key in TOKEN_HOLDERS:
            with open(cluster.tokens[key]) as f:
                cls.tokens[key] = f.read().strip()

    def unary(self, channel, service, method, request, token):
        """(status code, details) of one call."""
        response = self.pb.DESCRIPTOR.services_by_name[service].methods_by_name[method] \
            .output_type._concrete_class
        try:
            channel.unary_unary(f"/lathe.v1.{service}/{method}", lambda m: m.SerializeToString(),
                                response.FromString)(
                request, timeout=10, metadata=[("authorization", f"Bearer {token}")])
            return grpc.StatusCode.OK, ""
        except grpc.RpcError as error:
            return error.code(), error.details()

    def test_another_workers_token_and_another_client_are_refused(self):
        pb = self.pb
        job_id, job = self.running_until_cleanup("victim")
        generation = job["attempts"][-1]["generation"]
        self.assertEqual(job["attempts"][-1]["placements"][0]["worker_id"], "wa")
        other, own = self.tokens["worker-b"], self.tokens["worker"]
        not_wa = 'e2e-worker-b (worker) may not act for worker "wa" (its token names wb)'
        with grpc.insecure_channel(self.cluster.address) as ch:
            # Its rank reported done (the job would end at step ~600 of 100,000, no adapter).
            report = pb.ReportProgressRequest(worker_id="wa", job_id=job_id,
                                              generation=generation, rank=0,
                                              event=pb.RANK_EVENT_SUCCEEDED)
            self.assertEqual(self.unary(ch, "WorkerService", "ReportProgress", report, other),
                             (grpc.StatusCode.PERMISSION_DENIED, not_wa))
            report.worker_id = "wb"  # under its own id: the rank is not placed there
            code, details = self.unary(ch, "WorkerService", "ReportProgress", report, other)
            self.assertEqual(code, grpc.StatusCode.FAILED_PRECONDITION, details)
            # Forged log lines, and a log offset far past the end from its own worker.
            log = pb.AppendLogsRequest(worker_id="wa", job_id=job_id, generation=generation,
                                       rank=0, offset=0, data=b"forged line\n")
            self.assertEqual(self.unary(ch, "WorkerService", "AppendLogs", log, other),
                             (grpc.StatusCode.PERMISSION_DENIED, not_wa))
            log.offset = 2**62
            code, details = self.unary(ch, "WorkerService", "AppendLogs", log, own)
            self.assertEqual(code, grpc.StatusCode.INVALID_ARGUMENT, details)
            log.offset = 2**40
            code, details = self.unary(ch, "WorkerService", "AppendLogs", log, own)
            self.assertEqual(code, grpc.StatusCode.OUT_OF_RANGE, details)
            # Its attempt's rendezvous keys.
            scope = pb.RendezvousScope(job_id=job_id, generation=generation)
            for method, request in (
                    ("Get", pb.RendezvousGetRequest(scope=scope, key="rank0")),
                    ("Set", pb.RendezvousSetRequest(scope=scope, key="rank0", value=b"evil")),
                    ("Add", pb.RendezvousAddRequest(scope=scope, key="barrier", delta=1))):
                code, details = self.unary(ch, "RendezvousService", method, request, other)
                self.assertEqual(code, grpc.StatusCode.PERMISSION_DENIED, (method, details))
                self.assertIn(f"acts for no worker of attempt {generation} of job {job_id}",
                              details)
            # Its worker id, with more slots.
            register = pb.RegisterWorkerRequest(worker_id="wa", slots=4)
            self.assertEqual(self.unary(ch, "WorkerService", "RegisterWorker", register, other),
                             (grpc.StatusCode.PERMISSION_DENIED, not_wa))
            # Its heartbeats.
            beats = ch.stream_stream("/lathe.v1.WorkerService/Heartbeat",
                                     lambda m: m.SerializeToString(),
                                     pb.HeartbeatResponse.FromString)(
                iter([pb.HeartbeatRequest(worker_id="wa")]), timeout=10,
                metadata=[("authorization", f"Bearer {other}")])
            with self.assertRaises(grpc.RpcError) as refused:
                next(beats)
            self.assertEqual(refused.exception.code(), grpc.StatusCode.PERMISSION_DENIED)
        # Another client: the job does not exist for it.
        for command in (("status", job_id), ("logs", job_id), ("watch", job_id),
                        ("cancel", job_id)):
            result = self.cluster.lathe(*command, role="bob")
            self.assertNotEqual(result.returncode, 0, command)
            self.assertIn(f"job {job_id} not found", result.stderr, command)
        listed = self.cluster.lathe("--output", "json", "list", role="bob")
        self.assertEqual(listed.returncode, 0, listed.stderr)
        self.assertEqual(json.loads(listed.stdout), [])
        listed = self.cluster.lathe("--output", "json", "list", role="admin")
        self.assertIn(job_id, [j["job_id"] for j in json.loads(listed.stdout)])
        # The job ran on: one attempt, no restart, its log the trainer's own.
        job = self.wait_running(job_id)
        self.assertEqual((job["state"], len(job["attempts"]), job["restarts"]),
                         ("running", 1, 0), job)
        self.assertEqual(job["owner"], "e2e-client")
        logs = self.cluster.lathe("logs", job_id)
        self.assertEqual(logs.returncode, 0, logs.stderr)
        self.assertNotIn("forged", logs.stdout)
        # An admin may cancel it, and its history says who did.
        cancelled = self.cluster.lathe("cancel", job_id, role="admin")
        self.assertEqual(cancelled.returncode, 0, cancelled.stderr)
        history = self.status(job_id)["history"]
        self.assertEqual([(h["state"], h["by"]) for h in history],
                         [("queued", "e2e-client (client)"), ("running", "the coordinator"),
                          ("cancelled", "e2e-admin (admin)")])
        text = self.cluster.lathe("status", job_id)
        self.assertIn("cancelled by e2e-admin (admin)", text.stdout)


    def spec_with_output(self, name, output):
        path = self.spec(name, steps=2)
        with open(path) as f:
            text = f.read().replace(f"output: {os.path.join(self.root, 'runs', name)}",
                                    f"output: {output}")
        with open(path, "w") as f:
            f.write(text)
        return path

    def test_paths_are_compared_canonically_and_checked_again_where_they_are_used(self):
        holder, _ = self.running_until_cleanup("holder")
        runs = os.path.join(self.root, "runs")
        alias = os.path.join(self.root, "alias")
        os.symlink(runs, alias)
        # Another spelling of the running job's output, one inside it, one holding it.
        for output, problem in ((f"{alias}/holder", f"belongs to job {holder} (running)"),
                                (f"{runs}/holder/inner", f"lies inside {runs}/holder"),
                                (runs, f"holds {runs}/holder")):
            result = self.cluster.lathe("submit", self.spec_with_output("other", output))
            self.assertEqual(result.returncode, 1, result.stdout)
            self.assertIn(problem, result.stderr)
        # A queued job's output, not made yet, is replaced by a link out of the roots before
        # the job starts: its trainer refuses the link and writes nothing outside.
        outside = tempfile.mkdtemp(prefix="lathe-outside-")
        self.addCleanup(shutil.rmtree, outside, ignore_errors=True)
        swapped = self.submit("swapped", steps=2)
        self.assertEqual(self.status(swapped)["state"], "queued")
        os.symlink(outside, os.path.join(runs, "swapped"))
        self.assertEqual(self.cluster.lathe("cancel", holder).returncode, 0)
        watched = self.cluster.lathe("watch", swapped, timeout=120)
        self.assertEqual(watched.returncode, 1, watched.stdout)
        job = self.status(swapped)
        self.assertEqual(job["state"], "failed", job)
        self.assertIn(f"{runs}/swapped is a symbolic link", job["reason"])
        self.assertEqual(os.listdir(outside), [])


if __name__ == "__main__":
    unittest.main()
