"""``python -m mbridge_refit.convert``."""

import sys

from mbridge_refit.convert.app import main

sys.exit(main())
