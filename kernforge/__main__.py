import sys

from kernforge.cli import main

sys.exit(main())
