"""`python -m latentserve.cli`."""
import sys

from latentserve.cli import main

if __name__ == "__main__":
    sys.exit(main())
