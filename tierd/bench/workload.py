"""`tierd bench workload`: many users, shared prefixes in random order, an engine KV cache
smaller than the working set, through real `vllm serve` (vLLM's CPU build, the small Llama of
``tierd.bench.tiny_llama``).

Four `vllm serve` instances (``tierd.bench.workload_report.ARMS``): vLLM alone and vLLM +
TierdConnector, each with a KV cache well below the working set (``--kv-small`` blocks: the
pressure scenario) and with one that holds everything (``--kv-big``: the fits scenario); each
tierd arm has its own `tierd serve` (DRAM only, above the working set, its arena prefaulted at
start as by default; the connector writes back, ``ARM_DEFAULTS``). Every instance binds its
OpenMP threads to the same cores (``VLLM_CPU_OMP_THREADS_BIND``, checked in its log: vLLM
reserves one more core when a KV connector is configured, so left to itself the connector arm
binds other cores than vLLM alone does): all but the first by default, and the other servers
(vLLM's API server and scheduler, the daemons) run on the cores left
(``tierd.bench.workload_cores``), as vLLM's own default reserves a core for an engine alone;
the client runs anywhere. On those cores vLLM's engine core and the
daemons run at a lower priority than the API server, so the engine core's polling seldom starves
it (``workload_cores``: that made whole runs of any arm fall to about half their throughput).

Cases, each run on its arms in turn, the arms' order rotated every repeat so the host's noise
falls on all of them:

- ``prefix P cC``: vLLM's own ``vllm bench serve --dataset-name prefix_repetition`` (``N``
  prefixes of ``P`` tokens, each followed by its own suffix, in random order), ``C`` clients;
  at ``--prefix-len`` and every ``--concurrency`` on all four arms, at every other
  ``--gain-prefix-lens`` on the two small-cache arms (how the gain grows with prefix length);
- ``chat cC``: the multi-turn chat client of ``tierd.bench.workload_chat``.

A repeat uses new words (a new seed) in every case, the same for every arm, and empties vLLM's
prefix cache first, with its connector's (a tierd arm forgets the blocks only vLLM held, so no
run writes back the one before it: each starts as a fresh engine would); every run starts the
same time after the one before it, whichever arm that was (a tierd arm's last Commits land
meanwhile, then ``QUIET_SECONDS`` more let the previous arm's processes go idle). Per run:
request and output-token throughput, TTFT p50/p90/p99, failures, vLLM's local and external
prefix-hit rates and tierd's hit ratio over the run (the last two should agree), and vLLM's own
per-request means of the time a request waits to be scheduled, takes to its first token and from
there to its last, with the engine's steps and the prompt tokens it computed per request
(neither hit locally nor loaded), and the CPU time per request of the arm's processes (vLLM's
worker and engine core poll for each other's messages between steps, so where they keep their
cores busy that tracks the run's length rather than the work: its ratio follows the
throughput's). Then the targets as ratios of the arms' runs in each repeat, judged on their
median (``tierd.bench.workload_report.TARGETS``); a target some of whose repeats meet its limit
and others miss it is marked as straddled: the host's noise between repeats exceeds the margin,
and this run does not settle it. Beside them, for each pair of arms a target compares, how much
longer the first arm's requests spent in each of those phases: where a missed target's time went
(a lookup answered "not yet" adds queueing; a cost every step pays, decoding), whether the first
computed more of its prompts (a hit lost), and where its CPU went (vLLM's API server, engine
core and worker, and the daemon, ``workload_profile.cpu_lines``). With ``--steps``, vLLM logs
every engine step and the same pairs compare the forward passes' time per request, per kind of
step (``tierd.bench.workload_steps``). With ``--control``, a fifth server
(``workload_report.CONTROL``), a second vLLM alone configured as the one with the cache that
fits, runs in every case that one runs and is held to the fits limits against it: two servers
that differ in nothing show how far this host's noise alone moves those ratios in this run; and
each tierd arm is set against both at once, the pressure and fits ratios estimated with how
narrowly the run places them (``workload_report.against_both``). A `vllm serve` keeps its own
speed for its whole life, and two alike can differ by up to a tenth on a shared host: with
``--fresh-servers`` every repeat starts new servers and daemons, so each repeat draws that luck
anew instead of every repeat sharing one draw. With ``--in-process`` the same cases and arms run
through vLLM's engine in processes of the bench's own, no HTTP server
(``tierd.bench.workload_engine``). Run it with ``make bench-workload``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

from tierd.bench.workload_chat import ChatShape
from tierd.bench.workload_cores import BACKEND_NICE
from tierd.bench.workload_output import Output
from tierd.bench.workload_profile import cpu_lines
from tierd.bench.workload_report import (
    ARMS,
    CONTROL,
    HitRates,
    Sample,
    Timing,
    against_both,
    as_json,
    bound_cores,
    phase_lines,
    summary,
    table,
    tierd_hit_rate,
    verdict_lines,
    verdicts,
    vllm_hit_rates,
    vllm_phases,
)
from tierd.bench.workload_steps import step_lines

if TYPE_CHECKING:
    from tierd.bench.serve_stack import VllmServe
    from tierd.bench.tierd_serve import TierdServe
    from tierd.bench.workload_cores import Cores

HELP = ("Many users through real vllm serve: vLLM alone vs vLLM + tierd, a KV cache below the "
        "working set and one that holds it (prefix_repetition, multi-turn chat).")

SEED = 1_000

QUIET_SECONDS = 1.5
"""Pause before every run: vLLM's engine core and worker poll their queues for a second after
their last message (its shared-memory queues' busy loop), so a run started at once would share
the cores with the previous arm's polling."""


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


BENCH_KEYS = ("socket_path", "engine_name")
"""``kv_connector_extra_config`` keys the bench sets itself for every tierd arm."""

ARM_DEFAULTS: dict[str, object] = {"save_policy": "write_back"}
"""``kv_connector_extra_config`` of every tierd arm unless ``--connector-config`` says otherwise:
each arm is one engine with a daemon of its own, where write-back is the policy to choose."""


def arm_config(given: dict[str, object]) -> dict[str, object]:
    """The tierd arms' ``kv_connector_extra_config``: ``ARM_DEFAULTS`` under ``given``."""
    return {**ARM_DEFAULTS, **given}


def _connector_config(text: str) -> dict[str, object]:
    """``--connector-config``: a JSON object of TierdConnector's ``kv_connector_extra_config``
    keys (``argparse.ArgumentTypeError`` naming the fix for anything else)."""
    from tierd.connector.vllm.config import TierdVllmConfig

    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}): give an object, e.g. "
                                         "'{\"save\": false}'") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("give a JSON object of kv_connector_extra_config keys, "
                                         "e.g. '{\"save\": false}'")
    ours = sorted(set(value) & set(BENCH_KEYS))
    if ours:
        raise argparse.ArgumentTypeError(f"the bench sets {ours} itself for each tierd arm; "
                                         "drop them")
    try:
        TierdVllmConfig.from_extra_config(value)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=int, default=5, help="repeats of every run (5)")
    parser.add_argument("--concurrency", type=_ints, default=[4, 16],
                        help="clients, comma-separated (4,16)")
    parser.add_argument("--prefix-len", type=int, default=1024,
                        help="prefix_repetition: tokens of each shared prefix (1024)")
    parser.add_argument("--gain-prefix-lens", type=_ints, default=[256, 2048],
                        help="other prefix lengths run on the small-cache arms only, at the "
                             "first concurrency (256,2048)")
    parser.add_argument("--suffix-len", type=int, default=64,
                        help="prefix_repetition: tokens after the prefix (64)")
    parser.add_argument("--output-len", type=int, default=24,
                        help="tokens a request generates at most (24)")
    parser.add_argument("--output-min", type=int, default=8,
                        help="tokens a request generates before a stop token may end it (8)")
    parser.add_argument("--stop-every", type=int, default=8,
                        help="every this-many-th word is a stop token, so output lengths "
                             "differ per prompt, 15 tokens on average by default (8; 0: every "
                             "request generates --output-len tokens)")
    parser.add_argument("--prefixes", type=int, default=24,
                        help="prefix_repetition: distinct prefixes (24)")
    parser.add_argument("--prompts-per-prefix", type=int, default=4,
                        help="prefix_repetition: requests per prefix (4)")
    parser.add_argument("--chat-users", type=int, default=24, help="chat: conversations (24)")
    parser.add_argument("--chat-turns", type=int, default=4, help="chat: turns per user (4)")
    parser.add_argument("--chat-system", type=int, default=512,
                        help="chat: tokens of the shared system prompt (512)")
    parser.add_argument("--chat-message", type=int, default=256,
                        help="chat: tokens of each user message (256)")
    parser.add_argument("--kv-small", type=int, default=256,
                        help="KV blocks (32 tokens) of the pressure scenario (256)")
    parser.add_argument("--kv-big", type=int, default=4096,
                        help="KV blocks of the fits scenario (4096)")
    parser.add_argument("--cpus", default=None,
                        help="cores every vllm serve's OpenMP threads bind "
                             "(VLLM_CPU_OMP_THREADS_BIND, e.g. 1-3; default: all of this "
                             "host's but the first)")
    parser.add_argument("--other-cpus", default=None,
                        help="cores of the other servers: vLLM's API server and scheduler, the "
                             "daemons (default: the host's cores --cpus leaves, or all where it "
                             "leaves none); the client runs on any core")
    parser.add_argument("--arms", type=lambda t: t.split(","), default=list(ARMS),
                        help="arms to run, comma-separated (all: " + ",".join(ARMS) + ")")
    parser.add_argument("--no-chat", action="store_true", help="skip the chat cases")
    parser.add_argument("--control", action="store_true",
                        help="add a second vLLM alone with the cache that fits, held to the "
                             "fits limits against the first: what the host's noise alone makes "
                             "of a ratio in this run; each tierd arm is then also set against "
                             "both, with a 95%% interval over the repeats")
    parser.add_argument("--profile", action="store_true",
                        help="after the repeats, run every case once more on each vLLM + tierd "
                             "arm under py-spy and print the connector hooks' share of vLLM's "
                             "scheduler and worker loops (needs py-spy: pip install py-spy)")
    parser.add_argument("--hook-times", action="store_true",
                        help="time every TierdConnector hook in the tierd arms' servers and "
                             "print the hooks' time per engine step (about 2 us more a call)")
    parser.add_argument("--steps", action="store_true",
                        help="log every engine step (vLLM's --enable-logging-iteration-details) "
                             "and compare the arms' step times per kind of step")
    parser.add_argument("--fresh-servers", action="store_true",
                        help="start every server and daemon anew for each repeat: a `vllm serve` "
                             "keeps its own speed for its life (up to a tenth apart between two "
                             "alike on a shared host), so with the same servers throughout, "
                             "every repeat draws on the same luck (a minute or two more a repeat)")
    parser.add_argument("--daemon-nice", type=int, default=BACKEND_NICE,
                        choices=range(-20, 20), metavar="-20..19",
                        help="niceness of the tierd daemons on the other servers' cores "
                             f"({BACKEND_NICE}, as vLLM's engine core; the API server runs at 0)")
    parser.add_argument("--connector-config", type=_connector_config, default={},
                        help="more kv_connector_extra_config keys for every tierd arm, as a JSON "
                             "object, over the bench's own ({\"save_policy\": \"write_back\"}; "
                             "e.g. '{\"save_policy\": \"write_through\"}', or "
                             "'{\"save\": false, \"load\": false}': the connector in place, "
                             "doing nothing)")
    parser.add_argument("--in-process", action="store_true",
                        help="run the same cases and arms through vLLM's engine in processes of "
                             "the bench's own, no HTTP server, new ones every repeat: what the "
                             "connector costs the engine, with less of the host's noise "
                             "(tierd.bench.workload_engine); not with --profile, --hook-times "
                             "or --steps")
    parser.add_argument("--keep-logs", action="store_true", help="keep the servers' logs")
    parser.add_argument("--json", action="store_true", help="print every run as JSON too")


