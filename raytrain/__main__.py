"""`python -m raytrain` entry point (same as the `raytrain` console script)."""

from raytrain.cli import main

raise SystemExit(main())
