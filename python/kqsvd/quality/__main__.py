import sys

from ..commands.quality import main

sys.exit(main())
