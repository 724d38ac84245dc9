"""The ``rd2h`` command.

Each subcommand lives in its own module and is imported only when used, so ``rd2h
--help`` stays fast and a missing optional extra only affects the subcommand needing it.
Every subcommand module exposes ``main(argv) -> int``.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

# name -> (module exposing main(argv), one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("rd2h_app.demo", "end-to-end Prefill/Decode transfer on this machine"),
    "check-read": (
        "rd2h_runtime.testing.check_read",
        "two-endpoint read check of a transfer backend",
    ),
    "bench": (
        "rd2h_app.bench",
        "run the benchmarks in benchmarks/ and print their ratios",
    ),
    "spec": ("rd2h_protocol.spec", "regenerate (or --check) the protocol reference in specs/"),
    "proxy": ("rd2h_proxy", "OpenAI-compatible Prefill/Decode proxy with metaserver"),
    "trace": (
        "rd2h_app.timeline",
        "merge protocol traces into a timeline ('rd2h trace check': replay them; "
        "'rd2h trace requests': each request's stages)",
    ),
}


def _usage() -> str:
    width = max(len(name) for name in SUBCOMMANDS)
    lines = ["usage: rd2h <command> [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {text}" for name, (_, text) in SUBCOMMANDS.items()]
    lines += ["", "Run 'rd2h <command> --help' for a command's options."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        print(f"rd2h: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    result: int = module.main(rest)
    return result


if __name__ == "__main__":
    sys.exit(main())
