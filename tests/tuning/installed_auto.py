"""Run by the python of a venv with a built wheel installed (tests/test_wheel.py), one
rank: which tuning table "auto" routes by in that installed copy, printed as one JSON line.

argv[1]: the shipped table (a file name in the installed mcrdl/tuning_tables/) whose
system this process takes itself for: the CPU and GPU models of the running system are
those of that table's provenance, as on the machine that measured it (the others keep
their real values). "auto" then finds the table with no configuration, unless
MCRDL_TUNING_TABLE names another.

Printed: ``mcrdl`` (the imported package's __file__), ``shipped`` (the tables folder the
package uses), ``routes_by`` (the table init logs "auto" routes by, null for the fixed
rule), ``digest`` (the digest of the table the runtime routes by, null for none),
``backend`` (where an 8 B all_reduce on "auto" ran) and ``predicted`` (where that table
puts it)."""

import json
import logging
import re
import sys

import torch

import mcrdl
import mcrdl.api
from mcrdl.tuning import provenance
from mcrdl.tuning.schema import decode, read

measured_on = provenance.SHIPPED_TABLES / sys.argv[1]
system = decode(read(measured_on), source=str(measured_on)).provenance
real = provenance.current_provenance
provenance.current_provenance = lambda: {
    **real(), **{k: system[k] for k in ("cpu_model", "gpu_model")}}

messages = []
handler = logging.Handler(logging.INFO)
handler.emit = lambda record: messages.append(record.getMessage())
logging.getLogger("mcrdl").addHandler(handler)
logging.getLogger("mcrdl").setLevel(logging.INFO)

mcrdl.init(["mpi", "gloo"])
table = mcrdl.api._runtime.auto_table
work = mcrdl.all_reduce("auto", torch.ones(2), async_op=True)  # 8 B
work.wait()
routes = [m for m in messages if "routes by tuning table" in m]
print(json.dumps({
    "mcrdl": mcrdl.__file__,
    "shipped": str(provenance.SHIPPED_TABLES),
    "routes_by": re.sub(r'^.*routes by tuning table ', "", routes[-1]) if routes else None,
    "digest": None if table is None else table.digest(),
    "backend": work.backend,
    "predicted": None if table is None else table.lookup("all_reduce", 1, 8, ["gloo", "mpi"]),
}))
mcrdl.finalize()
