"""The time an engine spends in an adapter's hooks, per process, where the environment asks.

Off unless ``TIERD_HOOK_TIMES`` names a directory: then ``install`` wraps the named methods of an
adapter class (vLLM's ``TierdConnector``: its scheduler hooks in the engine-core process, its
worker hooks in each worker) so every call adds its wall time and its thread's CPU time to that
process's sums, and a thread writes the sums to ``<directory>/hooks-<pid>.json`` every
``WRITE_SECONDS`` (each write replaces the last whole, so a reader never sees half a file). The
wrapping costs a call about 2 us, about half of it inside the time it reports; without the
variable nothing is wrapped and nothing runs. `tierd bench workload --hook-times` reads the
files before and after each run (``read_times``): the hooks' time per engine step, beside the
step's own length.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

ENV = "TIERD_HOOK_TIMES"
"""The environment variable naming the directory the sums go to (unset: no timing)."""

WRITE_SECONDS = 0.25
"""How often a process writes its sums."""

Times = dict[str, tuple[int, float, float]]
"""Hook name -> (calls, wall seconds, CPU seconds of the calling thread), summed."""


class _Sums:
    """One process's sums, written by a daemon thread (started at the first ``install``)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.times: dict[str, list[float]] = {}
        self._lock = threading.Lock()
        threading.Thread(target=self._write_forever, name="tierd-hook-times",
                         daemon=True).start()

    def add(self, name: str, wall: float, cpu: float) -> None:
        with self._lock:
            sums = self.times.setdefault(name, [0, 0.0, 0.0])
            sums[0] += 1
            sums[1] += wall
            sums[2] += cpu

    def _write_forever(self) -> None:
        path = os.path.join(self.directory, f"hooks-{os.getpid()}.json")
        while True:
            time.sleep(WRITE_SECONDS)
            with self._lock:
                text = json.dumps(self.times)
            with open(path + ".new", "w") as f:
                f.write(text)
            os.replace(path + ".new", path)


_sums: _Sums | None = None


def install(cls: type, hooks: Iterable[str]) -> bool:
    """Wrap ``cls``'s methods ``hooks`` to time every call, where ``TIERD_HOOK_TIMES`` is set
    (the directory is made if missing); True if it wrapped them."""
    global _sums
    directory = os.environ.get(ENV)
    if not directory:
        return False
    if _sums is None:
        os.makedirs(directory, exist_ok=True)
        _sums = _Sums(directory)
    for name in hooks:
        setattr(cls, name, _timed(name, getattr(cls, name), _sums))
    return True


def _timed(name: str, method: Callable[..., Any], sums: _Sums) -> Callable[..., Any]:
    @functools.wraps(method)
    def timed(*args: Any, **kwargs: Any) -> Any:
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            return method(*args, **kwargs)
        finally:
            sums.add(name, time.perf_counter() - wall, time.thread_time() - cpu)
    return timed


def read_times(directory: str) -> dict[int, Times]:
    """Every process's sums in ``directory`` as last written: pid -> ``Times`` (none if the
    directory is missing)."""
    out: dict[int, Times] = {}
    if not os.path.isdir(directory):
        return out
    for entry in os.listdir(directory):
        if entry.startswith("hooks-") and entry.endswith(".json"):
            with open(os.path.join(directory, entry)) as f:
                raw = json.load(f)
            out[int(entry[len("hooks-"):-len(".json")])] = {
                name: (int(calls), float(wall), float(cpu)) for name, (calls, wall, cpu)
                in raw.items()}
    return out
