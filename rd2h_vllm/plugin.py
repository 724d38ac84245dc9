"""vLLM plugin hook: makes ``"kv_connector": "SfaRemoteD2HConnector"`` resolve to rd2h.

vLLM runs every ``vllm.general_plugins`` entry point in each of its processes (API
server, engine core, workers) before it builds connectors, so ``pip install rd2h`` is
all a deployment needs; the guide's JSON stays unchanged. The package declares::

    [project.entry-points."vllm.general_plugins"]
    rd2h = "rd2h_vllm.plugin:register"

Registering the NAME (not only ``kv_connector_module_path``) matters beyond lookup:
inside a MultiConnector, vLLM rebuilds each child's stats by class name through the
same registry (``MultiConnector.build_kv_connector_stats``).

vllm-ascend ships a connector with the same name. When the name is already taken by
another package, :func:`register` leaves it alone and logs how to pick rd2h explicitly
(``"kv_connector_module_path": "rd2h_vllm.connector"``, which vLLM prefers over its
registry) unless ``RD2H_REPLACE_CONNECTOR=1`` asks to take the name over.

``RD2H_BOUND_NIXL_PROGRESS=1`` bounds NIXL's progress-thread delay in the process as
rd2h's nixl backend does (50 us instead of spinning), for a server running vLLM's own
NixlConnector beside rd2h in a comparison (``rd2h bench serving``).
"""

from __future__ import annotations

import logging
import os
from typing import Final

from rd2h_vllm.config import CONNECTOR_MODULE, CONNECTOR_NAME

logger = logging.getLogger(__name__)

#: The ordering multi-connector (RD2H first; the slot-reuse waiter handed to the store).
MULTI_CONNECTOR_NAME: Final = "Rd2hMultiConnector"
MULTI_CONNECTOR_MODULE: Final = "rd2h_vllm.multi"

#: Environment switch: take the connector name over from another package.
REPLACE_ENV: Final = "RD2H_REPLACE_CONNECTOR"

_registered_by_us = False

#: Our loggers, shown through vLLM's own handlers inside vLLM processes.
_LOGGERS: Final = ("rd2h_vllm", "rd2h_runtime", "rd2h_protocol")


def _log_through_vllm() -> None:
    """Give rd2h's loggers vLLM's handlers and level, once.

    vLLM configures only its own ``vllm`` logger; without this, rd2h's start-up lines and
    per-request warnings would be dropped inside ``vllm serve``. Nothing changes when
    vLLM's logging is off (``VLLM_CONFIGURE_LOGGING=0``) or a logger was set up already.
    """
    source = logging.getLogger("vllm")
    if not source.handlers:
        return
    for name in _LOGGERS:
        ours = logging.getLogger(name)
        if ours.handlers:
            continue
        for handler in source.handlers:
            ours.addHandler(handler)
        ours.setLevel(source.level)
        ours.propagate = False


def register() -> None:
    """Register ``SfaRemoteD2HConnector`` -> ``rd2h_vllm.connector`` and
    ``Rd2hMultiConnector`` -> ``rd2h_vllm.multi`` with vLLM.

    Safe to call any number of times, in any process (vLLM may call it repeatedly).
    The connector modules are imported only when vLLM first asks for a class.
    """
    global _registered_by_us
    if os.environ.get("RD2H_BOUND_NIXL_PROGRESS") == "1":
        from rd2h_runtime.transfer.nixl_backend import import_nixl

        import_nixl()  # swaps in the bounded agent config, once per process
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    _log_through_vllm()

    if MULTI_CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(
            MULTI_CONNECTOR_NAME, MULTI_CONNECTOR_MODULE, MULTI_CONNECTOR_NAME
        )

    if CONNECTOR_NAME in KVConnectorFactory._registry:
        if _registered_by_us:
            return
        if os.environ.get(REPLACE_ENV) != "1":
            logger.warning(
                "%s is already registered by another package (vllm-ascend?); rd2h leaves it "
                'in place. To use rd2h, add "kv_connector_module_path": "%s" to '
                "--kv-transfer-config, or set %s=1 to make rd2h take the name over.",
                CONNECTOR_NAME,
                CONNECTOR_MODULE,
                REPLACE_ENV,
            )
            return
        # register_connector refuses a taken name; replacing is a deliberate opt-in.
        del KVConnectorFactory._registry[CONNECTOR_NAME]
        logger.info("%s: replacing the registered connector with rd2h's", CONNECTOR_NAME)
    KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
    _registered_by_us = True
