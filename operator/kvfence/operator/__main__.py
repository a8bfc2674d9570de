"""``python -m kvfence.operator``: the same as ``kvfence-operator``."""

from kvfence.operator.main import main

raise SystemExit(main())
