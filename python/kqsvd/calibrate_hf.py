"""`python -m kqsvd.calibrate_hf`: the command is kqsvd.commands.calibrate_hf."""
import sys

from .commands.calibrate_hf import main

if __name__ == "__main__":
    sys.exit(main())