@dataclass(frozen=True)
class Case:
    name: str
    arms: tuple[str, ...]
    judged: frozenset[str]
    """The target groups whose limits apply here ("pressure", "fits"; the others' ratios are
    shown): pressure only where the small cache holds every running request (else its arms are
    limited by the batch the cache holds, not by the prefixes it keeps)."""
    drive: Callable[..., Timing]
    """(server, seed) -> the client's figures."""
    spec: dict[str, object]
    """The same workload for ``--in-process`` (``workload_engine_child.Case`` but its seed)."""


def _cases(args: argparse.Namespace, model: str, workdir: str) -> list[Case]:
    from tierd.bench.serve_stack import BLOCK
    from tierd.bench.workload_chat import run_chat
    from tierd.bench.workload_serve import prefix_repetition

    fits = ARMS + (CONTROL,)  # where the control runs (if asked for)

    def judge(request_tokens: int, clients: int) -> frozenset[str]:
        running = clients * -(-request_tokens // BLOCK)
        return frozenset({"fits", "pressure"} if running <= args.kv_small else {"fits"})

    cases = []
    small = ("vllm-small", "tierd-small")
    output = Output(args.output_len, args.output_min, args.stop_every)
    shape = ChatShape(args.chat_users, args.chat_turns, args.chat_system, args.chat_message,
                      args.output_len)
    replies = {"output_len": args.output_len, "output_min": args.output_min,
               "stop_every": args.stop_every}
    lens = [args.prefix_len] + [p for p in args.gain_prefix_lens if p != args.prefix_len]
    for c in args.concurrency:
        for p in lens if c == args.concurrency[0] else lens[:1]:
            def drive(server, seed, c=c, p=p):  # type: ignore[no-untyped-def]
                return prefix_repetition(server, model, workdir, seed=seed, concurrency=c,
                                         prefix_len=p, suffix_len=args.suffix_len,
                                         output=output, prefixes=args.prefixes,
                                         prompts=args.prefixes * args.prompts_per_prefix)
            main = p == args.prefix_len
            request = p + args.suffix_len + args.output_len
            spec = {"kind": "prefix", "clients": c, **replies, "prefix_len": p,
                    "suffix_len": args.suffix_len, "prefixes": args.prefixes,
                    "prompts": args.prefixes * args.prompts_per_prefix}
            cases.append(Case(f"prefix {p} c{c}", fits if main else small,
                              judge(request, c) if main else frozenset(), drive, spec))
    for c in [] if args.no_chat else args.concurrency[:1]:
        spec = {"kind": "chat", "clients": c, **replies, "users": shape.users,
                "turns": shape.turns, "system_tokens": shape.system_tokens,
                "user_tokens": shape.user_tokens}
        cases.append(Case(f"chat c{c}", fits, judge(shape.longest_prompt() + args.output_len, c),
                          lambda server, seed, c=c: run_chat(server, shape, output, c, seed),
                          spec))
    picked = [replace(c, arms=tuple(a for a in c.arms if a in args.arms)) for c in cases]
    return [c for c in picked if c.arms]


def _check(args: argparse.Namespace) -> int:
    """The longest prompt a case sends (ValueError naming the flag when a size cannot work)."""
    if args.repeats < 1 or not args.concurrency or min(args.concurrency) < 1:
        raise ValueError("need --repeats >= 1 and --concurrency of clients >= 1")
    Output(args.output_len, args.output_min, args.stop_every)  # ValueError naming the flags
    if not args.arms or set(args.arms) - set(ARMS):
        raise ValueError(f"--arms takes some of {','.join(ARMS)}, not {','.join(args.arms)}")
    if args.in_process and (args.profile or args.hook_times or args.steps):
        raise ValueError("--in-process runs no vllm serve: drop --profile, --hook-times and "
                         "--steps, or --in-process")
    if args.control and "vllm-big" not in args.arms:
        raise ValueError("--control compares a second vLLM alone with vllm-big: keep vllm-big "
                         "in --arms")
    longest = max([args.prefix_len, *args.gain_prefix_lens]) + args.suffix_len
    if not args.no_chat:
        longest = max(longest, ChatShape(args.chat_users, args.chat_turns, args.chat_system,
                                         args.chat_message, args.output_len).longest_prompt())
    # vLLM refuses a prompt of more than 5 characters a token before tokenizing it, and the
    # small Llama's words are about 6 characters with their space: room for twice the tokens.
    from tierd.bench.serve_stack import BLOCK

    length = int(2 * (longest + args.output_len) + 64)
    if args.kv_small * BLOCK < length:
        raise ValueError(f"--kv-small {args.kv_small} blocks hold {args.kv_small * BLOCK} tokens, "
                         f"less than vLLM's --max-model-len here ({length}, twice the longest "
                         "request): raise it or shorten the prompts")
    return length


def run(args: argparse.Namespace) -> int:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise ValueError("tierd bench workload needs vLLM's CPU build in this Python: run it "
                         "with `make bench-workload`")
    from tierd.bench.serve_stack import VllmServe, wait_for
    from tierd.bench.tierd_serve import TierdServe
    from tierd.bench.tiny_llama import build
    from tierd.bench.workload_cores import plan
    from tierd.bench.workload_hooks import run_hooks
    from tierd.bench.workload_profile import cpu_split
    from tierd.bench.workload_steps import FLAG as STEPS_FLAG
    from tierd.bench.workload_steps import log_size, steps_since
    from tierd.connector.core.hook_times import ENV as HOOK_TIMES_ENV
    from tierd.connector.core.hook_times import read_times
    from tierd.connector.vllm.connector.filtered import REPORT_SECONDS

    max_len = _check(args)
    if args.control:
        args.arms = [*args.arms, CONTROL]
    if args.profile:
        from tierd.bench.workload_profile import py_spy

        py_spy()  # fail before starting anything when it is missing
    profiles: list[str] = []
    cores = plan(args.cpus, args.other_cpus)
    model = build(os.path.expanduser("~/.cache/tierd/test-models"), "tiny-llama-v2-seed0", seed=0)
    if args.in_process:
        from tierd.bench.workload_engine import run_in_process

        cases = _cases(args, model, "")
        return _report(args, run_in_process(args, cases, model, max_len, cores,
                                            arm_config(args.connector_config)),
                       cases, cores, profiles)
    workdir = tempfile.mkdtemp(prefix="tierd-bw-")
    # DRAM only, each arena prefaulted at start as the daemon's default does: a page first
    # touched by a save would otherwise fault in vLLM's worker, on the forward pass's core.
    daemons = {arm: TierdServe(workdir, ["--dram-bytes", "512MiB", "--ssd-dir", ""],
                               socket_path=os.path.join(workdir, f"{arm}.sock"))
               for arm in args.arms if arm.startswith("tierd")}
    env = {"VLLM_CPU_OMP_THREADS_BIND": cores.bind, "VLLM_SERVER_DEV_MODE": "1"}
    hook_dirs = {arm: os.path.join(workdir, f"hooks-{arm}") for arm in daemons
                 if args.hook_times}
    connector_config = arm_config(args.connector_config)
    servers = {arm: VllmServe(sys.executable, workdir, model, "tiny", arm,
                              daemons[arm].socket_path if arm in daemons else None,
                              max_model_len=max_len,
                              env={**env, HOOK_TIMES_ENV: hook_dirs[arm]} if arm in hook_dirs
                              else env,
                              kv_blocks=args.kv_small if arm.endswith("small") else args.kv_big,
                              flags=[STEPS_FLAG] if args.steps else [],
                              connector_config=connector_config)
               for arm in args.arms}
    samples: list[Sample] = []
    failed = True
    try:
        _up(daemons, servers, cores, max_len, workdir, args.daemon_nice, show=True)
        cases = _cases(args, model, workdir)
        for repeat in range(args.repeats):
            if args.fresh_servers and repeat:  # new processes: a server's own speed is drawn anew
                _down(daemons, servers)
                _up(daemons, servers, cores, max_len, workdir, args.daemon_nice,
                    show=False)
            for index, case in enumerate(cases):
                shift = (repeat + index) % len(case.arms)
                for arm in case.arms[shift:] + case.arms[:shift]:
                    server = servers[arm]
                    wait_for("vLLM's prefix cache emptied", server.reset_prefix_cache, 60)
                    time.sleep(QUIET_SECONDS)
                    tierd = daemons.get(arm)
                    metrics = server.metrics_text()
                    asked = tierd_counts(tierd)
                    pid = tierd.process.pid if tierd is not None and tierd.process else None
                    cpu = cpu_split(server, pid)
                    logged = log_size(server.log_path)
                    hooked = read_times(hook_dirs[arm]) if arm in hook_dirs else None
                    timing = case.drive(server, SEED + 100 * repeat + index)
                    after = server.metrics_text()
                    cpu = cpu_split(server, pid) - cpu
                    timing = replace(timing, cpu_seconds=cpu.total,
                                     **asdict(vllm_phases(metrics, after)))
                    local, external = vllm_hit_rates(metrics, after)
                    # a tierd arm's last Commits and filtered lookups land off the request
                    # path meanwhile; every arm waits alike, so each run follows the one
                    # before it after the same pause
                    time.sleep(REPORT_SECONDS + 0.5)
                    hits = HitRates(local, external, tierd_hit_rate(asked, tierd_counts(tierd)))
                    steps = steps_since(server.log_path, logged) if args.steps else None
                    # read after the pause: the sums are written since
                    hooks = (run_hooks(hooked, read_times(hook_dirs[arm])) if hooked is not None
                             else None)
                    samples.append(Sample(case.name, arm, repeat, timing, hits, steps, cpu,
                                          hooks))
                    print(f"  repeat {repeat + 1} {case.name:<16} {arm:<12} "
                          f"{timing.request_throughput:6.2f} req/s, TTFT p50 "
                          f"{timing.ttft_p50_ms:6.0f} ms, {timing.failed} failed", flush=True)
        if args.profile:
            profiles = _profile(cases, servers, workdir, args.repeats)
        failed = False
    finally:
        _down(daemons, servers)
        if failed or args.keep_logs:
            print(f"tierd bench workload: logs kept in {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return _report(args, samples, cases, cores, profiles)


def _up(daemons: dict[str, TierdServe], servers: dict[str, VllmServe], cores: Cores,
        max_len: int, workdir: str, daemon_nice: int, show: bool) -> None:
    """Start every daemon and server, each on its cores at its priority
    (``tierd.bench.workload_cores``), check that every arm bound the same OpenMP cores (printed
    with ``show``), and send each server its first requests (they compile and fill allocator
    pools)."""
    from tierd.bench.tiny_llama import prompt
    from tierd.bench.workload_cores import (
        ENGINE_CORE,
        confine_group,
        confine_process,
        lower_group,
        lower_priority,
    )

    for daemon in daemons.values():
        started = daemon.start().pid
        confine_process(started, cores.others)
        lower_priority(started, daemon_nice)
    for server in servers.values():
        server.start()
    for server in servers.values():
        server.wait_ready()
        assert server.process is not None
        confine_group(server.process.pid, cores)
        lowered = lower_group(server.process.pid)
        if lowered != 1:
            raise AssertionError(f"{server.engine}'s vllm serve has {lowered} "
                                 f"{ENGINE_CORE} processes, not one; see {workdir}")
    binds = {arm: bound_cores(_read(s.log_path)) for arm, s in servers.items()}
    if show:
        print(f"OpenMP binding (reserve_cpu_num, core ids) per arm: {binds}")
    if len({str(b[1]) if b else None for b in binds.values()}) != 1 or None in binds.values():
        raise AssertionError(f"the arms bound different cores: {binds}; see {workdir}")
    for server in servers.values():
        for i in range(2):
            server.complete(prompt(max_len // 2, seed=SEED - 1 - i), 4)


def _down(daemons: dict[str, TierdServe], servers: dict[str, VllmServe]) -> None:
    """Stop every server, then every daemon (a stopped one may be started again)."""
    for server in servers.values():
        server.stop()
    for daemon in daemons.values():
        daemon.stop()


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def tierd_counts(daemon: TierdServe | None) -> tuple[int, int]:
    """(query tokens, hit tokens) of a tierd arm's daemon; (0, 0) for vLLM alone."""
    if daemon is None:
        return (0, 0)
    stats = daemon.stats()
    return (stats.query_tokens, stats.hit_tokens)


def _profile(cases: list[Case], servers: dict[str, VllmServe], workdir: str,
             repeats: int) -> list[str]:
    """One more run of every case on each vLLM + tierd arm, profiled: a line per run."""
    from tierd.bench.serve_stack import wait_for
    from tierd.bench.workload_profile import profile_line, profiled

    lines = []
    for index, case in enumerate(cases):
        for arm in (a for a in case.arms if a.startswith("tierd")):
            server = servers[arm]
            wait_for("vLLM's prefix cache emptied", server.reset_prefix_cache, 60)
            timing, found = profiled(server, workdir, lambda: case.drive(
                server, SEED + 100 * repeats + index))
            lines.append(profile_line(arm, case.name, found)
                         + f"; {timing.request_throughput:.2f} req/s under the profiler")
    return lines


def _report(args: argparse.Namespace, samples: list[Sample], cases: list[Case],
            cores: Cores, profiles: list[str]) -> int:
    found = verdicts(samples, {c.name: c.judged for c in cases})
    if args.json:
        print(json.dumps([as_json(s) for s in samples], indent=1))
    others = ",".join(str(c) for c in cores.others)
    where = (f"vLLM's engine in-process (its CPU build, the small Llama; each arm one process on "
             f"cores {cores.bind}, its clients inside it; the daemons on {others}; new engines "
             "and daemons every repeat)" if args.in_process else
             f"real vllm serve (vLLM's CPU build, the small Llama, OpenMP on cores {cores.bind}, "
             f"the other servers on {others}, the client on any)")
    print(f"\n{where}, "
          f"medians of {args.repeats} interleaved repeats; KV blocks of 32 tokens: "
          f"small {args.kv_small}, fits {args.kv_big}"
          + f"; the tierd arms' connector with {json.dumps(arm_config(args.connector_config))}:")
    with contextlib.suppress(BrokenPipeError):
        for line in table(samples):
            print(line)
        print("ratios (each repeat's pair of runs; median, then every repeat); pressure is "
              f"judged where the small cache ({args.kv_small} blocks) holds every running "
              "request, fits everywhere:")
        for line in verdict_lines(found):
            print(line)
        both = against_both(samples, {c.name: c.judged for c in cases})
        if both:
            print("the tierd arms against both vLLM alone with the cache that fits (over the "
                  "geometric mean of vLLM alone and the control in each run, per repeat over the "
                  "cases the target is judged in, then over the repeats; not a verdict: where "
                  "the target's ratio lies, and how narrowly this run places it):")
            for line in both:
                print(line)
        print("where the arms' requests differ (vLLM's own per-request means: waiting to be "
              "scheduled, scheduled to first token, first to last token; medians over the "
              "repeats):")
        for line in phase_lines(samples):
            print(line)
        if args.in_process:
            from tierd.bench.workload_engine import cpu_lines as engine_cpu_lines

            print("where the arms' CPU goes (CPU time per request of the engine's process and "
                  "its daemon, the first arm's minus the second's; medians over the repeats):")
            for line in engine_cpu_lines(samples):
                print(line)
        else:
            print("where the arms' CPU goes (each part's CPU time per request, the first arm's "
                  "minus the second's; medians over the repeats):")
            for line in cpu_lines(samples):
                print(line)
        if args.hook_times:
            from tierd.bench.workload_hooks import hook_lines

            print("where the connector's hooks hold the engine's steps (wall time per step of "
                  "the worker's hooks and of the scheduler's, their share of the mean step, "
                  "the longest hooks in us a step; medians over the repeats):")
            for line in hook_lines(samples):
                print(line)
        if args.steps:
            print("where the arms' engine steps differ (vLLM's own log of every step: the "
                  "forward passes' time per request, the median step that only decodes and "
                  "that computes prompt tokens, the steps run; the first arm's over the "
                  "second's, median of the repeats, then every repeat):")
            for line in step_lines(samples):
                print(line)
        if profiles:
            print("where vLLM + tierd spends its loops (py-spy, one more run each; shares of "
                  "the scheduler's and the worker's busy loop inside TierdConnector hooks):")
            for line in profiles:
                print(line)
    ok, line = summary(found, sum(s.timing.failed for s in samples))
    print(line)
    return 0 if ok else 1
