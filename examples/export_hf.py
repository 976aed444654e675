#!/bin/sh
"true" '''\'
# Runs with the Python environment that scripts/hf-env.sh prepares (.venv at
# the repository's root, found through symlinks), else with python3 on PATH.
me=$(readlink -f "$0"); v="$(dirname "$me")/../.venv/bin/python3"
[ -x "$v" ] || v=python3; exec "$v" "$me" "$@"
'''
"""The exporter of a checkout: the command is kqsvd.commands.export, which an
installed package runs as `kqsvd-export` (--help says everything)."""
import os
import sys

# The kqsvd package (python/kqsvd) of this repository.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.realpath(__file__)), "..", "python"))

from kqsvd.commands.export import main

if __name__ == "__main__":
    sys.exit(main(prog="examples/export_hf.py", name="export_hf"))
