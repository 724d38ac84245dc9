"""The ``rd2h`` command and what it runs: the application on the top floor.

``cli`` (the ``rd2h`` command, the console script), ``demo`` (``rd2h demo`` over the
synthetic engines of :mod:`rd2h_runtime.testing`), ``vllm_demo`` (``rd2h demo --vllm``, two
real vLLM servers and the proxy), ``bench`` (``rd2h bench``), ``timeline`` and
``breakdown`` (``rd2h trace``, ``rd2h trace requests``; ``rd2h trace check`` is
:mod:`rd2h_protocol.checker.replay`). ``rd2h check-read`` runs
:mod:`rd2h_runtime.testing.check_read`, ``rd2h proxy`` :mod:`rd2h_proxy`, ``rd2h spec``
:mod:`rd2h_protocol.spec`.

Imports point down only: this package imports the others, nothing imports it
(``[tool.importlinter]`` in pyproject.toml states the layers; ``lint-imports`` checks them).
"""
