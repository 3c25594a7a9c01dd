"""One arm of `tierd bench workload --in-process`: vLLM's engine (its CPU build) in this process,
with no API server and the engine core in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the
scheduler and the forward pass run one after the other on this thread, and nothing polls), driven
one case at a time by the bench (``tierd.bench.workload_engine``).

Its argument is a JSON object: ``model``, ``kv_blocks``, ``max_model_len``, and for a tierd arm
``socket_path`` and ``connector`` (``kv_connector_extra_config``). Once the engine is up and has
served a warm-up, it prints ``READY``; then each line on stdin is a JSON case (``Case`` fields)
and it prints one ``RESULT <json>`` line (``Run`` fields); end of input ends it. The bench sends
vLLM's own log to standard error (``VLLM_LOGGING_STREAM``); a line of neither kind is skipped.

The cases are the workload bench's, sent as token ids (no tokenizer, no detokenizing): ``prefix``,
``prefixes`` prefixes of ``prefix_len`` tokens each followed by its own ``suffix_len`` tokens,
``prompts`` requests in random order; ``chat``, ``users`` conversations sharing a system prompt,
each turn the user's whole history and a new message, the next user picked at random among
those whose previous turn has finished. ``clients`` requests are kept in the engine at once (a
closed loop, as the bench's clients). Each request generates ``output_len`` tokens, or with
``stop_every`` a length drawn between ``output_min`` and ``output_len`` (the same in every arm),
greedily, its end of sequence ignored. Before each case vLLM's prefix cache is emptied with its
connector's.
"""

from __future__ import annotations

import gc
import json
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

VOCAB_FIRST, VOCAB_END = 3, 2048
"""Token ids a prompt draws from: the small Llama's words (its special tokens left out)."""


@dataclass(frozen=True)
class Case:
    kind: str
    """"prefix" or "chat"."""
    seed: int
    clients: int
    output_len: int
    output_min: int
    stop_every: int
    prefix_len: int = 0
    suffix_len: int = 0
    prefixes: int = 0
    prompts: int = 0
    users: int = 0
    turns: int = 0
    system_tokens: int = 0
    user_tokens: int = 0


@dataclass(frozen=True)
class Run:
    wall_s: float
    cpu_s: float
    """CPU time of this process over the run: the engine and the connector, every thread."""
    completed: int
    output_tokens: int
    ttfts_s: list[float]
    """Per request, from its submission to the step that sampled its first token."""
    decode_s: float
    """Mean per request, from its first token to its last."""
    steps: int
    prompt_tokens: int
    cached_tokens: int
    """Prompt tokens vLLM did not compute: its own prefix-cache hits and the connector's."""


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB_FIRST, VOCAB_END) for _ in range(n)]


def _reply_len(rng: random.Random, case: Case) -> int:
    return case.output_len if not case.stop_every else rng.randint(case.output_min,
                                                                   case.output_len)


Next = Callable[[], tuple[Any, list[int], int] | None]
"""A workload's next request: (its key, prompt token ids, tokens to generate); None when none
may start now."""
Done = Callable[[Any, list[int]], None]
"""A request (its key) finished with these generated token ids."""


def _prefix(case: Case) -> tuple[Next, Done]:
    rng = random.Random(case.seed)
    prefixes = [_tokens(rng, case.prefix_len) for _ in range(case.prefixes)]
    order = [i % case.prefixes for i in range(case.prompts)]
    rng.shuffle(order)
    requests = iter([(None, prefixes[p] + _tokens(rng, case.suffix_len), _reply_len(rng, case))
                     for p in order])
    return (lambda: next(requests, None)), (lambda key, tokens: None)


