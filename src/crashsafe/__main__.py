"""``python -m crashsafe``: the ``crashsafe`` command line."""

from crashsafe.cli import main

main()
