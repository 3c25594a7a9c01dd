"""`tierd demo`: the main job (`make demo`). A daemon on embedded defaults, the reference engine
on a multi-turn chat with a long shared system prompt, and the TTFT of each tier.

Steps (each printed live):

1. start a daemon in this process (temporary Unix socket and SSD directory, a small DRAM arena in
   /dev/shm, no Redis; the background flusher off so the demo decides when blocks move down);
2. engine A (with ``TierdHooks``): one cold chat turn (computes the system prompt; its blocks
   are written through to DRAM), then the other users' turns hit it in the hot tier;
3. engine B (a fresh pool: empty hot tier): loads the system prompt from DRAM;
4. one maintain pass at a low watermark demotes every unpinned DRAM block to SSD (checked with
   Lookup); engine C loads the prefix from SSD (the daemon stages it back into DRAM);
5. a table of TTFTs and speed-ups, the tokens agreeing across tiers, then `tierd stats`.

Everything started is stopped on the way out (socket, arena file, SSD directory removed).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from tierd.commands.flags import add_socket_path

if TYPE_CHECKING:
    from rich.console import Console

    from tierd.connector.reference.engine import LLMEngine, Request
    from tierd.connector.reference.tierd_hooks import TierdHooks
    from tierd.daemon.config import TierdConfig
    from tierd.daemon.server import Daemon

HELP = "Run the end-to-end demo on embedded defaults (no Redis needed)."

T = TypeVar("T")


class EmbeddedDaemon:
    """A real daemon (``tierd.daemon.server.Daemon``) on its own event loop in a background
    thread of this process, for the demo, the e2e benchmark and tests.

    ``with EmbeddedDaemon(config) as d:`` starts it (blocking for the arena pre-fault) and stops
    it on exit: socket and arena file removed, SSD index closed. ``call`` runs a coroutine on the
    daemon's loop; ``maintain`` runs one flusher pass."""

    def __init__(self, config: TierdConfig) -> None:
        self.config = config
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tierd-daemon",
                                        daemon=True)
        self.daemon: Daemon | None = None

    def start(self) -> EmbeddedDaemon:
        from tierd.daemon.server import Daemon

        self._thread.start()
        self.daemon = self.call(Daemon.start(self.config))
        return self

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the daemon's loop and wait for its result (60 s at most)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=60)

    def maintain(self) -> None:
        """One flusher pass now (lease expiry; demotion above the high watermark)."""
        assert self.daemon is not None, "start() first"
        self.call(self.daemon.store.maintain())

    def check_integrity(self) -> None:
        assert self.daemon is not None, "start() first"
        store = self.daemon.store

        async def check() -> None:
            store.check_integrity()
        self.call(check())

    def stop(self) -> None:
        """Stop the daemon and its loop. Idempotent."""
        if self.daemon is not None:
            daemon, self.daemon = self.daemon, None
            self.call(daemon.stop(grace=0.5))
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        if not self._loop.is_closed() and not self._loop.is_running():
            self._loop.close()

    def __enter__(self) -> EmbeddedDaemon:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def embedded_config(workdir: str, *, dram_bytes: int, ssd_bytes: int,
                    **overrides: Any) -> TierdConfig:
    """The demo's daemon: socket and SSD directory under ``workdir``, arena in /dev/shm, no TCP,
    no background flusher (``maintain`` is called explicitly), watermarks so low that one
    maintain pass demotes every unpinned DRAM block to SSD."""
    from tierd.daemon.config import TierdConfig

    values: dict[str, Any] = dict(
        socket_path=os.path.join(workdir, "tierd.sock"), dram_bytes=dram_bytes,
        slab_bytes=min(dram_bytes, 4 << 20), prefault=True,
        ssd_dir=os.path.join(workdir, "ssd"), ssd_bytes=ssd_bytes, ssd_io_threads=4,
        maintain_seconds=3600.0, dram_high_watermark=1e-9, dram_low_watermark=1e-9,
        log_level="WARNING")
    values.update(overrides)
    return TierdConfig(**values)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Start a tierd daemon in this process (temporary socket, small DRAM arena, temporary "
        "SSD directory, no Redis), run the reference engine on a multi-turn chat with a long "
        "shared system prompt, and print the time to first token of one prompt computed cold, "
        "hit in the engine's own pool (hot tier), loaded from DRAM and loaded from SSD, the hit "
        "ratios, then `tierd stats`. Leaves nothing running and no file behind.")
    parser.add_argument("--system-tokens", type=int, default=1024, metavar="N",
                        help="Length of the shared system prompt in tokens (default 1024).")
    parser.add_argument("--turn-tokens", type=int, default=48, metavar="N",
                        help="Tokens each user adds per turn (default 48).")
    parser.add_argument("--users", type=int, default=3, metavar="N",
                        help="Chat sessions sharing the system prompt (default 3).")
    parser.add_argument("--turns", type=int, default=2, metavar="N",
                        help="Turns per user (default 2).")
    parser.add_argument("--reply-tokens", type=int, default=8, metavar="N",
                        help="Tokens generated per turn (default 8).")
    parser.add_argument("--layers", type=int, default=4, metavar="N",
                        help="Decoder layers of the reference model (default 4): more layers, "
                             "more KV bytes per token and a slower prefill.")
    parser.add_argument("--dram-mib", type=int, default=128, metavar="MIB",
                        help="DRAM arena of the demo daemon in MiB (default 128).")
    parser.add_argument("--ssd-mib", type=int, default=256, metavar="MIB",
                        help="SSD tier bound of the demo daemon in MiB (default 256).")
    parser.add_argument("--threads", type=int, default=2, metavar="N",
                        help="Torch CPU threads (default 2).")
    add_socket_path(parser, "Use the daemon already serving on this Unix socket instead of "
                            "starting one (the SSD row is then skipped: only an embedded daemon "
                            "can be told to demote).")
    parser.add_argument("--walkthrough", action="store_true",
                        help="Print the memory-planner walk-through instead (no torch, no "
                             "daemon).")


