"""TierdConnector in real `vllm serve` (vLLM's CPU build: API server, engine core and worker
processes, CPU attention, real KV tensors), driven over the OpenAI HTTP API with streamed
greedy completions. The tests share one stack and run in order (each starts where the last one
left the daemon); every hit is checked against the text of a cold run.

Run by `make test-vllm-serve`; the main suite and `make test-vllm` skip this folder.
"""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vLLM's CPU build: run `make test-vllm-serve`")

from tierd.bench.serve_stack import BLOCK, VllmServe, wait_for  # noqa: E402
from tierd.bench.tiny_llama import prompt  # noqa: E402

pytestmark = [pytest.mark.vllm_serve, pytest.mark.timeout(1200)]

_FRESH = itertools.count(1000)
TOKENS = 1000                       # 31 full blocks of 32 and a tail
HIT = (TOKENS - 1) // BLOCK * BLOCK  # the tokens a full hit loads (never the last one)
AFTER_RELOAD = (400, 684)            # answer tokens past the first preemption and readmission


def connected(stack: Any, *servers: VllmServe) -> None:
    """Send each server a throwaway request (a new prompt each time: a local prefix-cache hit
    would leave the connector nothing to ask) until the daemon lists its scheduler and worker
    (a connector retries a daemon that was down at most every retry_seconds = 1 s)."""
    def registered() -> bool:
        names = {e.engine_name for e in stack.daemon.stats().engines}
        missing = [s for s in servers
                   if not {f"{s.engine}-scheduler", f"{s.engine}-tp0"} <= names]
        for server in missing:
            server.complete(prompt(2 * BLOCK + 1, seed=next(_FRESH)), 1)
        return not missing
    wait_for("the connectors to reach the daemon", registered, timeout=120, every=1.0)


def dram_blocks(stack: Any) -> int:
    """Blocks the daemon holds in DRAM, every model's."""
    return sum(m.blocks.get("dram", 0) for m in stack.daemon.stats().models)


