"""`tierd stats`: what each tier of a running daemon holds, and what its hit ratio means.

Per tier: blocks used / capacity, bytes, pinned, hit ratio, evictions, demotions, promotions; the
caller's tenant's use against its quota (every tenant's with the admin token); per engine of the
caller's tenant: HBM occupancy. Under the table, what the hit ratio means, and "pool too small"
when blocks are reused later (reuse-gap P90) than evicted blocks typically sat idle
(idle-before-evict P50).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from tierd.commands.flags import add_socket_path

if TYPE_CHECKING:
    from rich.console import Console

    from tierd.wire.replies import DaemonStats

HELP = ("Show tier occupancy, per-model occupancy and hits, hit ratio and per-engine HBM "
        "use of a running daemon.")


def configure(parser: argparse.ArgumentParser) -> None:
    add_socket_path(parser, "Daemon Unix socket (default: $TIERD_SOCKET_PATH, else the "
                            "default socket of `tierd serve`).")
    parser.add_argument("--address", metavar="HOST:PORT", default=None,
                        help="Reach the daemon over TCP instead (needs --token).")
    parser.add_argument("--token", default=None,
                        help="Bearer token from the daemon's token file (selects the tenant).")
    parser.add_argument("--json", action="store_true", help="Print one JSON object and exit.")
    parser.add_argument("--watch", metavar="SECONDS", type=float, default=None,
                        help="Refresh every SECONDS until Ctrl-C.")
    parser.add_argument("--what-if", action="store_true",
                        help="Also print each tier's estimated hit ratio at 0.25x to 8x its "
                             "size (every lookup, and per model) and the size where it "
                             "flattens.")


def run(args: argparse.Namespace) -> int:
    import grpc
    from rich.console import Console

    from tierd.wire.access import denied
    from tierd.wire.client import TierdClient

    if args.watch is not None and args.watch <= 0:
        raise ValueError(f"--watch needs a positive number of seconds, got {args.watch}")
    console = Console()
    with TierdClient(socket_path=args.socket, address=args.address, token=args.token,
                     timeout=5.0) as client:
        while True:
            try:
                stats = client.stats()
            except grpc.RpcError as exc:
                refused = (denied(client.target.removeprefix("unix:"), "socket")
                           if client.target.startswith("unix:") else None)
                if refused is not None:
                    print(f"tierd stats: {refused}", file=sys.stderr)
                elif exc.code() == grpc.StatusCode.UNAVAILABLE:
                    print(f"tierd stats: no daemon answers at {client.target}: start one with "
                          "`tierd serve`, or point at it with --socket-path PATH "
                          "(or --address HOST:PORT --token TOKEN)", file=sys.stderr)
                else:
                    print(f"tierd stats: {exc.code().name}: {exc.details()}", file=sys.stderr)
                return 1
            if args.json:
                print(json.dumps(stats_json(stats), indent=2))
                return 0
            if args.watch is not None:
                console.clear()
            render(stats, console)
            if args.what_if:
                render_what_if(stats, console)
            if args.watch is None:
                return 0
            time.sleep(args.watch)


def stats_json(stats: DaemonStats) -> dict[str, Any]:
    """The ``--json`` object: every field of the reply plus ``pool_too_small``."""
    return {**asdict(stats), "pool_too_small": stats.pool_too_small}


def _ratio(part: int, whole: int) -> str:
    return f"{part / whole:.2f}" if whole else "-"


def _size(n: int) -> str:
    """Compact binary size: 512B, 4.0K, 2.0G."""
    value = float(n)
    for unit in ("B", "K", "M", "G", "T"):
        if value < 1024 or unit == "T":
            return f"{n}B" if unit == "B" else f"{value:.1f}{unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _of(used: int, quota: int | None) -> str:
    """``used/quota`` (``-``: no quota), and the share of it when over."""
    if quota is None:
        return f"{_size(used)}/-"
    over = f" ({used / quota:.0%})" if quota and used > quota else ""
    return f"{_size(used)}/{_size(quota)}{over}"


def render(stats: DaemonStats, console: Console) -> None:
    """Print the tier table, the model and engine tables and the reading under them."""
    from rich import box
    from rich.table import Table

    tiers = Table(title="tierd tiers (used/capacity)", box=box.SIMPLE_HEAD)
    for column in ("tier", "blocks", "bytes", "pinned", "hit", "evict", "demote",
                   "promote"):
        tiers.add_column(column, justify="left" if column == "tier" else "right", no_wrap=True)
    for t in stats.tiers:
        cap_blocks = str(t.capacity_blocks) if t.capacity_blocks else "-"
        cap_bytes = _size(t.capacity_bytes) if t.capacity_bytes else "-"
        tiers.add_row(t.tier, f"{t.used_blocks}/{cap_blocks}",
                      f"{_size(t.used_bytes)}/{cap_bytes}", str(t.pinned_blocks),
                      _ratio(t.hit_tokens, t.query_tokens), str(t.evictions), str(t.demotions),
                      str(t.promotions))
    console.print(tiers)
    if stats.models:
        models = Table(title="models (this tenant)", box=box.SIMPLE_HEAD)
        models.add_column("model", overflow="fold")  # an id is never cut: it is the key
        for column in ("engines", "DRAM", "SSD", "HBM blocks", "hit"):
            models.add_column(column, justify="right", no_wrap=True)
        for m in stats.models:
            models.add_row(m.model_id.replace("@", "\n@", 1), str(m.engines),
                           f"{m.blocks['dram']} ({_size(m.bytes['dram'])})",
                           f"{m.blocks['ssd']} ({_size(m.bytes['ssd'])})", str(m.blocks["hbm"]),
                           _ratio(m.hit_tokens, m.query_tokens))
        console.print(models)
    if stats.tenants:
        tenants = Table(title="tenants (used/quota)", box=box.SIMPLE_HEAD)
        for column in ("tenant", "DRAM", "SSD", "pinned", "reserved", "limited"):
            tenants.add_column(column, justify="left" if column == "tenant" else "right",
                               no_wrap=True)
        for u in stats.tenants:
            tenants.add_row(u.tenant, _of(u.dram_bytes, u.dram_quota),
                            _of(u.ssd_bytes, u.ssd_quota), _size(u.pinned_bytes),
                            _size(u.reserved_bytes), str(u.limited))
        console.print(tenants)
    if stats.savings:
        saved = Table(title="prefill saved (tokens served, engine seconds saved at the "
                            "prefill speed: the engine's reported or the planner's)",
                      box=box.SIMPLE_HEAD)
        for column in ("tenant", "model", "tier", "tokens", "seconds", "tokens/s", "speed"):
            saved.add_column(column, justify="right" if column in ("tokens", "seconds",
                                                                     "tokens/s") else "left",
                             overflow="fold")
        for r in stats.savings:
            saved.add_row(r.tenant, r.model_id, r.tier, str(r.tokens), f"{r.seconds:.1f}",
                          f"{r.tokens_per_second:,.0f}", r.speed_source)
        console.print(saved)
    if stats.engines:
        engines = Table(title="engines (HBM, as reported)", box=box.SIMPLE_HEAD)
        for column in ("engine", "name", "HBM blocks", "HBM tokens", "HBM bytes"):
            engines.add_column(column, justify="left" if column in ("engine", "name") else "right",
                               no_wrap=True)
        for e in stats.engines:
            engines.add_row(e.engine_id, e.engine_name or "-", str(e.hbm_blocks),
                            str(e.hbm_blocks * e.block_size), _size(e.hbm_blocks * e.block_bytes))
        console.print(engines)
    console.print(f"hit ratio {_ratio(stats.hit_tokens, stats.query_tokens)} "
                  f"({stats.hit_tokens} of {stats.query_tokens} tokens); checksum failures "
                  f"{stats.checksum_failures}; lease expiries {stats.lease_expiries}; SSD "
                  f"{'healthy' if stats.ssd_healthy else 'DEGRADED (DRAM only)'}", highlight=False)
    console.print(f"reading: {stats.reading}", highlight=False)
    if stats.pool_too_small and "pool too small" not in stats.reading:
        console.print(f"pool too small: reuse gap P90 {stats.reuse_gap_p90_seconds:.1f} s > "
                      f"idle before evict P50 {stats.idle_before_evict_p50_seconds:.1f} s",
                      highlight=False)


def render_what_if(stats: DaemonStats, console: Console) -> None:
    """The what-if table: per tier and model, the hit ratio at each scale of the tier's size and
    the size where the curve flattens (more would gain under one point up to 8x)."""
    from rich import box
    from rich.table import Table

    from tierd.wire.replies import SCALES

    if not stats.what_if:
        console.print("what-if: no lookups sampled yet", highlight=False)
        return
    bytes_of = {t.tier: t.capacity_bytes for t in stats.tiers}
    table = Table(title="what-if: hit ratio were the tier this many times its size",
                  box=box.SIMPLE_HEAD)
    table.add_column("tier")
    table.add_column("model", overflow="fold")
    for scale in SCALES:
        table.add_column(f"{scale:g}x", justify="right", no_wrap=True)
    table.add_column("flattens at", justify="right", no_wrap=True)
    for c in stats.what_if:
        model = "all lookups" if c.model_id == "*" else f"{c.model_id} ({c.tenant})"
        flat = ("still climbing at 8x" if c.flattens_at is None else
                f"{c.flattens_at:g}x ({_size(int(c.flattens_at * bytes_of.get(c.tier, 0)))})")
        table.add_row(c.tier, model, *(f"{r:.2f}" for r in c.hit_ratios), flat)
    console.print(table)
