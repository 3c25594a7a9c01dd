"""tierd inside vLLM, two integrations in two rooms: ``connector/`` (``TierdConnector``, a v1 KV
connector) and ``tier/`` (``TierdTier``, a secondary tier of vLLM's native tiered offloading).
Shared by both (and by the SGLang backend): ``config`` (the extra-config keys) and ``identity``
(the model id). See docs/vllm.md.
"""
