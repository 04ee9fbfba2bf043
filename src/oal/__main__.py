"""``python -m oal …``: the ``oal`` command line, e.g. as ``accelerate launch -m oal finetune …``."""

from .cli import app

app(prog_name="oal")
