"""The operations of mcrdl, each declared once: :data:`OPS`.

Every layer derives what it needs from these specs, by parameter *name*: the public
front functions (``mcrdl.all_reduce`` ...), the default methods of the Backend base
class, argument validation (and the C++ argument decoding in csrc/module.cpp), the
debug-mode call signature, the byte counts of "auto" and the comm logger, the bus
bandwidth factors of mcrdl-bench, and the sets of operations the extensions apply to.
Adding an operation or a parameter starts here.

An operation reaches a backend as a method call of the same name whose positional
arguments are the spec's parameters in order, then ``group`` and ``async_op``
(:meth:`OpSpec.signature`). Layers that handle every operation alike receive it as a
:class:`Call`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .errors import InvalidArgumentError


class ReduceOp(enum.IntEnum):
    """Reduction operators. Values are shared with the C++ core (csrc/common.h).

    On bool tensors SUM, MAX and BOR are logical or; PRODUCT, MIN and BAND logical and;
    BXOR logical xor. AVG applies to floating types only (SUM divided by the group size);
    BAND, BOR and BXOR to integer and bool types only.
    """

    SUM = 0
    PRODUCT = 1
    MIN = 2
    MAX = 3
    AVG = 4
    BAND = 5
    BOR = 6
    BXOR = 7
    PROD = 1  # alias of PRODUCT


def to_reduce_op(op: object) -> ReduceOp:
    """Accept a mcrdl.ReduceOp or its int value, its name, or a torch.distributed.ReduceOp."""
    if isinstance(op, ReduceOp):
        return op
    name = None
    if isinstance(op, bool):
        pass
    elif isinstance(op, int):
        if 0 <= op <= 7:
            return ReduceOp(op)
    elif isinstance(op, str):
        name = op.upper()
    else:  # torch.distributed.ReduceOp / RedOpType
        name = getattr(op, "name", None)
        if name is None and torch.distributed.is_available():
            torch_op = torch.distributed.ReduceOp
            name = next((m for m in ReduceOp.__members__
                         if getattr(torch_op, m, None) is not None and op == getattr(torch_op, m)),
                        None)
    if name in ReduceOp.__members__:
        return ReduceOp[name]
    raise InvalidArgumentError(
        f"'op' is {op!r}; expected a mcrdl.ReduceOp or torch.distributed.ReduceOp "
        f"(SUM, PRODUCT, MIN, MAX, AVG, BAND, BOR, BXOR)"
    )


#: Every dtype of the API (the debug signature encodes a dtype by its index here).
DTYPES = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
    torch.bool,
)
HALF_DTYPES = (torch.float16, torch.bfloat16)


# -- the reduction policy shared by every backend ---------------------------------------

@dataclass(frozen=True)
class ReducePlan:
    """How a backend reduces ``dtype`` with ``op`` when its library lacks the type or
    the operator: reduce a ``dtype`` copy (bool as uint8 0/1, float16/bfloat16 in
    float32, rounded once at the end) with ``op``, then divide by the group size when
    ``average`` (AVG is SUM then a division)."""

    dtype: torch.dtype
    op: ReduceOp
    average: bool


# bool reduces as uint8 0/1 with bitwise operators: or = SUM/MAX/BOR, and =
# PRODUCT/MIN/BAND, xor = BXOR.
_BOOL_OPS = {ReduceOp.SUM: ReduceOp.BOR, ReduceOp.MAX: ReduceOp.BOR, ReduceOp.BOR: ReduceOp.BOR,
             ReduceOp.PRODUCT: ReduceOp.BAND, ReduceOp.MIN: ReduceOp.BAND,
             ReduceOp.BAND: ReduceOp.BAND, ReduceOp.BXOR: ReduceOp.BXOR}


def reduce_plan(dtype: torch.dtype, op: ReduceOp, *, native_avg: bool = False,
                native_half: bool = False) -> ReducePlan:
    """The :class:`ReducePlan` of a reduction (the op/dtype pair already validated).
    ``native_avg``/``native_half``: the library has AVG / reduces 16-bit floats itself.
    An emulated AVG of 16-bit floats sums in float32 either way: a half-precision SUM
    overflows long before the average does. The C++ backends apply the same rule
    (csrc/common.h ``reduce_rule``)."""
    if dtype == torch.bool:
        return ReducePlan(torch.uint8, _BOOL_OPS[op], False)
    average = op == ReduceOp.AVG and not native_avg
    upcast = dtype in HALF_DTYPES and (average or not native_half)
    return ReducePlan(torch.float32 if upcast else dtype, ReduceOp.SUM if average else op,
                      average)


# -- the operation specs ---------------------------------------------------------------

class Kind(enum.Enum):
    """What a parameter is; tells validation, debug mode and the extensions how to read it."""

    TENSOR = "tensor"            # one tensor
    BLOCKS = "blocks"            # a tensor of `size` blocks along dim 0, or a list of `size`
    OPT_BLOCKS = "opt_blocks"    # BLOCKS, or None off the root
    OPT_TENSOR = "opt_tensor"    # a tensor, or None off the root (gatherv/scatterv)
    TENSOR_LIST = "tensor_list"  # a list of `size` tensors
    ROOT = "root"                # a group rank
    REDUCE_OP = "reduce_op"      # a ReduceOp
    COUNTS = "counts"            # element counts, one per group rank
    DISPLS = "displs"            # element displacements, None = packed (validation fills)
    SPLITS = "splits"            # dim-0 rows per group rank, None = equal (validation fills)
    TAG = "tag"                  # a message tag


REQUIRED = object()


@dataclass(frozen=True)
class Param:
    name: str
    kind: Kind
    default: object = REQUIRED


class Agreement(enum.Enum):
    """What debug mode checks across the ranks of a collective, beyond operation, dtype,
    root and reduce op."""

    UNIFORM = "uniform"    # every rank's element count is the same
    EXCHANGE = "exchange"  # what rank i sends to j is what j expects from i
    VECTOR = "vector"      # every rank passes the same counts; counts[i] is rank i's count
    NONE = "none"


@dataclass(frozen=True)
class OpSpec:
    """One operation: its parameters (without ``group`` and ``async_op``) and its facts.

    ``payload``: the parameter whose dtype (and, for UNIFORM agreement, element count) a
    rank's view of the call shows in debug mode. ``nbytes``: how to count the bytes of a
    call in the tuning-table convention (the largest buffer one rank touches).
    ``bus_factor``: busbw = algbw x factor(n), as nccl-tests; it is also the bandwidth
    term of the alpha-beta model (mcrdl.tuning.model), whose latency term is
    ``latency_steps(n)``, the message rounds of the usual algorithm. ``fusable`` /
    ``compressible``: tensor fusion / zfp compression may apply.
    """

    name: str
    params: tuple[Param, ...]
    doc: str
    payload: str | None
    nbytes: Bytes | None
    bus_factor: Callable[[int], float]
    latency_steps: Callable[[int], float]
    p2p: bool = False
    agreement: Agreement = Agreement.UNIFORM
    fusable: bool = False
    compressible: bool = False
    index: dict[str, int] = field(init=False, repr=False, compare=False)
    #: nbytes from the Backend method's positional arguments and the group size
    nbytes_of: Callable[[tuple, int], int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        index = {p.name: i for i, p in enumerate(self.params)}
        object.__setattr__(self, "index", index)
        object.__setattr__(self, "nbytes_of", _compile_bytes(self.nbytes, index, self.params))

    def param(self, kind: Kind) -> str | None:
        """Name of the (first) parameter of `kind`, or None."""
        return next((p.name for p in self.params if p.kind is kind), None)

    @property
    def root(self) -> str | None:
        return self.param(Kind.ROOT)

    @property
    def reduce_op(self) -> str | None:
        return self.param(Kind.REDUCE_OP)

    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    def signature(self) -> str:
        """The positional arguments of the Backend method (for docs and errors)."""
        return ", ".join((*self.names(), "group", "async_op"))

    def call(self, args: tuple) -> Call:
        """A :class:`Call` of the Backend method's positional arguments ``args``
        (the parameters, then group and async_op)."""
        return Call(self, args[:-2], args[-2], args[-1])



@dataclass(frozen=True)
class Bytes:
    """The bytes of a call: ``of``'s bytes (times the group size when ``per_rank``; the
    sum over a tensor list), or with ``counts`` the sum of those element counts in
    ``of``'s dtype."""

    of: str
    per_rank: bool = False
    counts: str | None = None


