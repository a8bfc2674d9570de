"""``python -m kvfence.engine --config FILE``: the reference engine server."""

import sys

from kvfence.engine.cli import main

sys.exit(main())
