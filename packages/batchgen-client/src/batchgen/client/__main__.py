"""``python -m batchgen.client`` runs the ``batchgen`` CLI."""

from .cli import main

raise SystemExit(main())
