"""Tuning: the tuning tables (``table``; their JSON document ``schema``, where and with
what they were measured ``provenance``), the alpha-beta model that predicts beyond them
(``model``), the size sweeps (``sizes``) and plots (``plot``). ``mcrdl-tune``
(mcrdl.tools.tune, mcrdl.tools.tuning_suite) measures every backend and writes a table;
the tables measured so far ship from the repository's top-level ``tuning_tables/``.
``"auto"`` routes each call by ``table.TuningTable.lookup``."""
