"""Calibration of kernel parameters by output matching on frozen Q/K/V (Eq. 20, App. B, F.1)."""

from .config import QKV, CalibrationConfig
from .layer import LayerResult, calibrate_layer
from .runner import calibrate_layers, calibrated_layers, load_calibrated, load_calibrated_state
from .sampling import Schedule, layer_generator, make_schedule
from .stats import OutputStats, factor_mse, grouped_output_stats, pair_map, pair_weights, stats_mse

__all__ = [
    "QKV",
    "CalibrationConfig",
    "LayerResult",
    "OutputStats",
    "Schedule",
    "calibrate_layer",
    "calibrate_layers",
    "calibrated_layers",
    "load_calibrated",
    "load_calibrated_state",
    "factor_mse",
    "grouped_output_stats",
    "layer_generator",
    "make_schedule",
    "pair_map",
    "pair_weights",
    "stats_mse",
]
