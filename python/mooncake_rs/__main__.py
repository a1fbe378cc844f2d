"""``python -m mooncake_rs`` is the ``mooncake-rs`` command."""

from .cli import main

raise SystemExit(main())
