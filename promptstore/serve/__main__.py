"""`python -m promptstore.serve ...`: the same as `promptstore serve ...`."""

import sys

from . import main

sys.exit(main())
