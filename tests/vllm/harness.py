"""Real vLLM 0.33 around tierd's connector: vLLM's own config, scheduler, connector factory and
KV allocation, a real `tierd serve` on a temporary socket, and a stand-in *forward pass* (the one
part vLLM cannot run on a CPU host without its CPU build).

The forward pass makes KV content matter: at each position it reads the previous position's
state back out of the KV cache (two bytes of layer 0), mixes in the token, and writes a byte
pattern derived from the new state into every layer; the sampled token is a function of the
last state. So a wrong or missing block changes every later token, and a run with tierd
produces the same tokens as a run without it only if every loaded block was right.

Run by `make test-vllm` (the vLLM venv); the main suite skips these modules (no vLLM there).
Fixtures are in this folder's conftest.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs real vLLM: run `make test-vllm`")

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.utils.hashing import sha256_cbor  # noqa: E402
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

from tierd.bench.tierd_serve import TierdServe  # noqa: E402

EOS = 999
BLOCK = 16
LAYERS = 3
KV_HEADS = 2
HEAD = 16
VOCAB = 1000


def model_dir_in(root: str, name: str = "tiny-llama", seed: int = 0) -> str:
    """Write the tiny model's directory under ``root`` (``config.json`` and one safetensors
    file of seeded weights: every ``seed`` has the same config and shapes, other weights);
    returns its path. The stand-in forward pass never reads the weights; tierd's model
    identity does."""
    path = os.path.join(root, name)
    os.makedirs(path, exist_ok=True)
    write_weights(path, seed)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_attention_heads": 4,
              "num_key_value_heads": KV_HEADS, "num_hidden_layers": LAYERS,
              "vocab_size": VOCAB, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
              "torch_dtype": "float16", "head_dim": HEAD, "eos_token_id": EOS}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def write_weights(model_dir: str, seed: int) -> None:
    """(Re)write the tiny model's weight file with weights drawn from ``seed``."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    weights = {f"model.layers.{i}.self_attn.{w}.weight": torch.randn(64, 64, generator=gen)
               .to(torch.float16) for i in range(LAYERS) for w in ("q_proj", "k_proj")}
    weights["model.embed_tokens.weight"] = torch.randn(VOCAB, 64, generator=gen).to(torch.float16)
    save_file(weights, os.path.join(model_dir, "model.safetensors"))


def engine_layout(config: VllmConfig) -> Any:
    """The tierd ``Layout`` TierdConnector registers for rank 0 of ``config`` (its model id
    derived as the connector derives it)."""
    from tierd.connector.vllm.connector import layout_from_vllm_config
    from tierd.connector.vllm.identity import model_identity_from_vllm

    extra = config.kv_transfer_config.kv_connector_extra_config
    model_id = model_identity_from_vllm(config, extra.get("model_id")).model_id
    return layout_from_vllm_config(config, model_id)


def vllm_config(model_dir: str, socket_path: str, *, policy: str = "recompute",
                layout: KVCacheLayout = KVCacheLayout.LBNHC, dtype: str = "float16",
                cache_dtype: str = "auto", async_scheduling: bool = False,
                extra: dict[str, Any] | None = None, tp: int = 1) -> VllmConfig:
    """vLLM's ``VllmConfig`` with TierdConnector as its KV connector (as `vllm serve
    --kv-transfer-config` would build it) and ``layout`` resolved as the engine core does."""
    model = ModelConfig(model=model_dir, dtype=dtype, skip_tokenizer_init=True, seed=0)
    scheduler = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=2048,
                                is_encoder_decoder=False, async_scheduling=async_scheduling)
    cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=True, cache_dtype=cache_dtype,
                        prefix_caching_hash_algo="sha256_cbor")
    transfer = KVTransferConfig(
        kv_connector="TierdConnector", kv_connector_module_path="tierd.connector.vllm.connector",
        kv_role="kv_both", kv_load_failure_policy=policy,
        kv_connector_extra_config={"socket_path": socket_path, "retry_seconds": 0.0,
                                   **(extra or {})})
    config = VllmConfig(model_config=model, scheduler_config=scheduler, cache_config=cache,
                        kv_transfer_config=transfer, device_config=DeviceConfig("cpu"),
                        parallel_config=ParallelConfig(tensor_parallel_size=tp))
    config.cache_config.kv_cache_layout = layout.name
    return config


