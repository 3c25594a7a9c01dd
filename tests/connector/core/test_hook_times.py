"""``core.hook_times``: an adapter's hooks timed per process only where the environment asks."""

from __future__ import annotations

import os
import time

import pytest

from tierd.connector.core import hook_times


class _Adapter:
    def quick(self, x: int) -> int:
        return x + 1

    def slow(self) -> None:
        time.sleep(0.02)

    def failing(self) -> None:
        raise ValueError("bad input")


def test_hooks_are_left_alone_without_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(hook_times.ENV, raising=False)
    quick = _Adapter.quick
    assert hook_times.install(_Adapter, ["quick"]) is False
    assert _Adapter.quick is quick


def test_every_call_is_summed_and_written_for_the_process(
        monkeypatch: pytest.MonkeyPatch, tmp_path: os.PathLike[str]) -> None:
    """Calls, wall and CPU time per hook, a raising call counted too and its error passed on;
    the file is this process's and read back whole; a sleep is wall time, not CPU."""
    class Adapter(_Adapter):
        pass

    directory = os.path.join(tmp_path, "hooks")
    monkeypatch.setenv(hook_times.ENV, directory)
    monkeypatch.setattr(hook_times, "_sums", None)
    assert hook_times.install(Adapter, ["quick", "slow", "failing"]) is True
    adapter = Adapter()
    assert [adapter.quick(1), adapter.quick(2)] == [2, 3]
    adapter.slow()
    with pytest.raises(ValueError, match="bad input"):
        adapter.failing()
    assert Adapter.quick.__name__ == "quick"
    deadline = time.monotonic() + 10
    while True:
        times = hook_times.read_times(directory).get(os.getpid(), {})
        if times.get("failing", (0,))[0] == 1 or time.monotonic() > deadline:
            break
        time.sleep(hook_times.WRITE_SECONDS)
    assert {name: calls for name, (calls, _, _) in times.items()} == {
        "quick": 2, "slow": 1, "failing": 1}
    _, wall, cpu = times["slow"]
    assert wall >= 0.02 and cpu < 0.015
    assert hook_times.read_times(os.path.join(tmp_path, "nowhere")) == {}
