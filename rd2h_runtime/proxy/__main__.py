"""``python -m rd2h_runtime.proxy``: same as ``rd2h proxy``."""

import sys

from rd2h_runtime.proxy import main

sys.exit(main())
