"""`python -m maskc`: the `maskc` command (maskc/cli)."""
from maskc.cli import main

raise SystemExit(main())
