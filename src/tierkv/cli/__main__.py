"""``python -m tierkv.cli`` is the `tierkv` command."""

from tierkv.cli import main

main()
