"""Tuning: measure every backend (``suite``, ``cli``), keep the results as tuning tables
(``table``; their JSON document ``schema``, where and with what they were measured
``provenance``), predict beyond them with the alpha-beta model (``model``), plot them
(``plot``). ``"auto"`` routes each call by ``table.TuningTable.lookup``."""
