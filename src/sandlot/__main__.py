"""``python -m sandlot`` is the ``sandlot`` command."""

from sandlot.cli import main

main()
