"""Run on every rank (any launcher): prints, as one JSON line, the port of the store
mcrdl's bootstrap hosts or joins, and, on rank 0, the local addresses that listen on it
(read from /proc/net/tcp and tcp6: no tool needed)."""

import json
import pathlib

import mcrdl


def listening(port: int) -> list[str]:
    """Local addresses in LISTEN state (0A) on `port`, as dotted IPv4 or hex IPv6."""
    found = []
    for name in ("tcp", "tcp6"):
        path = pathlib.Path("/proc/net") / name
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, hexport = local.split(":")
            if state != "0A" or int(hexport, 16) != port:
                continue
            if len(addr) == 8:  # IPv4, little-endian bytes
                addr = ".".join(str(int(addr[i:i + 2], 16)) for i in (6, 4, 2, 0))
            found.append(addr)
    return found


mcrdl.init(["gloo"])
store = mcrdl.api.current_runtime().bootstrap.store()
while hasattr(store, "underlying_store"):  # the session's PrefixStore over the TCPStore
    store = store.underlying_store
rank = mcrdl.get_rank()
print(json.dumps({"rank": rank, "port": store.port,
                  "listening": listening(store.port) if rank == 0 else None}), flush=True)
mcrdl.finalize()
