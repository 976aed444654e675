"""`python -m kqsvd.frontier`: the command is kqsvd.commands.frontier."""
import sys

from .commands.frontier import main

if __name__ == "__main__":
    sys.exit(main())
