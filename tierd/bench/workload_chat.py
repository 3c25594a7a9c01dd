"""The multi-turn chat workload of `tierd bench workload`: ``users`` conversations that share
one system prompt, each growing turn by turn (its history: the system prompt, then every user
message and the reply the server gave to it), the users interleaved at random.

``concurrency`` workers each take a user whose previous turn has finished (chosen at random
among them), send the whole history plus a new user message as one streamed greedy completion
(as long as ``tierd.bench.workload_output.Output`` lets it run, at most ``reply_tokens``),
append the message and the reply to that user's history and put the user back. A user's next
turn therefore reuses the KV of its whole history, after the turns of others that ran in
between (the reuse gap grows with ``users``). The words of the system prompt and of every
message come from ``seed``; replies come from the model (greedy: the same for every arm). A
failed turn ends its user's conversation and is counted.
"""

from __future__ import annotations

import http.client
import random
import threading
import time
from dataclasses import dataclass

from tierd.bench.serve_stack import VllmServe
from tierd.bench.tiny_llama import prompt
from tierd.bench.workload_output import Output
from tierd.bench.workload_report import Timing, from_latencies


@dataclass(frozen=True)
class ChatShape:
    users: int
    turns: int
    """Turns per user."""
    system_tokens: int
    user_tokens: int
    """Tokens of each user message."""
    reply_tokens: int
    """Tokens of a reply at most."""

    def longest_prompt(self) -> int:
        """Tokens of the last turn's prompt (the history before it and its message)."""
        return self.system_tokens + self.turns * self.user_tokens + \
            (self.turns - 1) * self.reply_tokens

    def working_set(self) -> int:
        """Distinct tokens over the run: the system prompt once, every history in full."""
        return self.system_tokens + self.users * self.turns * (self.user_tokens
                                                               + self.reply_tokens)


class _Users:
    """The conversations and which of them may take their next turn (thread-safe)."""

    def __init__(self, shape: ChatShape, seed: int) -> None:
        self.shape = shape
        self.seed = seed
        self.rng = random.Random(seed)
        system = prompt(shape.system_tokens, seed=seed)
        self.history = [system for _ in range(shape.users)]
        self.turn = [0] * shape.users
        self.ready = list(range(shape.users))
        self.busy = 0
        self.lock = threading.Condition()

    def message(self, user: int) -> str:
        """The words of ``user``'s next message (the same in every arm)."""
        return prompt(self.shape.user_tokens,
                      seed=(self.seed * 1_000 + user) * 1_000 + self.turn[user] + 1)

    def take(self) -> int | None:
        """A ready user (its turn counted as running); None once every conversation ended.
        Blocks while users are only busy."""
        with self.lock:
            while not self.ready:
                if self.busy == 0:
                    return None
                self.lock.wait()
            user = self.ready.pop(self.rng.randrange(len(self.ready)))
            self.busy += 1
            return user

    def give_back(self, user: int, extended: str | None) -> None:
        """End ``user``'s running turn: its history becomes ``extended`` and it is ready again
        while it has turns left; ``extended`` None (the turn failed) ends the conversation."""
        with self.lock:
            self.busy -= 1
            if extended is not None:
                self.history[user] = extended
                self.turn[user] += 1
                if self.turn[user] < self.shape.turns:
                    self.ready.append(user)
            self.lock.notify_all()


def run_chat(server: VllmServe, shape: ChatShape, output: Output, concurrency: int,
             seed: int) -> Timing:
    """Run every conversation to its end against ``server``, every reply as long as ``output``
    (at most ``shape.reply_tokens``); the client's figures."""
    assert output.most == shape.reply_tokens, "the chat is sized for its longest replies"
    if shape.users < concurrency:
        raise ValueError(f"--chat-users ({shape.users}) must be at least the concurrency "
                         f"({concurrency}): a user has one turn running at a time")
    users = _Users(shape, seed)
    ttfts: list[float] = []
    generated = [0]
    failures = [0]
    record = threading.Lock()

    def worker() -> None:
        while (user := users.take()) is not None:
            with users.lock:
                text = users.history[user] + " " + users.message(user)
            try:
                ttft, reply = server.timed(text, shape.reply_tokens, ignore_eos=True,
                                           sampling=output.sampling())
            except (OSError, AssertionError, http.client.HTTPException, ValueError):
                with record:
                    failures[0] += 1
                users.give_back(user, None)
                continue
            with record:
                ttfts.append(ttft)
                generated[0] += len(reply.split())  # one token a word
            users.give_back(user, f"{text} {reply.strip()}")

    start = time.perf_counter()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    duration = time.perf_counter() - start
    return from_latencies(ttfts, generated[0], failures[0], duration)
