"""The real serving stack of ``tierd bench serve`` and tests/vllm_serve: `tierd serve` and
`vllm serve` (vLLM's CPU build) as processes on loopback and Unix sockets, with the documented
flags, and a streaming HTTP client on vLLM's OpenAI API (stdlib only)."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

from tierd.bench.tierd_serve import TierdServe

BLOCK = 32
"""vLLM's CPU attention needs a block size that is a multiple of 32."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(what: str, check: Any, timeout: float, every: float = 0.25) -> Any:
    """Poll ``check()`` until it returns a truthy value (returned); AssertionError naming
    ``what`` after ``timeout`` seconds (readiness, never a timed assertion of speed)."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(every)


def counter(text: str, name: str) -> float:
    """The sum of Prometheus counter ``name`` (without _total) over its label sets in the
    exposition ``text``."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "_total{") or line.startswith(name + "_total "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def histogram(text: str, name: str) -> tuple[float, float]:
    """(sum, count) of Prometheus histogram ``name`` over its label sets in the exposition
    ``text``."""
    total = [0.0, 0.0]
    for line in text.splitlines():
        for i, suffix in enumerate(("_sum", "_count")):
            if line.startswith(name + suffix + "{") or line.startswith(name + suffix + " "):
                total[i] += float(line.rsplit(" ", 1)[1])
    return total[0], total[1]


def stack_daemon(workdir: str) -> TierdServe:
    """The stack's `tierd serve` (not started) on ``workdir/tierd.sock``: 256 MiB of DRAM and
    1 GiB of SSD in ``workdir/ssd``, kept across restarts (a SIGTERM writes DRAM blocks to SSD;
    a SIGKILL loses at most the write-behind)."""
    return TierdServe(workdir, ["--dram-bytes", "256MiB", "--no-prefault", "--ssd-dir",
                                os.path.join(workdir, "ssd"), "--ssd-bytes", "1GiB"])


@dataclass(frozen=True)
class Greedy:
    """A greedy completion: the prompt's token ids, then each generated token (as vLLM spells a
    token id, ``"token_id:N"``) with the ``top`` most likely tokens at its place and their
    log-probabilities (vLLM's ``logprobs``)."""

    prompt_ids: list[int]
    tokens: list[tuple[str, dict[str, float]]]

    def context(self, generated: int) -> list[int]:
        """The token ids the model saw before generating token ``generated``."""
        return self.prompt_ids + [int(t.removeprefix("token_id:"))
                                  for t, _ in self.tokens[:generated]]


@dataclass
class VllmServe:
    """One `vllm serve` process: ``model`` served as ``name`` with TierdConnector on
    ``socket_path`` (engine name ``engine``; no KV connector at all when ``socket_path`` is
    None: vLLM alone), vLLM's own prefix cache on or off."""

    python: str
    workdir: str
    model: str
    name: str
    engine: str
    socket_path: str | None
    prefix_caching: bool = True
    max_model_len: int = 4096
    kv_blocks: int | None = None
    """Override vLLM's KV-cache size in blocks (a small cache forces preemptions)."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment of the server (``VLLM_CPU_OMP_THREADS_BIND``, ...)."""
    flags: list[str] = field(default_factory=list)
    """Extra `vllm serve` flags."""
    connector_config: dict[str, object] = field(default_factory=dict)
    """More ``kv_connector_extra_config`` keys for TierdConnector (``load``, ``save``, ...)."""
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    def transfer_config(self) -> dict[str, object]:
        """The ``--kv-transfer-config`` of this server where it has a connector."""
        return {"kv_connector": "TierdConnector",
                "kv_connector_module_path": "tierd.connector.vllm.connector",
                "kv_role": "kv_both",
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"retry_seconds": 1.0, **self.connector_config,
                                              "socket_path": self.socket_path,
                                              "engine_name": self.engine}}

    def start(self) -> None:
        vllm = os.path.join(os.path.dirname(self.python), "vllm")  # the console script
        argv = [vllm, "serve", self.model,
                "--served-model-name", self.name, "--host", "127.0.0.1",
                "--port", str(self.port), "--prefix-caching-hash-algo", "sha256_cbor",
                "--block-size", str(BLOCK), "--max-model-len", str(self.max_model_len),
                "--enforce-eager"]
        if self.socket_path is not None:
            argv += ["--kv-transfer-config", json.dumps(self.transfer_config())]
        if not self.prefix_caching:
            argv.append("--no-enable-prefix-caching")
        if self.kv_blocks is not None:
            argv += ["--num-gpu-blocks-override", str(self.kv_blocks)]
        argv += self.flags
        env = {**os.environ, "PYTHONHASHSEED": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
               "TIERD_CONFIG": "", **self.env}
        log = open(self.log_path, "ab")
        self.process = subprocess.Popen(argv, env=env, stdout=log, stderr=log,
                                        start_new_session=True)
        log.close()

    @property
    def log_path(self) -> str:
        return os.path.join(self.workdir, f"vllm-{self.engine}.log")

    def wait_ready(self, timeout: float = 600) -> None:
        def up() -> bool:
            assert self.process is not None and self.process.poll() is None, (
                f"vllm serve {self.engine} exited: see {self.workdir}/vllm-{self.engine}.log")
            try:
                return self._get("/health")[0] == 200
            except OSError:
                return False
        wait_for(f"vllm serve {self.engine}", up, timeout, every=1.0)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.process = None

    def complete(self, prompt: str, max_tokens: int = 8) -> str:
        """The greedy text of a streamed completion (every chunk read to ``[DONE]``)."""
        return self.timed(prompt, max_tokens)[1]

    def timed(self, prompt: str, max_tokens: int = 8, ignore_eos: bool = False,
              sampling: dict[str, object] | None = None) -> tuple[float, str]:
        """(seconds to the first streamed token, the greedy text) of a completion
        (``ignore_eos``: exactly ``max_tokens`` tokens, unless ``sampling``, more of vLLM's
        sampling parameters, names stop tokens)."""
        start = time.perf_counter()
        conn, response = self._stream(prompt, max_tokens, ignore_eos, sampling)
        first: float | None = None
        text = []
        try:
            for line in response:
                if not line.startswith(b"data: "):
                    continue
                body = line[6:].strip()
                if body == b"[DONE]":
                    break
                piece = json.loads(body)["choices"][0]["text"]
                if piece and first is None:
                    first = time.perf_counter() - start
                text.append(piece)
        finally:
            conn.close()
        assert first is not None, "the completion streamed no text"
        return first, "".join(text)

    def abandon(self, prompt: str, max_tokens: int, chunks: int = 2) -> None:
        """Start a streamed completion, read ``chunks`` events and disconnect (an abort)."""
        conn, response = self._stream(prompt, max_tokens)
        seen = 0
        for line in response:
            seen += line.startswith(b"data: ")
            if seen >= chunks:
                break
        conn.close()

    def metric(self, name: str) -> float:
        """The sum of a Prometheus counter over its label sets (``name`` without _total)."""
        return counter(self.metrics_text(), name)

    def metrics_text(self) -> str:
        """vLLM's Prometheus exposition (``/metrics``)."""
        status, body = self._get("/metrics")
        assert status == 200
        return body.decode()

    def reset_prefix_cache(self) -> bool:
        """Empty vLLM's own prefix cache and have its connector do likewise
        (``/reset_prefix_cache?reset_external=true``: the server must run with
        ``VLLM_SERVER_DEV_MODE=1``; TierdConnector then forgets write-back's unsaved blocks, so
        the next run does not write back the last one's); False while blocks are still held
        (the caller retries)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request("POST", "/reset_prefix_cache?reset_external=true")
            response = conn.getresponse()
            body = response.read()
        finally:
            conn.close()
        assert response.status == 200, f"reset_prefix_cache: {response.status} {body[:200]!r}"
        return bool(json.loads(body).get("success", True))

    def external_hits(self) -> float:
        return self.metric("vllm:external_prefix_cache_hits")

    def greedy(self, prompt: str | list[int], max_tokens: int, top: int = 5,
               cache_salt: str | None = None) -> Greedy:
        """A greedy completion of exactly ``max_tokens`` tokens (``ignore_eos``: a path that
        parts at a near tie may reach the end-of-text token sooner) of a text or of token ids,
        token by token (``Greedy``). ``cache_salt``: vLLM's, which changes every block hash, so
        neither vLLM's prefix cache nor tierd holds a block of it from other requests."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
        request: dict[str, Any] = {
            "model": self.name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "logprobs": top, "ignore_eos": True, "return_tokens_as_token_ids": True,
            "return_token_ids": True}
        if cache_salt is not None:
            request["cache_salt"] = cache_salt
        try:
            conn.request("POST", "/v1/completions", json.dumps(request),
                         {"Content-Type": "application/json"})
            response = conn.getresponse()
            reply = response.read()
        finally:
            conn.close()
        assert response.status == 200, reply[:500]
        choice = json.loads(reply)["choices"][0]
        logprobs = choice["logprobs"]
        return Greedy(choice["prompt_token_ids"],
                      list(zip(logprobs["tokens"], logprobs["top_logprobs"])))

    def _stream(self, prompt: str, max_tokens: int, ignore_eos: bool = False,
                sampling: dict[str, object] | None = None
                ) -> tuple[http.client.HTTPConnection, Any]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
        body = json.dumps({"model": self.name, "prompt": prompt, "max_tokens": max_tokens,
                           "temperature": 0, "stream": True, "ignore_eos": ignore_eos,
                           **(sampling or {})})
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200, response.read()[:500]
        return conn, response

    def _get(self, path: str) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request("GET", path)
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()
