#!/usr/bin/env python3
"""The coordinator at scale (issue #13): runs coordinator_scale_bench's standard set against
one build of lathe-coordinator and prints a markdown table of the figures.

  python3 bench/coordinator_scale.py [--quick] [--db sqlite|memory] [--bin-dir build/bin]
                                     [--bench build/bin/coordinator_scale_bench]
                                     [--only heartbeat,submit,burst] [--json PATH] [--keep]
                                     [--legacy-replies]

The standard set (each scenario starts its own coordinator with a fresh database):
  heartbeat  5,000 workers, heartbeat interval 2 s, 30 s of heartbeats, 1,000 WatchJob streams
  submit     10,000 jobs, one after another from one client, no workers
  burst      10,000 jobs queued, then 1,000 workers registering at once, 20 s
--quick: 500 workers (100 watchers), 1,000 jobs, and 1,000 jobs with 200 workers for the burst (submit
windows of 100 jobs instead of 1,000).

Each scenario is capped: submitting stops after a time limit (the report says how far it
got) and the whole scenario is killed after a hard limit (its row then says so), so that the
set ends within about 15 minutes even against a coordinator that does not keep up. The
bench's full report of each scenario is printed as it ends, the table last.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name, bench arguments, hard limit in seconds; sizes as (standard, quick).
SCENARIOS = [
    ("heartbeat",
     lambda quick: ["--scenario", "heartbeat", "--workers", "500" if quick else "5000",
                    "--watchers", "100" if quick else "1000",
                    "--heartbeat-interval", "2", "--duration", "30"],
     240),
    ("submit",
     lambda quick: ["--scenario", "submit", "--jobs", "1000" if quick else "10000",
                    "--window", "100" if quick else "1000", "--submit-time-limit", "180"],
     300),
    ("burst",
     lambda quick: ["--scenario", "burst", "--jobs", "1000" if quick else "10000",
                    "--workers", "200" if quick else "1000", "--window", "100" if quick else "1000",
                    "--duration", "20", "--submit-time-limit", "200"],
     420),
]

# Table rows: label, report key. A scenario without the key shows nothing in its column.
ROWS = [
    ("workers", "workers"),
    ("jobs", "jobs"),
    ("workers registered", "workers_registered"),
    ("time to register all (s)", "registration_all_s"),
    ("heartbeat RTT p50 (ms)", "heartbeat_rtt_p50_ms"),
    ("heartbeat RTT p99 (ms)", "heartbeat_rtt_p99_ms"),
    ("heartbeat RTT max (ms)", "heartbeat_rtt_max_ms"),
    ("heartbeats unanswered", "heartbeats_unanswered"),
    ("sessions expired (re-registered)", "sessions_expired"),
    ("streams given up after a silent timeout", "heartbeat_streams_given_up_silent"),
    ("answers pushed between heartbeats", "pushed_answers"),
    ("workers LOST at end", "workers_lost_at_end"),
    ("WatchJob streams held", "watchers"),
    ("WatchJob streams open at the end", "watch_streams_open_at_end"),
    ("submit jobs/s, all", "submit_jobs_per_s"),
    ("submit jobs/s, first window", "submit_first_window_jobs_per_s"),
    ("submit jobs/s, last window", "submit_last_window_jobs_per_s"),
    ("submit last / first", "submit_last_over_first"),
    ("submit latency p99 (ms)", "submit_latency_p99_ms"),
    ("submit stopped early", "submit_stopped_early"),
    ("ListJobs first page p50 (ms)", "list_jobs_p50_ms"),
    ("ListJobs first page max (ms)", "list_jobs_max_ms"),
    ("`lathe list` (s)", "lathe_list_s"),
    ("registration p50 (ms)", "registration_p50_ms"),
    ("registration max (ms)", "registration_max_ms"),
    ("registrations unanswered at the end", "registrations_unanswered_at_stop"),
    ("placement p50 (ms)", "placement_p50_ms"),
    ("placement p99 (ms)", "placement_p99_ms"),
    ("placement max (ms)", "placement_max_ms"),
    ("slots never assigned", "slots_never_assigned"),
    ("jobs FAILED at end", "jobs_failed_at_end"),
    ("longest scheduling pass (ms)", "scheduler_longest_pass_ms"),
    ("measured window (s)", "window_s"),
    ("coordinator threads (max)", "coordinator_threads_max"),
    ("coordinator RSS (MiB)", "coordinator_rss_mib"),
    ("coordinator peak RSS (MiB)", "coordinator_hwm_mib"),
    ("coordinator CPU (% of a core)", "coordinator_cpu_percent"),
    ("coordinator disk writes (MiB)", "coordinator_disk_write_mib"),
    ("coordinator write calls/s", "coordinator_write_calls_per_s"),
    ("bench's own CPU (% of a core)", "client_cpu_percent"),
    ("coordinator ended early", "coordinator_ended_early"),
    ("error", "error"),
]


def Cell(value):
    if value is None:
        return "n/a"
    if isinstance(value, float):
        if value >= 100:
            return f"{value:,.0f}"
        return f"{value:.3g}" if value < 10 else f"{value:.1f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value).replace("|", "\\|")


def RunScenario(name, bench, args, limit, keep):
    """The bench's report as a dict; on a timeout or a crash, what is known and why."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
        json_path = handle.name
    command = [bench] + args + ["--json", json_path] + (["--keep"] if keep else [])
    print(f"== {name}: {' '.join(command)}", flush=True)
    try:
        done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=limit)
        print(done.stdout, end="", flush=True)
        try:
            with open(json_path) as f:
                report = json.load(f)
        except (OSError, ValueError):
            report = {"error": f"exit status {done.returncode}, no report"}
    except subprocess.TimeoutExpired as timeout:
        output = timeout.stdout or b""
        print(output.decode() if isinstance(output, bytes) else output, end="")
        report = {"error": f"killed after the {limit} s limit"}
        print(f"== {name}: {report['error']}", flush=True)
    finally:
        if os.path.exists(json_path):
            os.unlink(json_path)
    return report


