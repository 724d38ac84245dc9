"""``python -m rd2h_proxy``: same as ``rd2h proxy``."""

import sys

from rd2h_proxy import main

sys.exit(main())
