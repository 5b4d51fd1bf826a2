#!/usr/bin/env python3
"""An operator's bad hour on the demo, with the built binaries (#48).

Runs the demo of `dflash local` (its tiny target, its 7,680 samples, its
drafter flags) as separate processes, 2 target-servers and 3 data-parallel
drafter-servers around one broker with a --state-dir, and then, by polling
the broker's status (never by sleeping for a state):

  1. SIGKILLs drafter-1 while the run trains (its step is in compute or in
     the all-reduce: the binaries have no hook to pick the moment);
  2. SIGSTOPs drafter-2 until the others have committed steps without it
     (longer than --quorum-timeout), then SIGCONTs it;
  3. starts a fourth drafter (drafter-3) mid-run;
  4. kill -9s the broker and starts it again on the same port and state dir.

It then requires: the run COMPLETE, 0 dead letters, 0 checksum mismatches
(no split, no rollback) on both broker instances, every produced (target, seq) in exactly one
committed step (read from both broker instances' commit log lines), the
run's model trained on exactly the produced samples (model_samples), every
live process exit 0. Exit status 0 when all hold; the figures are printed.

Usage: scripts/operator-faults.py --bin-dir target/local --work DIR
       [--demo RUN_DIR]  (a `dflash local` work dir holding model/ and data/;
                          made with `dflash local` when not given)
"""

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

FAULT_TIMEOUT = "5s"
PHASE_TIMEOUT_S = 300
TINY_DRAFTER_FLAGS = [
    "--draft-layers", "2", "--block-size", "8", "--num-anchors", "32",
    "--learning-rate", "3e-3", "--max-step-samples", "16",
]


class Run:
    def __init__(self, bins: Path, work: Path, demo: Path):
        self.bins, self.work, self.demo = bins, work, demo
        self.broker = None
        self.broker_logs = []
        self.address = None
        self.port = 0
        self.drafters = {}
        self.targets = {}
        self.started = time.monotonic()
        self.env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_CPP_LOG_LEVEL="ERROR")

    def say(self, text):
        print(f"[{time.monotonic() - self.started:7.1f} s] {text}", flush=True)

    # --- processes ------------------------------------------------------
    def start_broker(self):
        log = self.work / f"broker-{len(self.broker_logs) + 1}.log"
        self.broker_logs.append(log)
        ready = self.work / "broker.address"
        ready.unlink(missing_ok=True)
        flags = [
            "--listen", f"127.0.0.1:{self.port}", "--ready-file", str(ready),
            "--expected-targets", "2", "--target-grace", "30s",
            "--state-dir", str(self.work / "state"),
            "--model-output", str(self.work / "model"),
            "--quorum-timeout", FAULT_TIMEOUT, "--lease-timeout", "60s",
        ]
        deadline = time.monotonic() + 60
        while True:
            with open(log, "ab") as out:
                self.broker = subprocess.Popen(
                    [str(self.bins / "broker"), *flags], stdout=out, stderr=out, env=self.env)
            while not ready.exists() and self.broker.poll() is None:
                time.sleep(0.05)
            if ready.exists():
                break
            # The port of the killed broker may be briefly unavailable.
            if self.port == 0 or time.monotonic() > deadline:
                sys.exit(f"the broker exited before listening; see {log}")
            time.sleep(0.2)
        bound = ready.read_text().strip()
        self.port = int(bound.rsplit(":", 1)[1])
        self.address = f"http://{bound}"
        self.wait("the broker answers", lambda: self.status() is not None)

    def spawn(self, role, name, flags):
        log = open(self.work / f"{name}.log", "ab")
        binary = self.bins / ("drafter-server" if role == "drafter" else "target-server")
        return subprocess.Popen([str(binary), *flags], stdout=log, stderr=log, env=self.env)

    def start_drafter(self, index):
        name = f"drafter-{index}"
        self.drafters[name] = self.spawn("drafter", name, [
            "--broker", self.address, "--drafter-id", name, "--device", "cpu",
            "--output", str(self.work / name),
            "--target-model", str(self.demo / "model"),
            "--draft-architecture", "dflash", *TINY_DRAFTER_FLAGS,
            "--mask-token-id", str(mask_token(self.demo / "model")),
            "--collective-timeout", FAULT_TIMEOUT,
        ])

    def start_target(self, index):
        name = f"target-{index}"
        self.targets[name] = self.spawn("target", name, [
            "--broker", self.address, "--target-id", name, "--device", "cpu",
            "--shard-index", str(index), "--num-shards", "2",
            "--model", str(self.demo / "model"),
            "--data", str(self.demo / "data" / "train.jsonl"),
            "--num-draft-layers", "2",
        ])

    # --- the broker's status --------------------------------------------
    def status(self):
        result = subprocess.run(
            [str(self.bins / "dflash-ops"), "status", "--json", "--broker", self.address],
            capture_output=True, text=True)
        if result.returncode != 0:
            return None
        return json.loads(result.stdout)

    def parallel(self):
        status = self.status() or {}
        return status.get("lighthouse") or {}

    def wait(self, what, predicate, timeout=PHASE_TIMEOUT_S):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, child in {**self.drafters, **self.targets}.items():
                if child.returncode is None and child.poll() not in (None, 0):
                    if not getattr(child, "killed_on_purpose", False):
                        self.fail(f"{name} exited {child.returncode} while waiting for: {what}")
            if predicate():
                self.say(what)
                return
            time.sleep(0.2)
        self.fail(f"timed out after {timeout} s waiting for: {what}; data parallelism: {self.parallel()}")

    def members(self, names):
        def check():
            parallel = self.parallel()
            return sorted(parallel.get("members", [])) == sorted(names)
        return check

    def committed_beyond(self, steps):
        return lambda: self.parallel().get("steps_committed", 0) >= steps

    def fail(self, why):
        self.say(f"FAILED: {why}")
        self.stop_all()
        for log in [*self.broker_logs, *sorted(self.work.glob("*-[0-9].log"))]:
            lines = log.read_text(errors="replace").splitlines()[-8:]
            print(f"--- {log.name} (last lines)\n" + "\n".join(lines))
        sys.exit(1)

    def stop_all(self):
        for child in [*self.drafters.values(), *self.targets.values(), self.broker]:
            if child is not None and child.poll() is None:
                child.send_signal(signal.SIGCONT)
                child.kill()


