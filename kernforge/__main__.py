import sys

from kernforge.cache.cli import main

sys.exit(main())
