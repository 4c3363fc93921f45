"""``python -m deft`` (and ``torchrun ... -m deft``): the ``deft`` command."""

import sys

from .cli import main

sys.exit(main())
