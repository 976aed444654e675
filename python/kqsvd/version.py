"""The package's version: CMakeLists.txt's project VERSION, which the wheel
takes as its own (pyproject.toml), kept equal here for the code that
records what made a file (the in-situ calibration's inputs_hash)."""
__version__ = "0.5.0"
