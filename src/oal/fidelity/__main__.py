"""``python -m oal.fidelity calibrate|fidelity|intervene ...``: the same commands as ``oal calibrate`` etc., usable
before (or without) the main CLI wiring."""

import sys

from ..cli import app
from .cli import register

if __name__ == "__main__":
    sys.argv[0] = "python -m oal.fidelity"
    names = {c.name or (c.callback.__name__ if c.callback else "") for c in app.registered_commands}
    if "calibrate" not in names:
        register(app)
    app()
