"""``rd2h proxy``: the OpenAI-compatible Prefill/Decode proxy with its rendezvous metaserver.

A client request goes to a Decode node first; Decode posts one rendezvous per child request
to the proxy's ``/v1/metaserver``; once all have arrived the proxy dispatches the original
request once, in the background, to a Prefill node. See :mod:`rd2h_proxy.server`.

Only :mod:`rd2h_proxy.config` is imported eagerly; the server (and aiohttp, from
the ``proxy`` extra) is imported when first used.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rd2h_protocol.errors import ConfigError, MissingExtra
from rd2h_proxy.config import Backend, ProxyConfig, build_parser, config_from_args

if TYPE_CHECKING:
    from aiohttp import web

__all__ = ["Backend", "ProxyConfig", "build_parser", "config_from_args", "create_app", "main"]


def create_app(config: ProxyConfig) -> web.Application:
    """The proxy as an aiohttp application; see :func:`rd2h_proxy.serving.create_app`."""
    from rd2h_proxy.serving import create_app as _create_app

    return _create_app(config)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``rd2h proxy``: parse, validate, serve. Returns the exit status."""
    parser = build_parser()
    try:
        args: argparse.Namespace = parser.parse_args(list(argv) if argv is not None else None)
    except SystemExit as exc:  # --help or a usage error; argparse already printed why
        return exc.code if isinstance(exc.code, int) else 2
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    try:
        from rd2h_proxy.serving import run
    except MissingExtra as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    run(config)
    return 0
