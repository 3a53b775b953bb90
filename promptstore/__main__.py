"""`python -m promptstore ...`: the `promptstore` command."""

import sys

from .cli import main

sys.exit(main())