def mask_token(model: Path) -> int:
    """The mask token `dflash local` gives the tiny default's drafters."""
    config = json.loads((model / "config.json").read_text())
    for key in ("mask_token_id", "pad_token_id", "eos_token_id"):
        value = config.get(key)
        if isinstance(value, list):
            value = value[0] if value else None
        if isinstance(value, int):
            return value
    sys.exit(f"{model}/config.json names no mask, pad or eos token")


def committed_keys(logs):
    """(target, seq) -> the committed steps that trained it, from the commit log lines."""
    trained = {}
    for log in logs:
        for line in log.read_text(errors="replace").splitlines():
            if "data parallelism: step committed" not in line:
                continue
            fields = dict(word.split("=", 1) for word in line.split() if "=" in word)
            step = int(fields["step"])
            for key in fields.get("keys", "").strip('"').split(","):
                if key:
                    target, seq = key.rsplit(":", 1)
                    trained.setdefault((target, int(seq)), []).append(step)
    return trained


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bin-dir", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--demo", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    random.seed(args.seed)
    bins = args.bin_dir.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    work = args.work.resolve()
    demo = args.demo.resolve() if args.demo else work / "demo"
    if not (demo / "data" / "train.jsonl").exists():
        print(f"making the demo's model and data with `dflash local` in {demo} ...", flush=True)
        subprocess.run([str(bins / "dflash"), "local", "--workdir", str(demo),
                        "--targets", "1", "--drafters", "1"], check=True,
                       stdout=subprocess.DEVNULL)
    lines = sum(1 for line in open(demo / "data" / "train.jsonl") if line.strip())

    run = Run(bins, work, demo)
    run.say(f"demo: {lines} samples in {demo / 'data' / 'train.jsonl'}")
    run.start_broker()
    for index in range(3):
        run.start_drafter(index)
    for index in range(2):
        run.start_target(index)
    run.say(f"broker {run.address}, 2 targets, 3 drafters started")
    three = ["drafter-0", "drafter-1", "drafter-2"]
    run.wait("three members commit steps together",
             lambda: run.members(three)() and run.parallel().get("steps_committed", 0) >= 20)

    # 1. SIGKILL a member while it trains: after a commit, at a random moment of the next step.
    parallel = run.parallel()
    dropped = parallel.get("members_dropped", 0)
    committed = parallel.get("steps_committed", 0)
    run.wait("a step commits", run.committed_beyond(committed + 1))
    time.sleep(random.uniform(0.0, 0.15))
    victim = run.drafters["drafter-1"]
    victim.killed_on_purpose = True
    victim.kill()
    victim.wait()
    run.say(f"SIGKILLed drafter-1 (members_dropped was {dropped})")
    committed = run.parallel().get("steps_committed", 0)
    run.wait("the two others commit without it",
             lambda: run.members(["drafter-0", "drafter-2"])()
             and run.parallel().get("steps_committed", 0) >= committed + 5)
    after_kill = run.parallel()
    if after_kill.get("members_dropped") != dropped + 1:
        run.fail(f"members_dropped went {dropped} -> {after_kill.get('members_dropped')}, not +1")

    # 2. SIGSTOP another member for longer than --quorum-timeout.
    stopped = run.drafters["drafter-2"]
    stopped.send_signal(signal.SIGSTOP)
    stop_began = time.monotonic()
    committed = run.parallel().get("steps_committed", 0)
    run.say("SIGSTOPped drafter-2")
    run.wait("drafter-0 commits alone while drafter-2 is stopped",
             lambda: run.members(["drafter-0"])()
             and run.parallel().get("steps_committed", 0) >= committed + 3)
    run.say(f"drafter-2 stopped for {time.monotonic() - stop_began:.1f} s (quorum timeout {FAULT_TIMEOUT})")
    stopped.send_signal(signal.SIGCONT)
    heals = run.parallel().get("heals", 0)
    run.wait("drafter-2 healed and back in",
             lambda: run.members(["drafter-0", "drafter-2"])()
             and run.parallel().get("heals", 0) > heals)

    # 3. A fourth drafter joins.
    run.start_drafter(3)
    run.wait("drafter-3 joined", run.members(["drafter-0", "drafter-2", "drafter-3"]))
    before_restart = run.parallel()

    # 4. kill -9 the broker, start it again on its state dir. Its counters
    # start again at 0, so this instance's are checked now.
    for counter in ("checksum_mismatches", "splits", "rollbacks"):
        if before_restart.get(counter, 0) != 0:
            run.fail(f"before the broker's restart: {counter} {before_restart.get(counter)}")
    run.broker.kill()
    run.broker.wait()
    run.say(f"broker killed (-9) at committed step {before_restart.get('committed_step')}")
    run.start_broker()
    run.say(f"broker restarted on {run.address}")
    run.wait("the members commit on the restarted broker",
             lambda: run.parallel().get("committed_step", 0) > before_restart.get("committed_step", 0))

    # The run ends.
    run.wait("the run is COMPLETE",
             lambda: (run.status() or {}).get("state") in ("COMPLETE", "BROKER_STATE_COMPLETE", 3),
             timeout=900)
    exits = {}
    for name, child in {**run.drafters, **run.targets}.items():
        if getattr(child, "killed_on_purpose", False):
            continue
        try:
            exits[name] = child.wait(timeout=120)
        except subprocess.TimeoutExpired:
            exits[name] = "still running"
    status = run.status()
    run.stop_all()

    summary = status.get("summary") or {}
    sync = status.get("model_sync") or {}
    parallel = status.get("lighthouse") or {}
    produced = {}
    for target in status.get("targets", []):
        produced[target["target_id"]] = target.get("highest_seq", -1) + 1
    trained = committed_keys(run.broker_logs)
    expected = {(target, seq) for target, count in produced.items() for seq in range(count)}
    missing = sorted(expected - trained.keys())
    strangers = sorted(trained.keys() - expected)
    twice = sorted(key for key, steps in trained.items() if len(steps) > 1)
    total = sum(produced.values())
    print(json.dumps({
        "produced": produced, "demo_samples": lines,
        "acked_items": summary.get("acked_items"), "dead_letters": summary.get("dead_letters"),
        "model_samples": sync.get("model_samples"),
        "data_parallel_before_restart": before_restart,
        "data_parallel": parallel,
        "samples_in_committed_steps": len(trained),
        "missing": missing[:10], "in_two_steps": twice[:10], "never_produced": strangers[:10],
        "exits": {name: getattr(code, "__str__", lambda: code)() for name, code in exits.items()},
        "seconds": round(time.monotonic() - run.started, 1),
    }, indent=2))
    problems = []
    if total != lines:
        problems.append(f"produced {total} of the demo's {lines} samples")
    if summary.get("dead_letters", 0) != 0:
        problems.append(f"{summary.get('dead_letters')} dead letters")
    for counter in ("checksum_mismatches", "splits", "rollbacks"):
        if parallel.get(counter, 0) != 0:
            problems.append(f"{counter} {parallel.get(counter)}")
    if missing or twice or strangers:
        problems.append(f"{len(missing)} samples in no committed step, {len(twice)} in two, "
                        f"{len(strangers)} never produced")
    if sync.get("model_samples") != total:
        problems.append(f"model_samples {sync.get('model_samples')} != produced {total}")
    bad_exits = {name: code for name, code in exits.items() if code != 0}
    if bad_exits:
        problems.append(f"exits {bad_exits}")
    if not (work / "model" / "config.json").exists():
        problems.append(f"no model at {work / 'model'}")
    if problems:
        print("operator-faults: FAILED: " + "; ".join(problems))
        sys.exit(1)
    print(f"operator-faults: OK: {total} samples, each in exactly one committed step")


if __name__ == "__main__":
    main()
