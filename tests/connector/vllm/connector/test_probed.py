"""Hits answered from the presence filter: the worker's Probes sent ahead of their loads, the
answers of its Releases read at its next step once in (one the daemon never answers given up on
after the timeout), and when the scheduler stops answering hits from the filter."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import grpc
from fake_vllm import FakeRequest, prompt, usage

from tierd.connector.vllm.connector.filter_reads import BACKOFF_SECONDS, WINDOW, FilterReads
from tierd.connector.vllm.connector.probed import Probes, Unread
from tierd.wire.call_error import CallError


class _Call:
    """A call whose answer arrives when the test says so."""

    def __init__(self, answer: bool | grpc.RpcError | None = None) -> None:
        self.answer, self.read, self.abandoned = answer, False, False

    def done(self, timeout: float = 0.0) -> bool:
        return self.answer is not None

    def result(self) -> bool:
        self.read = True
        if isinstance(self.answer, grpc.RpcError):
            raise self.answer
        assert self.answer is not None, "read before its answer came"
        return self.answer

    def abandon(self) -> None:
        self.abandoned = True


def test_answers_are_read_once_in_and_the_unanswered_abandoned_after_the_timeout() -> None:
    now = [0.0]
    unread = Unread(timeout=5.0, clock=lambda: now[0])
    answered, failed, slow, hung = _Call(False), _Call(), _Call(), _Call()
    for call in (answered, failed, slow, hung):
        unread.add(call)  # type: ignore[arg-type]  # the Sent protocol
    failed.answer = CallError(grpc.StatusCode.NOT_FOUND, "the lease had ended")
    now[0] = 1.0
    unread.reap()
    assert answered.read and failed.read and len(unread) == 2
    assert not slow.read and not slow.abandoned
    slow.answer = True
    now[0] = 5.0
    unread.reap()
    assert slow.read and not slow.abandoned and hung.abandoned and len(unread) == 0
    late = _Call()
    unread.add(late)  # type: ignore[arg-type]
    unread.close()
    assert late.abandoned and not late.read and len(unread) == 0


def test_probes_no_load_took_are_released_once_answered(sock: str, engines: Any) -> None:
    """A Probe sent ahead of its load pins the stored run; one whose load never came (given up
    on by ``drop_all``) has its lease released once its answer is in, by a call thread; one
    sent under another session is not used (a fresh one is sent)."""
    a, b = engines(0), engines(20)
    request = FakeRequest("a", prompt(100))
    a.prefill(request)
    hashes = request.block_hashes[:6]
    worker = b.workers[0]._worker
    session = worker.link.session
    probes = Probes(worker.link, time.monotonic)
    probes.send(session, "x", hashes)
    _until(lambda: usage(sock) == (6, 6))
    probes.drop_all()
    _until(lambda: usage(sock) == (6, 0))
    probes.send(session, "y", hashes)
    elsewhere = dataclasses.replace(session)  # as if the link reconnected meanwhile
    lease = probes.lease(elsewhere, "y", hashes)
    assert lease is not None and lease.num_blocks == 6
    _until(lambda: usage(sock) == (6, 6))  # the new lease; the first one's released
    elsewhere.client.release(lease.engine_id, lease.lease_id)
    _until(lambda: usage(sock) == (6, 0))


def _until(check: Callable[[], bool], seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "never came"
        time.sleep(0.01)


def test_the_filter_backs_off_only_when_its_hits_fail_often() -> None:
    """A hit answered from the presence filter that fails its load now and then (a collision)
    leaves hits answered from the filter; two failures among the last 20 loads make new hits
    pinned by a lookup first for ``BACKOFF_SECONDS``, then the count starts afresh."""
    now = [0.0]
    reads = FilterReads(None, dram_hits=True, clock=lambda: now[0])  # type: ignore[arg-type]
    reads.loaded(False)
    for _ in range(WINDOW - 1):
        reads.loaded(True)
    reads.loaded(False)  # the first failure is out of the window by now
    assert not reads.backing_off
    reads.loaded(False)
    assert reads.backing_off
    now[0] = BACKOFF_SECONDS - 0.01
    assert reads.backing_off
    now[0] = BACKOFF_SECONDS
    assert not reads.backing_off
    reads.loaded(False)
    assert not reads.backing_off
