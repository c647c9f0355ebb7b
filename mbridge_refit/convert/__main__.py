"""``python -m mbridge_refit.convert``.

SIGINT and SIGTERM interrupt the process from this module's first line (``interrupts``): one that
comes while ``app`` is still being imported, before ``app.main`` handles it (a command's own
modules, torch among them, are imported inside ``app.main``, under its handling), ends with one line and
128 + the signal's number, as ``app.main`` ends an interrupt; one that comes once the command has
ended (the interpreter's clean-up) ends the process at once with the same code. One that comes
before this module runs (the interpreter's own start and the light package imports, milliseconds
on an idle machine) gets Python's own handling: no code of this package has run yet.
"""

import logging
import signal
import sys

from mbridge_refit.convert.exit_codes import signal_exit_code
from mbridge_refit.convert.interrupts import exit_on_signal, interrupt_from_now, interrupt_signal


def _run() -> int:
    interrupt_from_now()  # kept until exit_on_signal replaces it: no moment with Python's own handling
    try:
        from mbridge_refit.convert.app import main

        code = main()
        exit_on_signal(code)
    except KeyboardInterrupt as err:  # while app was imported (or as main returned)
        signum = interrupt_signal(err)
        code = signal_exit_code(signum)
        exit_on_signal(code)
        logging.getLogger("mbridge_refit.convert").error(
            "interrupted by %s (exit code %d)", signal.Signals(signum).name, code
        )
    return code


sys.exit(_run())
