"""Programs shipped with mcrdl: mcrdl-bench (bench.py), mcrdl-info (info.py), mcrdl-tune
(tune.py, which runs tuning_suite.py).

They drive mcrdl through its public API, as user code does: they are the only modules
under mcrdl/ besides mcrdl/__init__.py that may import the front (``mcrdl`` /
``mcrdl.api``); nothing below the front imports them.
"""
