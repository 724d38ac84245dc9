"""What tests, benchmarks, the demo and other connectors drive the runtime with.

``synthetic`` (a synthetic model: KV caches shaped like a sparse-attention model, and the
byte pattern each destination must hold), ``engines`` (Prefill and Decode engines over the
real workers, in this process; ``child_engines`` runs one in a spawned child process),
``netns`` (two hosts on one machine as network namespaces), ``check_read`` (the
two-endpoint read check of a transfer backend, ``rd2h check-read``; its two sides, each
runnable alone on its host, are ``check_read_sides``, whose Prefill source the transfer
tests use).

The runtime proper (workers, control plane, transfer backends, planning, trace writer)
never imports this package (``[tool.importlinter]`` in pyproject.toml).
"""