def kv_cache_config(config: VllmConfig, num_blocks: int) -> Any:
    """vLLM's ``KVCacheConfig`` for the tiny model: one full-attention group, ``num_blocks``
    blocks, tensors placed by vLLM's planner for the config's layout."""
    torch_dtype = {"auto": config.model_config.dtype, "fp8": torch.float8_e4m3fn,
                   "fp8_e4m3": torch.float8_e4m3fn,
                   "fp8_e5m2": torch.float8_e5m2}[config.cache_config.cache_dtype]
    heads = KV_HEADS // config.parallel_config.tensor_parallel_size  # this rank's share
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=heads, head_size=HEAD,
                             dtype=torch_dtype)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    config.cache_config.num_gpu_blocks = num_blocks
    return get_kv_cache_config_from_groups(config, [KVCacheGroupSpec(layers, spec)],
                                           spec.page_size_bytes * LAYERS * num_blocks)


def kv_caches(config: VllmConfig, kcc: Any) -> dict[str, torch.Tensor]:
    """The per-layer KV views exactly as vLLM's worker allocates them."""
    layout = KVCacheLayout[config.cache_config.kv_cache_layout]
    return allocate_kv_cache(kcc, torch.device("cpu"), layout)


_NONE_HASH_READY = False


def make_request(req_id: str, prompt: list[int], max_tokens: int = 4) -> Request:
    """A vLLM ``Request`` with vLLM's own block hasher (sha256_cbor, as the engine core
    attaches it), greedy, stopping at ``max_tokens`` or EOS."""
    global _NONE_HASH_READY
    if not _NONE_HASH_READY:
        init_none_hash(sha256_cbor)
        _NONE_HASH_READY = True
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    params.update_from_generation_config({}, EOS)
    return Request(request_id=req_id, prompt_token_ids=list(prompt), sampling_params=params,
                   pooling_params=None, mm_features=None,
                   block_hasher=get_request_block_hasher(BLOCK, sha256_cbor))


