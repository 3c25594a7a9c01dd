"""`tierd bench workload --in-process`: the workload bench's cases and arms through vLLM's engine
in processes of the bench's own (``tierd.bench.workload_engine_child``), with no HTTP server: what
the connector costs the engine itself, with less of the host's noise in it.

Through `vllm serve` a run's time also holds the API server's, the engine core's and the
worker's waits for each other on two shared cores, and their polling; here each arm is one
process that schedules and runs the forward pass on one thread (the engine core in-process),
bound to the OpenMP cores, so a run's time is the engine's work, its CPU time nearly its wall
time, and the arms differ only by the connector (each tierd arm's daemon runs on the other cores,
as under the serve bench). Every repeat starts new engine processes and daemons: a process keeps
its own speed for its life (two alike, interleaved run by run, kept a steady 5-8% apart here),
so each repeat draws that anew. The clients are a closed loop inside the engine's process
(``--concurrency`` requests kept in it), the workloads the serve bench's sent as token ids, so
two arms that schedule alike run the same steps. Reported as the serve bench reports (the same
targets and limits, the control, the tierd arms against both vLLM alone), with: TTFT from a
request's submission to the step that sampled its first token; the decode phase, first token
to last; steps and prompt tokens computed per request; CPU per request the engine's process and
its daemon's. Not measured here: vLLM's queue and prefill phases, its own hit rates (its
prefix-cache hits and the connector's show in the prompt tokens computed), the connector's
hooks one by one (``--hook-times``), per-step logs (``--steps``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from typing import IO, Any

from tierd.bench.tierd_serve import TierdServe
from tierd.bench.workload_cores import Cores, confine_process, lower_priority
from tierd.bench.workload_report import HitRates, Sample, Timing, percentile, tierd_hit_rate

CHILD = "tierd.bench.workload_engine_child"


class _Engine:
    """One arm's engine process (``workload_engine_child``), its log (vLLM's too) appended to
    ``log``; its standard output carries only the bench's lines."""

    def __init__(self, arm: str, config: dict[str, Any], cores: Cores, log: IO[bytes]) -> None:
        self.arm, self.log_path = arm, log.name
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
               "VLLM_LOGGING_STREAM": "ext://sys.stderr",
               "VLLM_CPU_OMP_THREADS_BIND": cores.bind, "OMP_NUM_THREADS": str(len(cores.omp)),
               "PYTHONHASHSEED": "0", "TIERD_CONFIG": ""}
        self.process = subprocess.Popen([sys.executable, "-m", CHILD, json.dumps(config)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=log, env=env, text=True)

    def _line(self, prefix: str) -> str:
        """The next line of the child's output that starts with ``prefix`` (what follows it)."""
        assert self.process.stdout is not None
        while line := self.process.stdout.readline():
            if line.startswith(prefix):
                return line[len(prefix):].strip()
        raise RuntimeError(f"the {self.arm} engine exited ({self.process.wait()}); see "
                           f"{self.log_path}")

    def ready(self, cores: Cores) -> None:
        """Wait for the engine to be up and warm (started on every core, the engines side by
        side); then every thread of it on the OpenMP cores."""
        self._line("READY")
        confine_process(self.process.pid, cores.omp)

    def run(self, case: dict[str, Any]) -> dict[str, Any]:
        """Run ``case`` (``workload_engine_child.Case`` fields); its ``Run`` as a dict."""
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(case) + "\n")
        self.process.stdin.flush()
        result: dict[str, Any] = json.loads(self._line("RESULT "))
        return result

    def stop(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _cpu_seconds(pid: int | None) -> float:
    if pid is None:
        return 0.0
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timing(run: dict[str, Any], daemon_cpu: float) -> Timing:
    """The serve bench's ``Timing`` of one in-process run (its daemon's CPU added)."""
    done = run["completed"]
    ms = [t * 1e3 for t in run["ttfts_s"]]

    def per(value: float) -> float:
        return value / done if done else math.nan

    return Timing(done, 0, run["wall_s"], done / run["wall_s"],
                  run["output_tokens"] / run["wall_s"], percentile(ms, 50), percentile(ms, 90),
                  percentile(ms, 99), cpu_seconds=run["cpu_s"] + daemon_cpu,
                  decode_ms=run["decode_s"] * 1e3, steps_per_request=per(run["steps"]),
                  computed_tokens=per(run["prompt_tokens"] - run["cached_tokens"]))


def run_in_process(args: argparse.Namespace, cases: list[Any], model: str, max_len: int,
                   cores: Cores, connector: dict[str, object]) -> list[Sample]:
    """Every repeat of every case (``workload.Case``, its ``spec``) on every arm, new engines
    and daemons each repeat; the samples."""
    from tierd.bench.workload import SEED

    workdir = tempfile.mkdtemp(prefix="tierd-bwe-")
    samples: list[Sample] = []
    failed = True
    try:
        with open(os.path.join(workdir, "engines.log"), "ab") as log:
            for repeat in range(args.repeats):
                samples += _repeat(args, repeat, cases, model, max_len, cores, connector,
                                   workdir, log, SEED + 100 * repeat)
        failed = False
    finally:
        if failed or args.keep_logs:
            print(f"tierd bench workload: logs kept in {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return samples


def _repeat(args: argparse.Namespace, repeat: int, cases: list[Any], model: str, max_len: int,
            cores: Cores, connector: dict[str, object], workdir: str, log: IO[bytes],
            seed: int) -> list[Sample]:
    from tierd.bench.workload import tierd_counts

    daemons = {arm: TierdServe(workdir, ["--dram-bytes", "512MiB", "--ssd-dir", ""],
                               socket_path=os.path.join(workdir, f"{arm}.sock"))
               for arm in args.arms if arm.startswith("tierd")}
    engines: dict[str, _Engine] = {}
    samples: list[Sample] = []
    try:
        for started in daemons.values():
            started_pid = started.start().pid
            confine_process(started_pid, cores.others)
            lower_priority(started_pid, args.daemon_nice)
        for arm in args.arms:
            config = {"model": model, "max_model_len": max_len,
                      "kv_blocks": args.kv_small if arm.endswith("small") else args.kv_big,
                      "socket_path": daemons[arm].socket_path if arm in daemons else None,
                      "engine_name": arm, "connector": connector}
            engines[arm] = _Engine(arm, config, cores, log)
        for engine in engines.values():
            engine.ready(cores)
        for index, case in enumerate(cases):
            shift = (repeat + index) % len(case.arms)
            for arm in case.arms[shift:] + case.arms[:shift]:
                daemon = daemons.get(arm)
                pid = daemon.process.pid if daemon and daemon.process else None
                asked, cpu = tierd_counts(daemon), _cpu_seconds(pid)
                run = engines[arm].run({**case.spec, "seed": seed + index})
                cpu = _cpu_seconds(pid) - cpu
                rate = tierd_hit_rate(asked, tierd_counts(daemon))
                sample = Sample(case.name, arm, repeat, timing(run, cpu),
                                HitRates(None, None, rate))
                samples.append(sample)
                print(f"  repeat {repeat + 1} {case.name:<16} {arm:<12} "
                      f"{sample.timing.request_throughput:6.2f} req/s, TTFT p50 "
                      f"{sample.timing.ttft_p50_ms:6.0f} ms", flush=True)
    finally:
        for engine in engines.values():
            engine.stop()
        for daemon in daemons.values():
            daemon.stop()
    return samples


def cpu_lines(samples: list[Sample]) -> list[str]:
    """Per case and pair of arms a target compares: CPU per request of the first arm's engine
    process and daemon minus the second's (median over the repeats)."""
    from tierd.bench.workload_report import ARM_TITLES, compared_runs

    lines = []
    for case, top, bottom, both in compared_runs(samples, lambda s: s.timing):
        diff = statistics.median(a.cpu_ms_per_request - b.cpu_ms_per_request for a, b in both)
        lines.append(f"  {case:<24} {ARM_TITLES[top]} - {ARM_TITLES[bottom]}: "
                     f"{diff:+.2f} ms per request")
    return lines
