"""The reference engine: a small paged-attention Llama engine (``engine``, ``model``) with its own
block pool and KV cache manager (``block_pool``, ``kv_cache_manager``), the transfer hooks it
calls (``hooks``) and their tierd implementation (``tierd_hooks``, ``tierd_jobs``,
``tierd_config``, save staging in ``staging``). It serves ``tierd demo``, the end-to-end tests
and benchmarks; production engines use ``tierd.connector.vllm`` or ``tierd.connector.sglang``.
"""
