"""``-h``/``--help`` for the tools that read plain positional arguments: the tool's docstring
(which says how to run it), printed before anything needs a GPU."""

import sys


def args(doc: str | None) -> list[str]:
    """The command line's arguments; on ``-h`` or ``--help``, print ``doc`` and exit 0."""
    if any(a in ("-h", "--help") for a in sys.argv[1:]):
        print((doc or "").strip())
        raise SystemExit(0)
    return sys.argv[1:]
