"""``python -m moebalance``: the command-line tool."""

import sys

from moebalance.app.cli import main

sys.exit(main())