@dataclass
class Engine:
    """One vLLM engine: the real scheduler (which builds the scheduler-side TierdConnector
    through vLLM's factory), one worker-side TierdConnector per TP rank from the same factory,
    each holding KV tensors from ``allocate_kv_cache``, the ranks' outputs merged by vLLM's
    own ``KVOutputAggregator``, and the stand-in forward pass of the module doc. ``worker`` and
    ``kv`` are rank 0's."""

    config: VllmConfig
    scheduler: Scheduler
    workers: list[Any]
    kvs: list[dict[str, torch.Tensor]]
    tokens: dict[str, list[int]] = field(default_factory=dict)
    finish: dict[str, str] = field(default_factory=dict)
    invalid_reported: set[int] = field(default_factory=set)
    recved: set[str] = field(default_factory=set)  # requests some rank reported as received
    between: Any = None  # called with the engine after schedule(), before the forward pass
    external: list[int] = field(default_factory=lambda: [0, 0])  # vLLM's connector queries, hits
    _last: dict[str, int] = field(default_factory=dict)
    # One for the engine's life, as vLLM's executor keeps it: a request is received once every
    # rank has reported it, in whichever steps they do.
    _aggregator: Any = None

    def __post_init__(self) -> None:
        self._aggregator = KVOutputAggregator(len(self.workers))

    @classmethod
    def start(cls, config: VllmConfig, num_blocks: int = 64) -> Engine:
        kcc = kv_cache_config(config, num_blocks)
        scheduler_cls = AsyncScheduler if config.scheduler_config.async_scheduling else Scheduler
        scheduler = scheduler_cls(vllm_config=config, kv_cache_config=kcc, log_stats=True,
                                  structured_output_manager=StructuredOutputManager(config),
                                  block_size=BLOCK)
        workers, kvs = [], []
        for rank in range(config.parallel_config.tensor_parallel_size):
            config.parallel_config.rank = rank  # read by register_kv_caches, as in a worker
            worker = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kcc)
            kv = kv_caches(config, kcc)
            worker.register_kv_caches(kv)
            workers.append(worker)
            kvs.append(kv)
        config.parallel_config.rank = 0
        return cls(config, scheduler, workers, kvs)

    @property
    def worker(self) -> Any:
        return self.workers[0]

    @property
    def kv(self) -> dict[str, torch.Tensor]:
        return self.kvs[0]

    def close(self) -> None:
        for worker in self.workers:
            worker.shutdown()
        self.scheduler.shutdown()

    @property
    def connector(self) -> Any:
        return self.scheduler.connector

    def settle_scheduler(self) -> None:
        """Wait for the scheduler-side connector's daemon calls in flight (its lookups and
        releases run on a runner; a lease released is then no longer pinned)."""
        side = getattr(self.connector, "_scheduler", None)
        if side is not None:
            assert side.drain(30.0), "a scheduler-side daemon call never finished"

    def schedule_until_loads(self, steps: int = 500) -> Any:
        """``scheduler.schedule()`` until a step plans a load (the connector's lookup answers
        None until its job is done, and vLLM asks again at each step); that step's output."""
        for _ in range(steps):
            out = self.scheduler.schedule()
            if out.kv_connector_metadata.loads:
                return out
            self.scheduler.update_from_output(out, self._forward(out))
            time.sleep(0.002)
        raise AssertionError("no step planned a load")

    def run_connector_step(self, out: Any) -> None:
        """The connectors' part of a step ``schedule()`` returned whose requests are gone since
        (aborted): every worker binds its metadata, loads and ends the step, and their merged
        report reaches the scheduler's connector, as vLLM's executor hands it over."""
        outputs = []
        for w in self.workers:
            w.handle_preemptions(out.kv_connector_metadata)
            w.bind_connector_metadata(out.kv_connector_metadata)
            w.start_load_kv(None)
            w.wait_for_save()
            conn = KVConnectorOutput(invalid_block_ids=w.get_block_ids_with_load_errors(),
                                     kv_connector_worker_meta=w.build_connector_worker_meta())
            w.clear_connector_metadata()
            outputs.append(ModelRunnerOutput(req_ids=[], req_id_to_index={},
                                             sampled_token_ids=[], logprobs=None,
                                             prompt_logprobs_dict={}, pooler_output=None,
                                             kv_connector_output=conn))
        merged = self._aggregator.aggregate(outputs)
        assert merged is not None and merged.kv_connector_output is not None
        self.connector.update_connector_output(merged.kv_connector_output)

    # -- the stand-in forward pass -----------------------------------------------------------

    def _bytes(self, rank: int, layer: int) -> torch.Tensor:
        return list(self.kvs[rank].values())[layer].view(torch.uint8)  # [B, H, N, C bytes]

    def _state_at(self, table: list[int], pos: int) -> int:
        """The state after ``pos``, as every rank's layer 0 holds it (their sum: the stand-in
        of TP's all-reduce, so one rank's wrong block changes the result)."""
        if pos < 0:
            return 7
        total = 0
        for rank in range(len(self.kvs)):
            cell = self._bytes(rank, 0)[table[pos // BLOCK], 0, pos % BLOCK]
            total += int(cell[0]) | int(cell[1]) << 8
        return total % 65521

    def _write(self, table: list[int], pos: int, state: int) -> None:
        for rank in range(len(self.kvs)):
            for layer in range(LAYERS):
                view = self._bytes(rank, layer)[table[pos // BLOCK], :, pos % BLOCK]
                pattern = (torch.arange(view.numel(), dtype=torch.int64) * 13 + state
                           + layer * 7 + rank * 3)
                view.copy_((pattern % 256).to(torch.uint8).view(view.shape))
                if layer == 0:
                    view[0, 0], view[0, 1] = state & 0xFF, state >> 8

    def _compute(self, out: Any, spans: list[tuple[str, int]]
                 ) -> tuple[list[str], list[list[int]], list[int]]:
        """One pass of the stand-in model over the step's ``spans`` (request, first position):
        (request ids, each one's sampled tokens, every state written, in order)."""
        req_ids: list[str] = []
        sampled: list[list[int]] = []
        written: list[int] = []
        for req_id, start in spans:
            request = self.scheduler.requests[req_id]
            table = list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[0])
            known = self.tokens.get(req_id, [])
            ids = list(request.prompt_token_ids or ()) + known
            state = self._state_at(table, start - 1)
            for pos in range(start, start + out.num_scheduled_tokens[req_id]):
                if pos >= len(ids):  # async scheduling: the token sampled last step
                    ids.append(self._last[req_id])
                state = (state * 31 + ids[pos] + 1) % 65521
                self._write(table, pos, state)
                state = self._state_at(table, pos)  # as the ranks' sum sees it
                written.append(state)
            req_ids.append(req_id)
            if start + out.num_scheduled_tokens[req_id] < request.num_tokens:
                sampled.append([])  # a prefill chunk that does not reach the end samples nothing
                continue
            sampled.append([state % (VOCAB - 1)])
        return req_ids, sampled, written

    def _forward(self, out: Any) -> ModelRunnerOutput:
        """Run one scheduled step through every rank's worker connector in vLLM's model-runner
        order (handle_preemptions, bind, start_load_kv, per-layer save_kv_layer, wait_for_save,
        reports, clear) and merge the ranks' outputs with vLLM's KVOutputAggregator."""
        for w in self.workers:
            w.handle_preemptions(out.kv_connector_metadata)
            w.bind_connector_metadata(out.kv_connector_metadata)
            w.start_load_kv(None)
        spans = [(n.req_id, n.num_computed_tokens) for n in out.scheduled_new_reqs]
        cached = out.scheduled_cached_reqs
        spans += list(zip(cached.req_ids, cached.num_computed_tokens))
        # A real forward pass writes every layer's KV of the whole step before attention reads
        # it, so a request may read blocks another request of the same step computes (a local
        # hit on blocks being recomputed): passes until no written state changes.
        done: list[int] | None = None
        for _ in range(len(spans) + 1):
            req_ids, sampled, written = self._compute(out, spans)
            if written == done:
                break
            done = written
        for req_id, tokens in zip(req_ids, sampled):
            if tokens:
                self._last[req_id] = tokens[0]
        outputs = []
        for w, kv in zip(self.workers, self.kvs):
            for name, tensor in kv.items():
                w.save_kv_layer(name, tensor, None)
            w.wait_for_save()
            results = w.get_transfer_results(out.finished_req_ids)  # then errors, as vLLM
            invalid = w.get_block_ids_with_load_errors()
            self.invalid_reported |= invalid
            self.recved |= results.finished_recving
            conn = KVConnectorOutput(finished_sending=results.finished_sending or None,
                                     finished_recving=results.finished_recving or None,
                                     failed_recving=results.failed_recving,
                                     invalid_block_ids=invalid,
                                     kv_connector_stats=w.get_kv_connector_stats(),
                                     kv_connector_worker_meta=w.build_connector_worker_meta())
            w.clear_connector_metadata()
            outputs.append(ModelRunnerOutput(
                req_ids=list(req_ids), req_id_to_index={r: i for i, r in enumerate(req_ids)},
                sampled_token_ids=[list(t) for t in sampled], logprobs=None,
                prompt_logprobs_dict={}, pooler_output=None, kv_connector_output=conn))
        merged = self._aggregator.aggregate(outputs)
        assert merged is not None
        return merged

    def _absorb(self, outputs: dict[int, Any]) -> None:
        for engine_outputs in outputs.values():
            stats = engine_outputs.scheduler_stats
            counted = stats.connector_prefix_cache_stats if stats is not None else None
            if counted is not None:  # vLLM's external prefix-cache stats, preemptions apart
                self.external[0] += counted.queries
                self.external[1] += counted.hits
            for o in engine_outputs.outputs:
                self.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    self.finish[o.request_id] = str(o.finish_reason)

    def run(self, requests: list[Request], max_steps: int = 500) -> dict[str, list[int]]:
        """Add ``requests`` and step until all finish; returns their generated tokens. With
        async scheduling, each step's output is applied after the next step is scheduled, as
        vLLM's engine core does with its batch queue."""
        for request in requests:
            self.scheduler.add_request(request)
        pending: tuple[Any, ModelRunnerOutput] | None = None
        for _ in range(max_steps):
            if not self.scheduler.has_requests() and pending is None:
                break
            out = self.scheduler.schedule()
            if self.between is not None:
                self.between(self, out)
            result = self._forward(out)
            if not out.total_num_scheduled_tokens:  # e.g. waiting for a streamed load, as
                time.sleep(0.001)                   # vLLM's busy loop polls the workers
            if self.config.scheduler_config.async_scheduling:
                if pending is not None:
                    self._absorb(self.scheduler.update_from_output(*pending))
                pending = (out, result)
                if not out.total_num_scheduled_tokens:
                    self._absorb(self.scheduler.update_from_output(*pending))
                    pending = None
            else:
                self._absorb(self.scheduler.update_from_output(out, result))
        else:
            raise AssertionError("requests did not finish")
        for worker in self.workers:  # wait for the write-through to land
            assert worker.worker_counters is not None
        self.settle_scheduler()
        return {r.request_id: self.tokens.get(r.request_id, []) for r in requests}


class Daemon(TierdServe):
    """A real `tierd serve` on a Unix socket in ``workdir``, with an empty SSD directory
    ``ssd-N`` at its N-th start (none without ``ssd``); ``demote_all`` moves every committed
    block to SSD at once. ``restart(kill=True)`` kills it (SIGKILL) and starts a fresh one on
    the same socket."""

    def __init__(self, workdir: str, ssd: bool = True, demote_all: bool = False,
                 dram_bytes: int = 32 << 20) -> None:
        super().__init__(workdir, [
            "--dram-bytes", str(dram_bytes), "--slab-bytes", "64KiB", "--no-prefault",
            "--ssd-bytes", "8MiB",
            *(["--dram-high-watermark", "1e-9", "--dram-low-watermark", "1e-9",
               "--maintain-seconds", "0.05"] if demote_all else [])])
        self.ssd, self.dram_bytes, self.demote_all = ssd, dram_bytes, demote_all

    def start(self, *flags: str, timeout: float = 60.0) -> subprocess.Popen[bytes]:
        ssd = os.path.join(self.workdir, f"ssd-{self.starts + 1}") if self.ssd else ""
        return super().start("--ssd-dir", ssd, *flags, timeout=timeout)
