"""rd2h_vllm: the vLLM KV Connector V1 adapter of RD2H (``SfaRemoteD2HConnector``).

This package requires vLLM; ``rd2h_protocol`` and ``rd2h_runtime`` never import it.
Submodules are imported on use (vLLM's import is slow and the plugin hook must be cheap).
"""
