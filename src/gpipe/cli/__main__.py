"""``python -m gpipe.cli``: the ``gpipe`` command, for environments without its script."""

import sys

from gpipe.cli import main

sys.exit(main())
