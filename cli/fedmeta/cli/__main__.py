"""``python -m fedmeta.cli``: the ``fedmeta`` command."""

import sys

from fedmeta.cli import main

sys.exit(main())
