"""`python -m kvflow.worker ...`: start one worker (what `kvflow worker` and the controller run)."""

import sys

from kvflow.cli.worker import main

sys.exit(main())
