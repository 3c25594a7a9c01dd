"""Engine-side connector: daemon client, KV manager, reference engine, vLLM adapter."""
