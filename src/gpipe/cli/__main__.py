"""``python -m gpipe.cli``: the ``gpipe`` command, for environments without its script."""

import sys

from gpipe.cli import main

if __name__ == "__main__":
    sys.exit(main())
