"""``sparkbus demo`` from a checkout without the console script: the program is sparkbus.demo.run."""

import sys

from sparkbus.demo.run import main

if __name__ == "__main__":
    sys.exit(main())
