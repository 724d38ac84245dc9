"""``python -m rd2h_protocol.checker``: see :mod:`rd2h_protocol.checker.cli`."""

import sys

from rd2h_protocol.checker.cli import main

sys.exit(main())