def _compile_bytes(rule: Bytes | None, index: dict, params: tuple) -> Callable:
    # Positions resolved from the names once: "auto" and the logger count every call.
    if rule is None:
        return lambda a, g: 0
    i = index[rule.of]
    if rule.counts is not None:
        j = index[rule.counts]
        return lambda a, g: sum(a[j]) * a[i].element_size()
    if params[i].kind is Kind.TENSOR_LIST:
        return lambda a, g: sum(t.nbytes for t in a[i])
    if rule.per_rank:
        return lambda a, g: a[i].nbytes * g
    return lambda a, g: a[i].nbytes


class Call:
    """One call of an operation as the layers of the call path see it: the spec, the
    arguments (in spec order, read by name: ``call["tensor"]``), the group (None for
    the world) and async_op. :meth:`forward` passes it to the next layer's method."""

    __slots__ = ("spec", "args", "group", "async_op")

    def __init__(self, spec: OpSpec, args: tuple, group, async_op: bool):
        self.spec, self.args, self.group, self.async_op = spec, tuple(args), group, async_op

    @property
    def op(self) -> str:
        return self.spec.name

    def __getitem__(self, name: str):
        return self.args[self.spec.index[name]]

    def replace(self, **values) -> Call:
        """A copy with the named arguments (or group / async_op) replaced."""
        args = list(self.args)
        group, async_op = values.pop("group", self.group), values.pop("async_op", self.async_op)
        for name, value in values.items():
            args[self.spec.index[name]] = value
        return Call(self.spec, tuple(args), group, async_op)

    def forward(self, method: Callable):
        """``method(*args, group, async_op)``: hand the call to a backend-style method."""
        return method(*self.args, self.group, self.async_op)

    def nbytes(self, gsize: int) -> int:
        return self.spec.nbytes_of(self.args, gsize)

    def __repr__(self) -> str:
        return f"Call({self.spec.name}, group={self.group!r}, async_op={self.async_op})"


