"""`python -m agent ...` is the same as `palisade-agent ...`."""

from agent.cli import main

raise SystemExit(main())
