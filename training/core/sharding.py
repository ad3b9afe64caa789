"""Where a piece of a parameter lives: ``Split``, the sharding spec of a tensor over the
tensor-parallel axes (x, y, z), which cuts a rank's piece out of the serial tensor and
puts the pieces back; the 4D engine's and TED's layers tag their parameters with it, and
their checkpoints store it so that consolidation can reassemble the serial model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Split:
    """How a serial parameter of shape `shape` ([rows] or [rows, cols]) is distributed:
    rows split into contiguous blocks over axis `rows` (None: whole), columns over
    `cols`, then, with `z`, the block flattened and cut into G_z contiguous chunks.
    `perm`: a row permutation applied to the serial tensor before splitting."""

    shape: tuple[int, ...]
    rows: str | None = None
    cols: str | None = None
    z: bool = False
    perm: tuple[int, ...] | None = None

    @property
    def split_axes(self) -> set[str]:
        return {a for a in (self.rows, self.cols) if a} | ({"z"} if self.z else set())

    def check(self, sizes: dict[str, int], name: str = "parameter") -> None:
        """ValueError naming `name` unless the degrees `sizes` divide this split evenly
        (a remainder would be dropped from every piece, and assembled as garbage)."""
        block = 1
        for what, dim, axis in zip(("rows", "columns"), self.shape, (self.rows, self.cols),
                                   strict=False):  # a 1-D split has rows only
            g = sizes[axis] if axis else 1
            if dim % g:
                raise ValueError(f"{name}: its {dim} {what} (shape {tuple(self.shape)}) are "
                                 f"not divisible by G_{axis}={g}")
            block *= dim // g
        if self.z and block % sizes["z"]:
            raise ValueError(f"{name}: its block of {block} elements (shape "
                             f"{tuple(self.shape)} split over X and Y) is not divisible by "
                             f"G_z={sizes['z']}")

    def block_shape(self, sizes: dict[str, int]) -> tuple[int, ...]:
        r = self.shape[0] // (sizes[self.rows] if self.rows else 1)
        if len(self.shape) == 1:
            return (r,)
        return (r, self.shape[1] // (sizes[self.cols] if self.cols else 1))

    def local(self, full: torch.Tensor, coords: dict[str, int], sizes: dict[str, int],
              name: str = "parameter") -> torch.Tensor:
        """This rank's piece of the serial tensor `full` (a new contiguous tensor);
        ValueError naming `name` where the grid does not divide it (check)."""
        self.check(sizes, name)
        t = full if self.perm is None else full[list(self.perm)]
        bs = self.block_shape(sizes)
        if self.rows:
            i = coords[self.rows]
            t = t[i * bs[0]:(i + 1) * bs[0]]
        if self.cols:
            j = coords[self.cols]
            t = t[:, j * bs[1]:(j + 1) * bs[1]]
        if self.z:
            flat = t.reshape(-1)
            n = flat.numel() // sizes["z"]
            t = flat[coords["z"] * n:(coords["z"] + 1) * n]
        return t.detach().clone().contiguous()

    def assemble(self, pieces: dict[tuple[int, int, int], torch.Tensor],
                 sizes: dict[str, int]) -> torch.Tensor:
        """The serial tensor from `pieces` keyed by (x, y, z) coordinates (ranks that
        hold the same piece may be missing but one of them must be there)."""
        self.check(sizes)
        bs = self.block_shape(sizes)
        ref = next(iter(pieces.values()))
        full = torch.empty(self.shape, dtype=ref.dtype)

        def piece(x, y, z):
            want = {"x": x, "y": y, "z": z}
            for (px, py, pz), t in pieces.items():
                have = {"x": px, "y": py, "z": pz}
                if all(have[a] == want[a] for a in self.split_axes if a != "data"):
                    return t
            raise KeyError(f"no piece at {want}")

        for x in range(sizes["x"] if "x" in self.split_axes else 1):
            for y in range(sizes["y"] if "y" in self.split_axes else 1):
                if self.z:
                    block = torch.cat([piece(x, y, z).reshape(-1) for z in range(sizes["z"])])
                else:
                    block = piece(x, y, 0)
                block = block.reshape(bs)
                c = {"x": x, "y": y}
                r0 = c[self.rows] * bs[0] if self.rows else 0
                if len(self.shape) == 1:
                    full[r0:r0 + bs[0]] = block
                else:
                    c0 = c[self.cols] * bs[1] if self.cols else 0
                    full[r0:r0 + bs[0], c0:c0 + bs[1]] = block
        if self.perm is not None:
            out = torch.empty_like(full)
            out[list(self.perm)] = full
            full = out
        return full


def split_of(p: torch.Tensor) -> Split | None:
    """`p`'s Split, None when it has none (``Tensor.split`` is a method: test the type)."""
    split = getattr(p, "split", None)
    return split if isinstance(split, Split) else None


