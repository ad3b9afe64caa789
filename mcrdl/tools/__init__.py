"""Programs shipped with mcrdl: mcrdl-bench (bench.py), mcrdl-info (info.py), mcrdl-tune
(tune.py, which runs tuning_suite.py). stubgen.py writes the front's type stub,
mcrdl/__init__.pyi, from the op specs (``python -m mcrdl.tools.stubgen``): a development
tool, not an installed command.

They drive mcrdl through its public API, as user code does: they are the only modules
under mcrdl/ besides mcrdl/__init__.py that may import the front (``mcrdl`` /
``mcrdl.api``); nothing below the front imports them.
"""
