"""``python -m mbridge_refit.convert``.

An interrupt (SIGINT: Ctrl-C, or the ``--nproc-per-node`` launcher stopping its ranks) that comes
while torch is still being imported, before ``app.main`` handles it, ends with one line and exit
code 3 (internal error, as ``app.main`` ends an interrupt), not a traceback. One that comes before
this module runs (the interpreter's own start and the two light package imports, milliseconds on
an idle machine) gets Python's traceback: no code of this package has run yet.
"""

import logging
import sys


def _run() -> int:
    try:
        from mbridge_refit.convert.app import main

        return main()
    except KeyboardInterrupt:
        logging.getLogger("mbridge_refit.convert").error("interrupted while starting (exit code 3)")
        return 3


sys.exit(_run())