def Table(reports):
    names = list(reports)
    lines = ["| figure | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for label, key in ROWS:
        if not any(key in reports[name] for name in names):
            continue
        cells = [Cell(reports[name][key]) if key in reports[name] else "" for name in names]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    parser.add_argument("--db", choices=["sqlite", "memory"], default="sqlite")
    parser.add_argument("--bin-dir", default=os.path.join(ROOT, "build", "bin"),
                        help="lathe-coordinator, lathe and lathe-synth (default build/bin)")
    parser.add_argument("--bench", default=os.path.join(ROOT, "build", "bin",
                                                        "coordinator_scale_bench"))
    parser.add_argument("--only", default="",
                        help="comma-separated scenarios to run (default: all three)")
    parser.add_argument("--threads", type=int, default=2, help="the bench's client threads")
    parser.add_argument("--legacy-replies", action="store_true",
                        help="the coordinator predates issue #13 (answers carry no in_reply_to)")
    parser.add_argument("--json", help="write every scenario's report to this file")
    parser.add_argument("--keep", action="store_true",
                        help="keep each scenario's scratch directory (database, coordinator.log)")
    options = parser.parse_args()
    if not os.access(options.bench, os.X_OK):
        sys.exit(f"coordinator_scale.py: no benchmark at {options.bench}: "
                 "ninja -C build coordinator_scale_bench")
    only = [name for name in options.only.split(",") if name]
    known = [name for name, _, _ in SCENARIOS]
    for name in only:
        if name not in known:
            sys.exit(f"coordinator_scale.py: --only: unknown scenario {name!r} "
                     f"(known: {', '.join(known)})")

    reports = {}
    for name, sizes, limit in SCENARIOS:
        if only and name not in only:
            continue
        args = sizes(options.quick) + ["--db", options.db, "--bin-dir", options.bin_dir,
                                       "--threads", str(options.threads)]
        if options.legacy_replies:
            args.append("--legacy-replies")
        reports[name] = RunScenario(name, options.bench, args, limit, options.keep)

    first = next(iter(reports.values()), {})
    print()
    print(f"coordinator {os.path.join(options.bin_dir, 'lathe-coordinator')}, db {options.db}, "
          f"{first.get('cpu', '?')} ({first.get('cores', '?')} cores), {first.get('date', '?')}; "
          "load average at each start: " +
          ", ".join(f"{name} {report.get('load_average_at_start', '?')}"
                    for name, report in reports.items()))
    print()
    print(Table(reports))
    if options.json:
        with open(options.json, "w") as f:
            json.dump(reports, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
