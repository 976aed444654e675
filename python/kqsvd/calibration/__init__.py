"""Calibration from a running model: the attention's activations captured
(capture.py), the caches written for `kqsvd calibrate` (cache_export.py),
or folded as they are produced (insitu.py) into the C library's
accumulator (calibrator.py and result.py over binding.py), by the in-situ
calibration's steps (driver.py) with its ranks, checkpoints and test
faults (ranks.py, checkpoints.py, faults.py)."""
