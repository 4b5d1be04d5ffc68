"""``python -m kvspec_core`` runs the ``kvspec`` command line."""

from kvspec_core.cli.main import main

raise SystemExit(main())
