"""``python -m deft.cli``: the ``deft`` command."""

import sys

from . import main

sys.exit(main())