def _p(name: str, kind: Kind, default: object = REQUIRED) -> Param:
    return Param(name, kind, default)


def _ring(n: int) -> float:
    return (n - 1) / n


def _tree(n: int) -> float:
    """Rounds of a binomial tree over n ranks: ceil(log2 n)."""
    return (n - 1).bit_length()


def _ring_steps(n: int) -> float:
    return n - 1


def _one(n: int) -> float:
    return 1.0


_T, _R, _O = Kind.TENSOR, Kind.ROOT, Kind.REDUCE_OP
SUM = ReduceOp.SUM

_SPECS = (
    OpSpec("all_reduce", (_p("tensor", _T), _p("op", _O, SUM)),
           "Reduce `tensor` across the group, in place on every rank.",
           payload="tensor", nbytes=Bytes("tensor"),
           bus_factor=lambda n: 2.0 * (n - 1) / n, latency_steps=lambda n: 2 * _tree(n),
           fusable=True, compressible=True),
    OpSpec("reduce", (_p("tensor", _T), _p("dst", _R, 0), _p("op", _O, SUM)),
           "Reduce `tensor` to group rank `dst`; other ranks' tensors are unchanged.",
           payload="tensor", nbytes=Bytes("tensor"), bus_factor=_one, latency_steps=_tree),
    OpSpec("bcast", (_p("tensor", _T), _p("src", _R, 0)),
           "Broadcast `tensor` from group rank `src` to every rank.",
           payload="tensor", nbytes=Bytes("tensor"), bus_factor=_one, latency_steps=_tree,
           fusable=True, compressible=True),
    OpSpec("all_gather", (_p("output", Kind.BLOCKS), _p("input", _T)),
           "Gather every rank's `input` into `output` (one tensor of size blocks, or a list).",
           payload="input", nbytes=Bytes("input", per_rank=True), bus_factor=_ring,
           latency_steps=_ring_steps, fusable=True, compressible=True),
    OpSpec("gather", (_p("output", Kind.OPT_BLOCKS), _p("input", _T), _p("dst", _R, 0)),
           "Gather every rank's `input` into `output` on group rank `dst` (None elsewhere).",
           payload="input", nbytes=Bytes("input", per_rank=True), bus_factor=_ring,
           latency_steps=_tree, compressible=True),
    OpSpec("scatter", (_p("output", _T), _p("input", Kind.OPT_BLOCKS), _p("src", _R, 0)),
           "Scatter block i of `input` (on group rank `src`) into `output` of rank i.",
           payload="output", nbytes=Bytes("output", per_rank=True), bus_factor=_ring,
           latency_steps=_tree, compressible=True),
    OpSpec("reduce_scatter", (_p("output", _T), _p("input", Kind.BLOCKS), _p("op", _O, SUM)),
           "Reduce `input` (size blocks) across ranks; rank i gets block i in `output`.",
           payload="output", nbytes=Bytes("output", per_rank=True), bus_factor=_ring,
           latency_steps=_ring_steps, fusable=True),
    OpSpec("all_to_all_single",
           (_p("output", _T), _p("input", _T), _p("output_split_sizes", Kind.SPLITS, None),
            _p("input_split_sizes", Kind.SPLITS, None)),
           "Exchange rows (dim 0) of `input`: split i goes to rank i; equal splits when None.",
           payload="input", nbytes=Bytes("input"), bus_factor=_ring, latency_steps=_ring_steps,
           agreement=Agreement.EXCHANGE, compressible=True),
    OpSpec("all_to_all", (_p("output_list", Kind.TENSOR_LIST), _p("input_list", Kind.TENSOR_LIST)),
           "Send input_list[i] to rank i, receive output_list[i] from rank i.",
           payload="input_list", nbytes=Bytes("input_list"), bus_factor=_ring,
           latency_steps=_ring_steps, agreement=Agreement.EXCHANGE, compressible=True),
    OpSpec("gatherv",
           (_p("output", Kind.OPT_TENSOR), _p("input", _T), _p("counts", Kind.COUNTS),
            _p("displs", Kind.DISPLS, None), _p("dst", _R, 0)),
           "Gather `counts[i]` elements from rank i at element `displs[i]` of `output` on "
           "`dst`.",
           payload="input", nbytes=Bytes("input", counts="counts"), bus_factor=_ring,
           latency_steps=_tree, agreement=Agreement.VECTOR),
    OpSpec("scatterv",
           (_p("output", _T), _p("input", Kind.OPT_TENSOR), _p("counts", Kind.COUNTS),
            _p("displs", Kind.DISPLS, None), _p("src", _R, 0)),
           "Scatter `counts[i]` elements at element `displs[i]` of `input` (on `src`) to "
           "rank i.",
           payload="output", nbytes=Bytes("output", counts="counts"), bus_factor=_ring,
           latency_steps=_tree, agreement=Agreement.VECTOR),
    OpSpec("all_gatherv",
           (_p("output", _T), _p("input", _T), _p("counts", Kind.COUNTS),
            _p("displs", Kind.DISPLS, None)),
           "All-gather variable blocks: rank i's `input` lands at element `displs[i]`.",
           payload="input", nbytes=Bytes("input", counts="counts"), bus_factor=_ring,
           latency_steps=_ring_steps, agreement=Agreement.VECTOR),
    OpSpec("all_to_allv",
           (_p("output", _T), _p("input", _T), _p("send_counts", Kind.COUNTS),
            _p("recv_counts", Kind.COUNTS), _p("send_displs", Kind.DISPLS, None),
            _p("recv_displs", Kind.DISPLS, None)),
           "All-to-all with element counts/displacements per rank (flattened tensors).",
           payload="input", nbytes=Bytes("input"), bus_factor=_ring, latency_steps=_ring_steps,
           agreement=Agreement.EXCHANGE),
    OpSpec("send", (_p("tensor", _T), _p("dst", _R), _p("tag", Kind.TAG, 0)),
           "Send `tensor` to group rank `dst` with `tag` (0..32767).",
           payload="tensor", nbytes=Bytes("tensor"), bus_factor=_one, latency_steps=_one,
           p2p=True, agreement=Agreement.NONE, compressible=True),
    OpSpec("recv", (_p("tensor", _T), _p("src", _R), _p("tag", Kind.TAG, 0)),
           "Receive into `tensor` from group rank `src` with `tag`.",
           payload="tensor", nbytes=Bytes("tensor"), bus_factor=_one, latency_steps=_one,
           p2p=True, agreement=Agreement.NONE, compressible=True),
    OpSpec("barrier", (),
           "Block until every rank of the group reached the barrier.",
           payload=None, nbytes=None, bus_factor=lambda n: 0.0, latency_steps=_tree),
)

#: name -> OpSpec of every operation, in API order.
OPS: dict[str, OpSpec] = {s.name: s for s in _SPECS}
#: Public aliases of operation names.
ALIASES = {"broadcast": "bcast"}

COLLECTIVES = tuple(n for n, s in OPS.items() if not s.p2p)
FUSABLE_OPS = frozenset(n for n, s in OPS.items() if s.fusable)
COMPRESSIBLE_OPS = frozenset(n for n, s in OPS.items() if s.compressible)
