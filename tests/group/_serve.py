"""The `promptstore` command, as mlx.launch starts it on each rank (it runs a script)."""

import sys

from promptstore.cli import main

if __name__ == "__main__":
    sys.exit(main())
