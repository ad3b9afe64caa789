"""Tuning: measure every backend (``suite``, ``cli``), keep the results as tuning tables
(``table``), predict beyond them with the alpha-beta model (``model``), plot them
(``plot``). ``"auto"`` routes each call by ``table.TuningTable.lookup``."""
