"""The bundle's entry point: the same `tunesmith` command as the console script (studio.cli)."""

import multiprocessing
import sys

from studio.cli import main

if __name__ == "__main__":
    # A frozen program that starts worker processes must let them run as workers, not as a second app.
    multiprocessing.freeze_support()
    sys.exit(main())