def committed(stack: Any, before: int) -> None:
    """Wait until the daemon holds a prompt's blocks more than ``before`` (``dram_blocks``): an
    instance answers before its last Commit lands (the daemon checksums off its path), so the
    next instance may ask a few ms too early."""
    wait_for("the last completion's blocks committed",
             lambda: dram_blocks(stack) >= before + HIT // BLOCK, timeout=30)


def no_pins(stack: Any) -> None:
    wait_for("every pin released", lambda: stack.daemon.pinned_blocks() == 0, timeout=30)


def test_serves_without_a_daemon_then_picks_it_up(stack: Any) -> None:
    """All three instances started with no daemon: they serve (text equal between the two of
    model 1, as greedy must be). Once `tierd serve` is up they register and use it."""
    text = prompt(TOKENS, seed=1)
    assert stack.a.complete(text) == stack.b.complete(text) != ""
    stack.daemon.start()
    connected(stack, stack.a, stack.b, stack.c, stack.d)


def test_other_weights_of_one_shape_never_share(stack: Any) -> None:
    """Model 2 (the same config.json and served name, other weights) stores a prompt first;
    model 1 on the same daemon loads none of it (a miss, its own text); a second instance of
    model 1 then hits model 1's copy in full, with model 1's text. `tierd stats` shows two
    models."""
    text = prompt(TOKENS, seed=2)
    hits = [s.external_hits() for s in (stack.a, stack.b, stack.c)]
    held = dram_blocks(stack)
    other = stack.c.complete(text)
    committed(stack, held)
    held = dram_blocks(stack)
    mine = stack.a.complete(text)
    committed(stack, held)
    assert stack.a.external_hits() == hits[0]          # nothing of model 2's served to model 1
    assert stack.c.external_hits() == hits[2]
    assert stack.b.complete(text) == mine
    assert stack.b.external_hits() - hits[1] == HIT
    assert mine != other  # other weights, other greedy text (a check that the models differ)
    models = {m.model_id for m in stack.daemon.stats().models}
    assert len(models) == 2 and all(m.startswith("tiny@") for m in models)
    no_pins(stack)


def test_second_instance_hits_dram_then_ssd_after_a_restart(stack: Any) -> None:
    """A stores two prompts; B hits the first from DRAM (equal text). `tierd serve` restarts
    (SIGTERM: DRAM blocks written to SSD); B hits the second from SSD (streamed), equal text.
    Each of A's prompts is committed before the next step (A answers before its last Commit
    lands, and a Commit the stopping daemon never got is lost with its blocks)."""
    first, second = prompt(TOKENS, seed=3), prompt(TOKENS, seed=4)
    want = []
    for text in (first, second):
        held = dram_blocks(stack)
        want.append(stack.a.complete(text))
        committed(stack, held)
    before = stack.b.external_hits()
    assert stack.b.complete(first) == want[0]
    assert stack.b.external_hits() - before == HIT
    stack.daemon.stop()
    stack.daemon.start()
    connected(stack, stack.b)
    before = stack.b.external_hits()
    assert stack.b.complete(second) == want[1]
    assert stack.b.external_hits() - before == HIT
    no_pins(stack)


def test_daemon_killed_while_serving(stack: Any) -> None:
    """`tierd serve` SIGKILLed: A keeps serving (recompute) with the text B computes cold for
    the same prompt; once the daemon is back, B hits what A stores."""
    stack.daemon.stop(kill=True)
    text = prompt(TOKENS, seed=5)
    during = stack.a.complete(text)
    stack.daemon.start()
    connected(stack, stack.a, stack.b)
    held = dram_blocks(stack)
    assert stack.b.complete(text) == during  # B: a miss (the daemon was empty), cold text
    committed(stack, held)
    later = prompt(TOKENS, seed=6)
    held = dram_blocks(stack)
    want = stack.a.complete(later)
    committed(stack, held)
    before = stack.b.external_hits()
    assert stack.b.complete(later) == want
    assert stack.b.external_hits() - before == HIT
    no_pins(stack)


def test_aborted_streams_leave_no_pins(stack: Any) -> None:
    """Clients that disconnect mid-stream, on a hit and on a miss: no pin stays, and the
    instance serves the next request with the right text."""
    text = prompt(TOKENS, seed=7)
    want = stack.a.complete(text, 4)
    stack.b.abandon(text, max_tokens=200)                    # a hit, aborted
    stack.b.abandon(prompt(TOKENS, seed=8), max_tokens=200)  # a miss, aborted
    no_pins(stack)
    assert stack.b.complete(text, 4) == want
    no_pins(stack)


def same_or_near_tie(got: list[tuple[str, dict[str, float]]],
                     want: list[tuple[str, dict[str, float]]], margin: float = 0.05) -> bool:
    """Whether greedy ``got`` follows ``want`` token for token, or parts from it only where
    ``want``'s model nearly tied: ``got``'s token among ``want``'s top ones there, within
    ``margin`` (nats) of ``want``'s choice. Wrong KV moves the whole distribution, so the
    answers part at once and by far. (Seen: the 8th token, 0.016 nats apart; this random tiny
    model's top two are 0.08-0.56 nats apart at the first token.)"""
    for (token, _), (chosen, top) in zip(got, want):
        if token != chosen:
            return token in top and top[chosen] - top[token] <= margin
    return True


def test_preemption_under_a_small_kv_cache_leaves_no_pins(stack: Any) -> None:
    """Three requests at once on an instance whose KV cache holds 48 blocks: short prompts
    (11 blocks each, loaded from tierd) and long answers (22 more blocks each) outgrow it by the
    ~190th answer token, so vLLM preempts and readmits them, loading again each time; no pin is
    left. The tokens checked are those generated after a readmission, at AFTER_RELOAD: instance
    a continues each answer from its exact token ids, computing that context itself (a cache
    salt no block in tierd or its own cache has), and the answer's next 16 tokens must be a's,
    or part from them only at a near tie (vLLM's arithmetic depends on the batch: bf16, no
    batch-invariant mode). The first 16 tokens, loaded before any preemption, are checked the
    same way against the storing instance's. The answers ignore the end-of-text token and
    always run to 700 tokens."""
    prompts = [prompt(10 * BLOCK + 5, seed=20 + i) for i in range(3)]
    alone = [stack.a.greedy(text, 16) for text in prompts]
    before = stack.d.metric("vllm:num_preemptions")
    with ThreadPoolExecutor(3) as pool:
        got = list(pool.map(lambda text: stack.d.greedy(text, 700, top=1), prompts))
    assert stack.d.metric("vllm:num_preemptions") > before
    for answer, one in zip(got, alone):
        assert len(answer.tokens) == 700
        assert same_or_near_tie(answer.tokens[:16], one.tokens), (answer.tokens[:16], one.tokens)
        for at in AFTER_RELOAD:
            want = stack.a.greedy(answer.context(at), 16, cache_salt="reference")
            window = answer.tokens[at:at + 16]
            assert same_or_near_tie(window, want.tokens), (at, window, want.tokens)
    no_pins(stack)


def test_the_workload_benchs_stop_tokens_give_each_prompt_its_own_output_length(
        stack: Any) -> None:
    """`tierd bench workload`'s requests (``workload_output.Output``): no stop token among a
    reply's least tokens, then it ends at its first stop token (kept in the text) or at its
    most, so the lengths differ between prompts; the same prompt gets the same reply (greedy)."""
    from tierd.bench.tiny_llama import SPECIAL
    from tierd.bench.workload_output import Output

    output = Output(most=16, least=4, stop_every=8)
    stops = set(output.stop_tokens())
    lengths = []
    for seed in range(12):
        text = prompt(2 * BLOCK, seed=next(_FRESH))
        reply = stack.a.timed(text, output.most, ignore_eos=True,
                              sampling=output.sampling())[1].split()
        ids = [int(word[1:]) + len(SPECIAL) for word in reply]
        assert output.least < len(ids) <= output.most, reply
        assert not stops & set(ids[:output.least]), reply
        early = [i for i, t in enumerate(ids) if t in stops]
        assert len(ids) == (early[0] + 1 if early else output.most), reply
        lengths.append(len(ids))
        if seed == 0:
            assert stack.a.timed(text, output.most, ignore_eos=True,
                                 sampling=output.sampling())[1].split() == reply
    assert len(set(lengths)) >= 3, lengths
