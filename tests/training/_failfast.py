"""The entry of the multi-rank check scripts: run main, and on any error print it and
end the process at once (os._exit): a rank left waiting in a collective would hold the
whole launch to its timeout."""

import os
import sys
import traceback
from collections.abc import Callable


def run(main: Callable[[], object]) -> None:
    try:
        main()
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
