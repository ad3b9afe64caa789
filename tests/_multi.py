"""Run several rank scripts one after another in each rank's process: one launch (one
torch import per rank, one MPI world) instead of one per script.

Usage (under a launcher): ``python tests/_multi.py`` with ``$MCRDL_TEST_SCRIPTS`` a JSON
list of ``[script, [args...], {env}]``. Each script runs as ``__main__`` with its
``sys.argv`` and its environment variables set (restored after it; a variable the script
sets itself is not): mcrdl reads its settings at ``init``, and each script must be its
own init/finalize session (one left open fails). Settings read at import
(``MCRDL_LOG_LEVEL``) or when MPI starts (MPICH's variables) cannot differ per script.
Between scripts this prints ``== <script> done``. A script that raises prints its
traceback and ends the process with exit code 1 (the launcher then ends the job): the
scripts after it would otherwise wait on the failed rank until their timeouts.

tests._launch.run_scripts starts one such launch (fixtures of test_mixing, test_training
and test_blocking).
"""

import json
import os
import runpy
import sys
import traceback


def _fail() -> None:
    traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def main() -> None:
    plan = json.loads(os.environ["MCRDL_TEST_SCRIPTS"])
    for script, args, env in plan:
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        sys.argv = [script, *args]
        try:
            runpy.run_path(script, run_name="__main__")
            mcrdl = sys.modules.get("mcrdl")
            # a session left open would hand its timeout and table to the next script's
            if mcrdl is not None and mcrdl.is_initialized():
                raise RuntimeError(f"{script} ended without mcrdl.finalize()")
        except SystemExit as e:
            if e.code not in (None, 0):
                _fail()
        except BaseException:  # noqa: BLE001 - a script's failure, whatever it raised
            _fail()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        print(f"== {os.path.basename(script)} done", flush=True)


if __name__ == "__main__":
    main()
