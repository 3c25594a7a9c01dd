"""``PrefillSpeed``: tokens over seconds of the timed prefill steps, reported at once and then at
most every ``every_seconds``; short steps are not timed; device events are read only once they
have completed."""

from __future__ import annotations

from tierd.connector.core.prefill_speed import PrefillSpeed


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Event:
    """A device event: done once ``done`` is set; ``at`` ms since an origin."""

    def __init__(self, clock: Clock) -> None:
        self.clock, self.at, self.done = clock, 0.0, False

    def record(self) -> None:
        self.at = self.clock.now * 1000

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end_event: Event) -> float:  # type: ignore[override]
        return end_event.at - self.at


def test_host_timed_steps_and_the_reporting_period() -> None:
    """1,000 tokens in 0.5 s and 3,000 in 0.5 s: 4,000 tokens/s at once; a 100-token step is
    not timed; the next answer waits 10 s and covers only the steps since."""
    clock = Clock()
    speed = PrefillSpeed(clock, min_tokens=256, every_seconds=10.0)
    assert speed.take() is None
    for tokens in (1000, 100, 3000):
        speed.begin(tokens)
        clock.now += 0.5
        speed.end()
    assert speed.take() == 4000.0
    speed.begin(500)
    clock.now += 1.0
    speed.end()
    assert speed.take() is None
    clock.now += 9.0
    assert speed.take() == 500.0
    speed.observe(2000, 0.25)
    clock.now += 10.0
    assert speed.take() == 8000.0


def test_device_events_are_read_once_complete() -> None:
    """A step timed by events of 2 s: nothing until its end event completes, then 512 / 2."""
    clock = Clock()
    events: list[Event] = []

    def make() -> Event:
        events.append(Event(clock))
        return events[-1]

    speed = PrefillSpeed(clock, events=make)
    speed.begin(512)
    clock.now += 2.0
    speed.end()
    assert len(events) == 2 and speed.take() is None
    events[1].done = True
    assert speed.take() == 256.0
