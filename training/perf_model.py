"""``python -m training.perf_model``: the command of the 4D engine's performance model,
``python -m training.parallel4d.perf_model`` (training/parallel4d/perf_model/), under
the name it is documented by."""

import sys

from .parallel4d.perf_model.__main__ import main

if __name__ == "__main__":
    sys.exit(main())
