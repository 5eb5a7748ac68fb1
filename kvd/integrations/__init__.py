"""Glue between kvd and inference engines (issue 17).

- :mod:`kvd.integrations.vllm`: ``KvdConnector``, a vLLM KV connector (prefix reuse across requests and engines).
- :mod:`kvd.integrations.transformers`: ``KvdCache``, a transformers ``Cache`` that stores and resumes sequences.
- :mod:`kvd.integrations.model`: builds the offline SmolLM2-135M folder the tests and benchmarks run on.

This package imports nothing itself: ``import kvd`` (and ``import kvd.integrations``) must never pull in torch,
transformers or vLLM, which only the engine venv (bin/engines-env) has. Each module imports its engine itself.
"""
