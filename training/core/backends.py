"""``--backends``: the mcrdl backends a run initializes and, for train_moe, the backend
pinned to each kind of collective (``a2a=gloo,allreduce=mpi``)."""

from __future__ import annotations

from dataclasses import dataclass, field

#: Collective kinds that can be pinned, and the mcrdl operation each one is.
KINDS = {"a2a": "all_to_all_single", "allreduce": "all_reduce", "allgather": "all_gather"}


@dataclass
class Backends:
    """The backend of each collective kind ("auto" unless pinned), and the backends to
    initialize."""

    pinned: dict[str, str] = field(default_factory=dict)
    init: list[str] = field(default_factory=list)

    @classmethod
    def parse(cls, spec: str | None) -> Backends:
        """``"mpi,gloo,a2a=gloo,allreduce=mpi"``: names to initialize and kinds pinned
        (a pinned backend is initialized too). ValueError naming a bad entry."""
        out = cls()
        for item in (spec or "").split(","):
            item = item.strip()
            if not item:
                continue
            if "=" in item:
                kind, _, name = (s.strip() for s in item.partition("="))
                if kind not in KINDS:
                    raise ValueError(f"--backends {spec!r}: unknown collective kind {kind!r}; "
                                     f"expected one of {', '.join(KINDS)}")
                if not name:
                    raise ValueError(f"--backends {spec!r}: {kind}= names no backend")
                out.pinned[kind] = name
                if name != "auto" and name not in out.init:
                    out.init.append(name)
            elif item not in out.init:
                out.init.append(item)
        return out

    def of(self, kind: str) -> str:
        return self.pinned.get(kind, "auto")

    def describe(self) -> str:
        return ", ".join(f"{k}={self.of(k)}" for k in KINDS)