def run(args: argparse.Namespace) -> int:
    if args.walkthrough:
        from tierd.commands import plan

        return plan.walkthrough()
    for name in ("system_tokens", "turn_tokens", "users", "turns", "reply_tokens", "layers",
                 "dram_mib", "ssd_mib", "threads"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    import torch  # noqa: F401  (the engine extra: missing, `tierd` says so before any daemon)
    from rich.console import Console

    console = Console(highlight=False)
    started = time.perf_counter()
    if args.socket is not None:
        _Demo(args, console, args.socket, None).run()
    else:
        workdir = tempfile.mkdtemp(prefix="tierd-demo-")
        try:
            config = embedded_config(workdir, dram_bytes=args.dram_mib << 20,
                                     ssd_bytes=args.ssd_mib << 20)
            console.print(f"[bold]tierd demo[/]: starting a daemon ({args.dram_mib} MiB DRAM "
                          f"arena, {args.ssd_mib} MiB SSD tier in {workdir})")
            with EmbeddedDaemon(config) as daemon:
                _Demo(args, console, config.socket_path, daemon).run()
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    ended = ("the daemon at the socket keeps serving" if args.socket is not None
             else "daemon stopped, socket, arena and SSD directory removed")
    console.print(f"demo finished in {time.perf_counter() - started:.1f} s; {ended}")
    return 0


@dataclass(frozen=True)
class _Row:
    """One TTFT measurement of the probe prompt."""

    source: str
    ttft_s: float
    hot_tokens: int
    loaded_tokens: int
    tokens: tuple[int, ...]


class _Demo:
    """The demo's workload and report (see the module docstring)."""

    def __init__(self, args: argparse.Namespace, console: Console, socket_path: str,
                 daemon: EmbeddedDaemon | None) -> None:
        import torch

        from tierd.connector.reference.model import LlamaModel, ModelConfig

        torch.set_num_threads(args.threads)
        self.args, self.console, self.socket_path, self.daemon = args, console, socket_path, daemon
        self.model = LlamaModel(ModelConfig(num_layers=args.layers))
        gen = torch.Generator().manual_seed(1234)

        def tokens(n: int) -> list[int]:
            out: list[int] = torch.randint(0, self.model.cfg.vocab_size, (n,),
                                           generator=gen).tolist()
            return out
        self.tokens = tokens
        self.system = tokens(args.system_tokens)
        conversation = args.system_tokens + args.turns * (args.turn_tokens + args.reply_tokens)
        self.num_blocks = args.users * (conversation // 16 + 2) + 16
        self.hooks: list[TierdHooks] = []

    def engine(self, name: str) -> LLMEngine:
        from tierd.connector.reference.engine import EngineConfig, LLMEngine
        from tierd.connector.reference.tierd_hooks import TierdHooks, TierdHooksConfig

        hooks = TierdHooks(TierdHooksConfig(socket_path=self.socket_path, engine_name=name))
        engine = LLMEngine(self.model, EngineConfig(num_blocks=self.num_blocks), hooks)
        hooks.attach_block_events(engine.manager.take_events)
        if not hooks.wait_connected(timeout=10):
            raise ValueError(f"no tierd daemon answers at {self.socket_path}: start one with "
                             "`tierd serve`, or run the demo without --socket-path")
        self.hooks.append(hooks)
        return engine

    def turn(self, engine: LLMEngine, prompt: list[int], label: str) -> Request:
        request = engine.add_request(prompt, self.args.reply_tokens)
        while engine.has_unfinished():
            engine.step()
        assert request.ttft is not None, "a finished request has a first token"
        self.console.print(
            f"  {label:<22} {len(prompt):>5} tokens: {request.num_hot_hit_tokens:>5} hot, "
            f"{request.num_loaded_tokens:>5} loaded, TTFT {request.ttft * 1e3:7.1f} ms")
        return request

    def row(self, source: str, request: Request) -> _Row:
        assert request.ttft is not None, "measured after the request finished"
        return _Row(source, request.ttft, request.num_hot_hit_tokens, request.num_loaded_tokens,
                    tuple(request.output_token_ids))

    def run(self) -> None:
        args, print_ = self.args, self.console.print
        print_(f"[bold]1.[/] engine A: {args.users} users x {args.turns} turns behind a "
               f"{args.system_tokens}-token system prompt (blocks written through to tierd)")
        a = self.engine("engine-A")
        self.turn(a, self.tokens(32), "warm-up")
        histories = [self.system + self.tokens(args.turn_tokens) for _ in range(args.users)]
        probe = list(histories[0])
        rows = [self.row("cold (computed)", self.turn(a, probe, "user 0 turn 1 (cold)"))]
        for t in range(args.turns):
            for u in range(args.users):
                if (u, t) == (0, 0):
                    continue
                if t:
                    histories[u] += self.tokens(args.turn_tokens)
                request = self.turn(a, histories[u], f"user {u} turn {t + 1}")
                histories[u] += request.output_token_ids
        rows.append(self.row("hot tier (engine pool)", self.turn(a, probe, "user 0 again (hot)")))
        chat_hits = a.prefix_stats
        for hooks in self.hooks:
            hooks.flush()
        print_("[bold]2.[/] engine B, empty pool: the prompt comes from the DRAM tier")
        b = self.engine("engine-B")
        self.turn(b, self.tokens(32), "warm-up")
        rows.append(self.row("DRAM tier", self.turn(b, probe, "user 0 (DRAM)")))
        if self.daemon is not None:
            print_("[bold]3.[/] one maintain pass at a low watermark demotes DRAM blocks to SSD; "
                   "engine C, empty pool, loads from SSD")
            self.daemon.maintain()
            c = self.engine("engine-C")
            self.turn(c, self.tokens(32), "warm-up")
            tiers = self._tiers(c, probe)
            print_(f"  prompt blocks by tier before the load: {tiers}")
            rows.append(self.row("SSD tier", self.turn(c, probe, "user 0 (SSD)")))
        for hooks in self.hooks:
            hooks.flush()
        self.report(rows, chat_hits.hits, chat_hits.queries)
        for hooks in self.hooks:
            hooks.close()

    def _tiers(self, engine: LLMEngine, prompt: list[int]) -> dict[str, int]:
        from tierd.connector.reference.model import model_identity
        from tierd.connector.reference.tierd_hooks import layout_for
        from tierd.hashing import BlockHasher
        from tierd.wire.client import TierdClient

        hashes = BlockHasher(16).append(prompt)
        with TierdClient(socket_path=self.socket_path) as client:
            probe = client.register_engine(
                layout_for(engine.kv_cache.spec, model_identity(engine.model).model_id),
                "demo-probe")
            tiers = client.lookup(probe.engine_id, hashes)
            client.unregister_engine(probe.engine_id)
        return {t: tiers.count(t) for t in dict.fromkeys(tiers)}

    def report(self, rows: list[_Row], chat_hits: int, chat_queries: int) -> None:
        from rich import box
        from rich.table import Table

        from tierd.commands.stats import render
        from tierd.wire.client import TierdClient

        cold = rows[0]
        table = Table(title=f"TTFT of one {len(self.system) + self.args.turn_tokens}-token "
                            "prompt by where its prefix came from", box=box.SIMPLE_HEAD)
        for column in ("prefix from", "hot tokens", "loaded tokens", "TTFT ms", "vs cold",
                       "same tokens"):
            table.add_column(column, justify="left" if column == "prefix from" else "right")
        for row in rows:
            table.add_row(row.source, str(row.hot_tokens), str(row.loaded_tokens),
                          f"{row.ttft_s * 1e3:.1f}", f"{cold.ttft_s / row.ttft_s:.1f}x",
                          "yes" if row.tokens == cold.tokens else "[red]NO[/]")
        self.console.print(table)
        loaded = sum(h.stats.loaded_blocks for h in self.hooks)
        failed = sum(h.stats.failed_load_blocks for h in self.hooks)
        saved = sum(h.stats.saved_blocks for h in self.hooks)
        ratio = chat_hits / chat_queries if chat_queries else 0.0
        self.console.print(
            f"hot-tier hit ratio of the chat on engine A: {ratio:.2f} ({chat_hits} of "
            f"{chat_queries} prompt tokens); blocks written through {saved}, loaded from tierd "
            f"{loaded}, failed loads {failed}")
        self.console.print("[bold]tierd stats[/]")
        with TierdClient(socket_path=self.socket_path) as client:
            render(client.stats(), self.console)
        if any(row.tokens != cold.tokens for row in rows):
            raise AssertionError("a tier changed the generated tokens: that is a bug")
