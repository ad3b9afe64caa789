"""A scratch folder per process for the training checks' outputs, removed at its exit."""

import atexit
import shutil
import tempfile


def scratch_dir(prefix: str) -> str:
    """A new folder under the temporary directory (the test session's own one under
    pytest: tests/conftest.py), removed with its contents when the process exits
    normally (os._exit and a kill leave it, for inspection)."""
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path
