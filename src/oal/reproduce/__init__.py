"""End-to-end reproduction of §5 (Tables 2 and 3) as one resumable pipeline: ``oal reproduce``.

Typical use::

    from oal.reproduce import preset, run_reproduce

    data = run_reproduce(preset("demo"), out="runs/demo")   # reproduce.json's content
"""

from .pipeline import DEFAULT_CACHE, DEFAULT_MODEL, DEFAULT_OUT, ReproduceConflict, Reproduction, Stage, run_reproduce
from .presets import ALL_METHODS, DEFAULT_PRESET, PAPER_METHODS, PRESETS, ReproducePreset, check_methods, preset
from .report import METRICS, method_metrics, reproduce_json, write_report

__all__ = [
    "ALL_METHODS",
    "DEFAULT_CACHE",
    "DEFAULT_MODEL",
    "DEFAULT_OUT",
    "DEFAULT_PRESET",
    "METRICS",
    "PAPER_METHODS",
    "PRESETS",
    "ReproduceConflict",
    "ReproducePreset",
    "Reproduction",
    "Stage",
    "check_methods",
    "method_metrics",
    "preset",
    "reproduce_json",
    "run_reproduce",
    "write_report",
]
