"""``probed.Unread``: the answers of Releases sent without waiting are read at the worker's next
step once in, and one the daemon never answers is given up on after the timeout."""

from __future__ import annotations

import grpc

from tierd.connector.vllm.connector.probed import Unread
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
