"""The command lines: each parses its options, calls the library below it
and prints; cli.py holds what they share (errors, exit statuses, numbers
parsed and checked).  Run as python -m kqsvd.quality, kqsvd.allocate and
kqsvd.calibrate_hf (thin modules at the package's top) and
examples/export_hf.py."""
