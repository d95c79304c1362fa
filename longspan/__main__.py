"""``python -m longspan ...`` (also what torchrun runs with ``-m longspan``)."""

from longspan.cli import main

raise SystemExit(main())