def _chat(case: Case) -> tuple[Next, Done]:
    rng = random.Random(case.seed)
    system = _tokens(rng, case.system_tokens)
    history = [list(system) for _ in range(case.users)]
    turns = [0] * case.users
    ready = list(range(case.users))
    sent: dict[int, list[int]] = {}

    def take() -> tuple[Any, list[int], int] | None:
        if not ready:
            return None
        user = ready.pop(rng.randrange(len(ready)))
        sent[user] = history[user] + _tokens(rng, case.user_tokens)
        return user, sent[user], _reply_len(rng, case)

    def done(user: int, reply: list[int]) -> None:
        history[user] = sent.pop(user) + reply
        turns[user] += 1
        if turns[user] < case.turns:
            ready.append(user)

    return take, done


def run_case(engine: Any, case: Case) -> Run:
    """Run ``case`` to its end on ``engine`` (a vLLM ``LLMEngine``), ``case.clients`` requests
    in it at once."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    take, done = _chat(case) if case.kind == "chat" else _prefix(case)
    running: dict[str, tuple[Any, float]] = {}  # request id -> (key, submitted)
    first: dict[str, float] = {}
    ttfts: list[float] = []
    decode = 0.0
    output_tokens = prompt_tokens = cached = steps = 0
    wall, cpu = time.perf_counter(), time.process_time()
    number = 0
    while True:
        while len(running) < case.clients and (request := take()) is not None:
            key, tokens, reply = request
            number += 1
            req_id = f"{case.kind}-{case.seed}-{number}"
            engine.add_request(req_id, TokensPrompt(prompt_token_ids=tokens),
                               SamplingParams(max_tokens=reply, temperature=0.0,
                                              ignore_eos=True, detokenize=False))
            running[req_id] = (key, time.perf_counter())
            prompt_tokens += len(tokens)
        if not running:
            break
        outputs = engine.step()
        steps += 1
        now = time.perf_counter()
        for out in outputs:
            if out.request_id not in first and out.outputs and out.outputs[0].token_ids:
                first[out.request_id] = now
                ttfts.append(now - running[out.request_id][1])
            if out.finished:
                key, _ = running.pop(out.request_id)
                generated = list(out.outputs[0].token_ids)
                output_tokens += len(generated)
                cached += int(out.num_cached_tokens or 0)
                decode += now - first.pop(out.request_id, now)
                done(key, generated)
    completed = len(ttfts)
    return Run(time.perf_counter() - wall, time.process_time() - cpu, completed, output_tokens,
               ttfts, decode / completed if completed else 0.0, steps, prompt_tokens, cached)


def _engine(config: dict[str, Any]) -> Any:
    from vllm import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    transfer = None
    if config.get("socket_path"):
        from vllm.config import KVTransferConfig

        transfer = KVTransferConfig(
            kv_connector="TierdConnector",
            kv_connector_module_path="tierd.connector.vllm.connector", kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={**config["connector"],
                                       "socket_path": config["socket_path"],
                                       "engine_name": config["engine_name"]})
    return LLMEngine.from_engine_args(EngineArgs(
        model=config["model"], block_size=32, max_model_len=config["max_model_len"],
        enforce_eager=True, prefix_caching_hash_algo="sha256_cbor", seed=0,
        num_gpu_blocks_override=config["kv_blocks"], kv_transfer_config=transfer))


def _reset(engine: Any) -> None:
    """Empty vLLM's prefix cache with its connector's (retried while blocks are held)."""
    deadline = time.monotonic() + 60
    while not engine.reset_prefix_cache(reset_connector=True):
        if time.monotonic() > deadline:
            raise RuntimeError("vLLM's prefix cache did not empty in 60 s")
        time.sleep(0.05)


def main() -> None:
    config = json.loads(sys.argv[1])
    engine = _engine(config)
    run_case(engine, Case("prefix", seed=-1, clients=4, output_len=8, output_min=8,
                          stop_every=0, prefix_len=256, suffix_len=32, prefixes=4, prompts=8))
    print("READY", flush=True)
    for line in sys.stdin:
        _reset(engine)
        gc.collect()
        run = run_case(engine, Case(**json.loads(line)))
        print("RESULT " + json.dumps(asdict(run)), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    main()
