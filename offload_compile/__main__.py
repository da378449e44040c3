"""``python -m hyper_offload``: the same CLI as the ``hyper-offload`` console script."""

from .cli import main

raise SystemExit(main())
