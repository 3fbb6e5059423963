"""Offline KV-scale calibration (qkv calibrate). Installed as qkv.calibrate."""
