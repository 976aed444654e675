"""`python -m kqsvd.allocate`: the command is kqsvd.commands.allocate."""
import sys

from .commands.allocate import main

if __name__ == "__main__":
    sys.exit(main())
