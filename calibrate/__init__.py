"""Offline KV-scale calibration (``qkv calibrate``). Installed as ``qkv.calibrate``.

What other packages may use is re-exported here: the evaluation package (``--search``) imports this module
only, never its submodules, and the import-linter contracts in pyproject.toml hold it to that.
"""

from .checkpoint import write_checkpoint, write_scales_file
from .data import RawData, Samples, build_samples, load_rows
from .run import (
    CALIBRATED_DTYPES,
    STRATEGIES,
    Calibration,
    CalibrationSpec,
    calibrate,
    calibrate_grid,
    load_engine,
    observe,
)

__all__ = [
    "CALIBRATED_DTYPES",
    "STRATEGIES",
    "CalibrationSpec",
    "Calibration",
    "RawData",
    "Samples",
    "build_samples",
    "calibrate",
    "calibrate_grid",
    "load_engine",
    "load_rows",
    "observe",
    "write_checkpoint",
    "write_scales_file",
]
