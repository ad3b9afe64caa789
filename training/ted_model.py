"""``python -m training.ted_model``: the command of TED's memory and communication model,
``python -m training.ted.cost_model`` (training/ted/cost_model.py), under the name it is
documented by."""

import sys

from .ted.cost_model import main

if __name__ == "__main__":
    sys.exit(main())
