"""Sharded, atomic, resumable checkpoints: their format, writing and reading.

Layout of ``<checkpoint-dir>``::

    step_000010/stage_00.pt ...   one shard per pipeline stage (model + optimizer state),
                                  written by the stage's data-parallel rank 0 (``encode``)
    step_000010/manifest.json     written last, by world rank 0: step, grid, partition,
                                  model config, and each shard's size and sha256
    latest                        name of the newest complete checkpoint

A save writes into a staging directory beside the step's (``.step_000010.saving-<id>``,
each file to a temporary name, flushed and renamed), the manifest last; only then does
the staging directory become ``step_000010`` and ``latest`` name it. A crash leaves the
checkpoints before it as they were: a checkpoint without a manifest was not completely
written and is never loaded, and a save of a step that already has one (a run resumed
from an earlier step) moves the old one aside and removes it only once the new one is
in place, so nothing already saved is lost. Loading verifies each shard's size and sha256 and all
ranks agree before any state changes: a truncated or corrupt shard raises
``CheckpointError`` on every rank, naming the file and the intact checkpoints to use.

``python -m training.checkpoint`` (training/checkpoint.py) lists checkpoints and
consolidates them into one serial ``state_dict``.

No file a resume, a consolidation or ``--init-from`` reads can run code (a manifest's
sha256 proves a shard intact, not who wrote it: whoever can write the shard can write
the manifest). A shard is written by ``encode``: the safetensors layout, its tensors'
bytes with a JSON header, and the structure around them (optimizer states, splits,
layouts, the pruning mask's bookkeeping, steps; the data position is the step) as JSON
in its metadata; ``load_file`` parses the JSON and reinterprets the bytes, nothing
more. A shard therefore holds only tensors, str, numbers, bool, None, dtypes and dicts,
lists and tuples of them (a save refuses anything else, by name). Other files
(``--init-from``'s state_dict, written by ``torch.save``) are read with
``torch.load(weights_only=True)``, which refuses any Python object a pickle names
beyond tensors and plain data. Checkpoints of the earlier ``FORMAT`` (``TRUSTED_ONLY``:
torch.save shards, read with pickle's full unpickler) load only with
``--trust-checkpoint`` (``TRUST_OPTION``), which lets their files run any code.

A pruned run's shard also holds its mask (``"pruning"``: each tensor's int32 index of
unpruned entries, ``training/samo/pruning.py``); SAMO's shards store the model compressed, as
its values at the index, and consolidation expands them: a dense ``state_dict`` with
zeros at the pruned positions.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import pickle
import pickletools
import re
import shutil
import zipfile
from pathlib import Path

import torch

FORMAT = "mcrdl-training-checkpoint/2"
#: Earlier formats, read only with TRUST_OPTION: their shards were read with pickle's
#: full unpickler (the format did not promise plain data), which runs what a file names.
TRUSTED_ONLY = ("mcrdl-training-checkpoint/1",)
TRUST_OPTION = "--trust-checkpoint"
#: The help text of TRUST_OPTION, the same in every command that takes it.
TRUST_HELP = ("load a checkpoint of an earlier format (mcrdl-training-checkpoint/1), whose "
              "shards are read with pickle's full unpickler: this allows ARBITRARY CODE "
              "EXECUTION by whoever could write its files; give it only for checkpoints "
              "you wrote yourself (or trust as such). Checkpoints of the current format "
              "never need it")
_STEP_DIR = re.compile(r"^step_(\d{6,})$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used (missing, incomplete, truncated, corrupt, mismatched).

    ``agreed``: raised on every rank of the run with this message (``raise_together``),
    so that one rank's report tells the whole story: the rank with ``reporter`` set (the
    run's rank 0)."""

    agreed = False
    reporter = True


def step_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step_{step:06d}"


def shard_name(stage: int, prefix: str = "stage") -> str:
    return f"{prefix}_{stage:02d}.pt"


def atomic_write(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a temporary file, flushed and renamed."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


#: Tensor dtypes of a shard file and their safetensors names.
DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
          torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32",
          torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
_BY_NAME = {v: k for k, v in DTYPES.items()}


def _not_plain(obj, where: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint entry {where or '/'} is a {type(obj).__module__}."
        f"{type(obj).__qualname__}: a checkpoint holds only tensors, str, numbers, bool, "
        "None, dtypes and dicts (str or int keys), lists and tuples of them; store it as "
        "such data")


def _tree(obj, tensors: list, where: str = ""):
    """`obj` as JSON data, each tensor replaced by ``{"@tensor": i}`` (its index in
    `tensors`, where it is appended); tuples, dtypes, sizes and dicts with int keys (or
    keys starting with "@") tagged likewise. CheckpointError at anything else."""
    if isinstance(obj, torch.Tensor):
        if type(obj) not in (torch.Tensor, torch.nn.Parameter) or obj.dtype not in DTYPES:
            raise _not_plain(obj, where)
        tensors.append(obj)
        return {"@tensor": len(tensors) - 1}
    if isinstance(obj, dict):
        if not all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in obj):
            bad = next(k for k in obj if not isinstance(k, (str, int)) or isinstance(k, bool))
            raise CheckpointError(f"checkpoint entry {where or '/'} has a key of type "
                                  f"{type(bad).__name__}: keys are str or int")
        if all(isinstance(k, str) and not k.startswith("@") for k in obj):
            return {k: _tree(v, tensors, f"{where}/{k}") for k, v in obj.items()}
        return {"@dict": [[k, _tree(v, tensors, f"{where}/{k}")] for k, v in obj.items()]}
    if type(obj) in (list, tuple):
        items = [_tree(v, tensors, f"{where}/{i}") for i, v in enumerate(obj)]
        return items if type(obj) is list else {"@tuple": items}
    if isinstance(obj, torch.Size):
        return {"@size": list(obj)}
    if isinstance(obj, torch.dtype):
        return {"@dtype": str(obj).removeprefix("torch.")}
    if type(obj) in (str, int, float, bool, type(None)):
        return obj
    raise _not_plain(obj, where)


def _untree(node, tensors: list):
    """The inverse of ``_tree``; ValueError (KeyError, IndexError) at a malformed node."""
    if isinstance(node, list):
        return [_untree(v, tensors) for v in node]
    if not isinstance(node, dict):
        return node
    if len(node) == 1 and next(iter(node)).startswith("@"):
        tag, value = next(iter(node.items()))
        if tag == "@tensor":
            return tensors[value]
        if tag == "@tuple":
            return tuple(_untree(v, tensors) for v in value)
        if tag == "@dict":
            return {k: _untree(v, tensors) for k, v in value}
        if tag == "@size":
            return torch.Size(value)
        if tag == "@dtype" and isinstance(getattr(torch, value, None), torch.dtype):
            return getattr(torch, value)
        raise ValueError(f"unknown entry {tag!r}: {value!r}")
    return {k: _untree(v, tensors) for k, v in node.items()}


def check_plain(obj) -> None:
    """CheckpointError naming the first entry of `obj` (a shard, a state_dict) that a
    checkpoint file cannot hold: anything but tensors, str, numbers, bool, None, dtypes,
    sizes and dicts (str or int keys), lists and tuples of them (a dataclass, an enum, a
    numpy value or RNG state): save it as such data instead."""
    _tree(obj, [])


def encode(obj) -> bytes:
    """`obj` (plain data: ``check_plain``) as a shard file: the safetensors layout (8
    bytes little-endian header size, JSON header naming each tensor's dtype, shape and
    bytes, the tensors' bytes) with the structure around the tensors as JSON in its
    metadata ("mcrdl"). Tensors go largest element first, so each stays aligned."""
    tensors: list[torch.Tensor] = []
    tree = _tree(obj, tensors)
    header: dict = {"__metadata__": {"mcrdl": json.dumps(tree)}}
    blobs, offset = [], 0
    for i in sorted(range(len(tensors)), key=lambda i: -tensors[i].element_size()):
        t = tensors[i].detach().to("cpu").contiguous()
        blob = t.reshape(-1).view(torch.uint8).numpy()
        header[str(i)] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape),
                          "data_offsets": [offset, offset + blob.nbytes]}
        blobs.append(blob)
        offset += blob.nbytes
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    return len(head).to_bytes(8, "little") + head + b"".join(blobs)


def _is_encoded(data) -> bool:
    """Whether `data` has the safetensors layout (torch.save files are zip archives or
    pickles, whose first bytes are no such header size)."""
    n = int.from_bytes(data[:8], "little") if len(data) >= 8 else -1
    return 2 <= n <= len(data) - 8 and data[8:9] == b"{"


def decode(data: bytearray, path, what: str = "checkpoint file"):
    """What ``encode`` wrote into `data`, its tensors views of `data` (a safetensors
    file without mcrdl's metadata: its tensors by name, a state_dict). Only JSON is
    parsed and bytes reinterpreted: nothing in the file runs. CheckpointError naming
    `what` `path` when the file is malformed."""
    try:
        n = int.from_bytes(data[:8], "little")
        header = json.loads(bytes(data[8:8 + n]))
        meta = header.pop("__metadata__", None) or {}
        base, tensors = 8 + n, {}
        for name, spec in header.items():
            dtype, shape = _BY_NAME[spec["dtype"]], [int(d) for d in spec["shape"]]
            begin, end = (int(x) for x in spec["data_offsets"])
            count = math.prod(shape)
            size = torch.empty((), dtype=dtype).element_size()
            if min(shape, default=0) < 0 or not 0 <= begin <= end <= len(data) - base \
                    or end - begin != count * size:
                raise ValueError(f"tensor {name!r}: shape {shape} of {spec['dtype']} does "
                                 f"not fit bytes {begin}..{end} of {len(data) - base}")
            tensors[name] = (torch.frombuffer(data, dtype=dtype, count=count,
                                              offset=base + begin).view(shape)
                             if count else torch.empty(shape, dtype=dtype))
        if "mcrdl" not in meta:
            return tensors
        return _untree(json.loads(meta["mcrdl"]), [tensors[str(i)] for i in range(len(tensors))])
    except (ValueError, KeyError, IndexError, TypeError, RuntimeError) as e:
        raise CheckpointError(f"{what} {path} is not a well-formed checkpoint file "
                              f"({type(e).__name__}: {e})") from None


def atomic_save(obj, path: Path) -> tuple[int, str]:
    """A shard file (``encode``) written to a temp file, fsync, rename; returns (bytes,
    sha256)."""
    data = encode(obj)
    atomic_write(path, data)
    return len(data), hashlib.sha256(data).hexdigest()


def atomic_torch_save(obj, path: Path) -> tuple[int, str]:
    """torch.save of plain data (``check_plain``: what torch.load(weights_only=True),
    torch's default, reads) through a temp file, fsync, rename: a consolidated
    state_dict, for ``torch.load`` as much as for ``--init-from``. Returns (bytes,
    sha256)."""
    check_plain(obj)
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    atomic_write(path, data)
    return len(data), hashlib.sha256(data).hexdigest()


def step_dirs(root: str | os.PathLike) -> list[Path]:
    """The step directories under `root` (complete or not), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = [p for p in root.iterdir() if _STEP_DIR.match(p.name)]
    return sorted(out, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def complete_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Step directories under `root` that have a manifest, oldest first."""
    return [p for p in step_dirs(root) if (p / "manifest.json").exists()]


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    root = Path(root)
    pointer = root / "latest"
    if pointer.exists():
        named = root / pointer.read_text().strip()
        if (named / "manifest.json").exists():
            return named
    done = complete_checkpoints(root)
    return done[-1] if done else None


def resume_path(spec: str, root: str | os.PathLike) -> Path:
    """The checkpoint ``--resume SPEC`` names: ``"latest"``, the newest complete one under
    ``root`` (CheckpointError when there is none), else the path SPEC itself."""
    if spec != "latest":
        return Path(spec)
    path = latest_checkpoint(root)
    if path is None:
        raise CheckpointError(f"--resume: no complete checkpoint in {root}")
    return path


def save_shard(directory: Path, stage: int, state: dict, prefix: str = "stage") -> dict:
    """Write one stage's shard (the 4D engine: one tensor rank's, prefix "tensor") into
    `directory`; returns its manifest entry (stage = the shard's index, file, bytes,
    sha256)."""
    name = shard_name(stage, prefix)
    nbytes, sha256 = atomic_save(state, directory / name)
    return {"stage": stage, "file": name, "bytes": nbytes, "sha256": sha256}


def build_manifest(*, step: int, grid: dict[str, int], partition: list[tuple[int, int]],
                   model: dict, optimizer: str, train_config: dict, shards: list[dict],
                   engine: str = "pipeline", layout_choice: dict | None = None) -> dict:
    """The manifest of a checkpoint: `grid` maps the degree options to their values
    (``{"G_inter": 2, "G_data": 2}``), `partition` gives each stage's unit range, and
    `shards` holds one ``save_shard`` entry per stage; `engine` "4d": one shard per
    tensor rank (x + G_x*(y + G_y*z)) of data replica 0. `layout_choice`: the record of
    ``--layout auto`` (training/plan/auto.py) when it chose the grid."""
    return {"format": FORMAT, "engine": engine, "step": step, "grid": dict(grid),
            "partition": [list(r) for r in partition], "model": model,
            "optimizer": optimizer, "train_config": train_config,
            "shards": sorted(shards, key=lambda s: s["stage"]),
            **({"layout_choice": layout_choice} if layout_choice else {})}


#: The command that writes and resumes each engine's checkpoints (manifest "engine").
ENGINE_COMMANDS = {"pipeline": "python -m training.train_gpt with G_x = G_y = G_z = 1",
                   "4d": "python -m training.train_gpt with --G-x/--G-y/--G-z",
                   "ted": "python -m training.train_moe"}


def check_engine(manifest: dict, directory: Path, engine: str) -> None:
    """CheckpointError unless `manifest` was written by `engine` ("pipeline", "4d" or
    "ted"), naming the command that resumes it: checked before anything else, whose
    names differ between the engines' manifests."""
    saved = manifest.get("engine", "pipeline")
    if saved != engine:
        command = ENGINE_COMMANDS.get(saved, f"the engine {saved!r}")
        other = ("; train_moe's model and train_gpt's differ" if "ted" in (saved, engine)
                 else ", or consolidate it (python -m training.checkpoint consolidate) and "
                 "start from its weights with --init-from")
        raise CheckpointError(
            f"checkpoint {directory} was written by the {saved} engine ({command}); this run "
            f"uses the {engine} engine ({ENGINE_COMMANDS[engine]}): resume it with "
            f"{command}{other}")


def check_matches(directory: Path, have: dict, want: dict, advice: str) -> None:
    """CheckpointError naming the first key whose value in `have` (the manifest's) is not
    the run's in `want`, then `advice` (what to resume with) and the way to change it."""
    for key, wanted in want.items():
        if wanted != have[key]:
            raise CheckpointError(
                f"checkpoint {directory} was written with {key}={have[key]}, this run has "
                f"{key}={wanted}; {advice}, or consolidate it (python -m training.checkpoint "
                "consolidate) and start from its weights with --init-from")


def model_fields(model: dict) -> dict:
    """A manifest's model config with its family (``"arch"``): manifests written before
    the field hold a GPT's (training/models/families.py ``describe``)."""
    return {"arch": "gpt", **model}


def check_resumable(manifest: dict, directory: Path, *, n_stages: int,
                    partition: list[tuple[int, int]], model: dict, optimizer: str) -> None:
    """CheckpointError unless `manifest` was written by a run with the same pipeline
    (stages, partition), model and optimizer as this one; the data-parallel degree may
    differ."""
    want = {"G_inter": n_stages, "partition": [list(r) for r in partition],
            "model": model_fields(model), "optimizer": optimizer}
    have = {"G_inter": manifest["grid"]["G_inter"], "partition": manifest["partition"],
            "model": model_fields(manifest["model"]), "optimizer": manifest["optimizer"]}
    check_matches(directory, have, want, "resume with the same model, --G-inter, "
                  "--layers-per-stage, --offload-optimizer and --samo (--G-data may change)")


def check_dtype(manifest: dict, directory: Path, dtype: str) -> None:
    """CheckpointError unless `manifest` was written by a run of ``--dtype`` `dtype`: the
    optimizer's state differs by dtype (fp32 masters beside 16-bit weights, fp16's loss
    scale), under the same optimizer class."""
    saved = (manifest.get("train_config") or {}).get("dtype")
    if saved != dtype:
        raise CheckpointError(
            f"checkpoint {directory} was written with --dtype {saved}, this run has --dtype "
            f"{dtype}; resume with --dtype {saved}, or consolidate it (python -m "
            "training.checkpoint consolidate) and start from its weights with --init-from")


def staging_dir(final: Path, token: str) -> Path:
    """Where a save of the step directory `final` writes its files (`token`: the save's,
    the same on every rank), published by write_manifest."""
    return final.with_name(f".{final.name}.saving-{token}")


def write_manifest(directory: Path, manifest: dict, publish_as: Path | None = None) -> None:
    """The manifest, a checkpoint's last file; then ``latest`` names the checkpoint. With
    `publish_as` (the step directory), `directory` is the save's staging directory, which
    becomes it: a checkpoint already there (the same step saved again, by a run resumed
    from an earlier step) is moved aside first and removed only after, so a crash at any
    point leaves a complete checkpoint of that step (between the two renames, under the
    hidden name ``.step_N.old-<id>``)."""
    atomic_write(directory / "manifest.json", json.dumps(manifest, indent=1).encode())
    final = directory
    if publish_as is not None:
        final, old = publish_as, None
        if final.exists():
            old = final.with_name(f".{final.name}.old-{directory.name.rsplit('-', 1)[-1]}")
            os.rename(final, old)
        os.rename(directory, final)
        _fsync_dir(final.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        for stale in final.parent.glob(f".{final.name}.saving-*"):  # saves that crashed
            shutil.rmtree(stale, ignore_errors=True)
    atomic_write(final.parent / "latest", (final.name + "\n").encode())


def _fsync_dir(path: Path) -> None:
    """Make the renames in directory `path` durable (where the OS allows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_manifest(directory: str | os.PathLike, *, trust: bool = False) -> dict:
    """The manifest of checkpoint `directory`; one of a TRUSTED_ONLY format only with
    `trust` (TRUST_OPTION given): its shards are then read with pickle's full unpickler."""
    directory = Path(directory)
    mpath = directory / "manifest.json"
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint {directory} does not exist{_alternatives(directory)}")
    if not mpath.exists():
        inside = latest_checkpoint(directory)
        if inside is not None:  # the checkpoint directory itself, not one of its steps
            raise CheckpointError(
                f"{directory} is a checkpoint directory, not one checkpoint: pass one of its "
                f"step directories (its latest: {inside}), or --resume latest with "
                f"--checkpoint-dir {directory}")
        raise CheckpointError(f"checkpoint {directory} has no manifest.json: it was not "
                              f"completely written{_alternatives(directory)}")
    try:
        return _parse_manifest(mpath, trust)
    except CheckpointError as e:
        raise CheckpointError(f"{e}{_alternatives(directory)}") from e


def _parse_manifest(mpath: Path, trust: bool = False) -> dict:
    """Manifest file `mpath` as a dict of this format (with `trust`, TRUST_OPTION given,
    or of a TRUSTED_ONLY one); CheckpointError (without hints: ``usable`` calls it on
    other checkpoints while building one) when it is not."""
    try:
        manifest = json.loads(mpath.read_text())
    except (OSError, ValueError) as e:  # JSON's and UTF-8's errors are ValueErrors
        raise CheckpointError(f"{mpath} is not valid JSON ({e})") from e
    got = manifest.get("format") if isinstance(manifest, dict) else manifest
    if got in TRUSTED_ONLY and not trust:
        raise CheckpointError(
            f"{mpath}: format {got!r} of an earlier version, whose shards are read with "
            f"pickle's full unpickler: loading them runs any code their files name. Pass "
            f"{TRUST_OPTION} only if you trust whoever could write {mpath.parent} (it "
            f"allows arbitrary code execution from its files), e.g. to consolidate it "
            f"(python -m training.checkpoint consolidate {TRUST_OPTION}) into a state_dict "
            f"this version reads safely with --init-from")
    if got != FORMAT and got not in TRUSTED_ONLY:
        raise CheckpointError(f"{mpath}: format {got!r}, expected {FORMAT!r}")
    return manifest


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def shard_problems(directory: Path, manifest: dict, *, verify: bool = False) -> list[str]:
    """What would keep checkpoint `directory` from loading, from its files' sizes (and,
    with `verify`, their sha256, which reads every byte): [] when nothing."""
    problems = []
    for entry in manifest.get("shards", []):
        path = directory / entry["file"]
        try:
            size = path.stat().st_size
        except OSError:
            problems.append(f"shard {entry['file']} is missing")
            continue
        if size != entry["bytes"]:
            problems.append(f"shard {entry['file']} is {size} bytes, the manifest says "
                            f"{entry['bytes']}")
        elif verify and _sha256(path) != entry["sha256"]:
            problems.append(f"shard {entry['file']} is corrupt (its sha256 differs)")
    return problems


def usable(directory: Path, trust: bool = False) -> bool:
    """Whether checkpoint `directory` has a readable manifest (of a TRUSTED_ONLY format:
    with `trust`) and shards of its sizes."""
    try:
        return not shard_problems(directory,
                                  _parse_manifest(directory / "manifest.json", trust))
    except (CheckpointError, OSError, KeyError, TypeError, AttributeError):
        return False


def _alternatives(directory: Path) -> str:
    others = [p for p in complete_checkpoints(directory.parent)
              if p.name != directory.name and usable(p)]
    if not others:
        return "; no other complete checkpoint exists in " + str(directory.parent)
    return ("; complete checkpoints: " + ", ".join(p.name for p in others[-3:])
            + f" (resume from one with --resume {others[-1]})")


def _unpickled_globals(data: bytes) -> list[str]:
    """The globals (``module.name``) the pickle in `data` (a torch.save zip, or a bare
    pickle) would import, found by reading its opcodes without running any; for a
    torch.save file, those beyond the ones ``weights_only`` allows."""
    if zipfile.is_zipfile(io.BytesIO(data)):
        try:
            return torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data))
        except Exception:  # noqa: BLE001 - a damaged archive: no names to give
            return []
    names, strings = [], []
    try:
        for op, arg, _ in pickletools.genops(data):
            if op.name == "GLOBAL":
                names.append(arg.replace(" ", "."))
            elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                names.append(f"{strings[-2]}.{strings[-1]}")
            elif isinstance(arg, str):
                strings.append(arg)
    except Exception:  # noqa: BLE001 - not a pickle to its end: the names read so far
        pass
    try:  # those weights_only allows (tensors' rebuild functions) are no news
        from torch._weights_only_unpickler import _get_allowed_globals
        allowed = set(_get_allowed_globals())
    except (ImportError, AttributeError):  # a torch without it: name them all
        allowed = set()
    return [n for n in dict.fromkeys(names) if n not in allowed]


def _read(path: str | os.PathLike) -> bytearray:
    """The bytes of file `path`, writable (``decode``'s tensors are views of them)."""
    with open(path, "rb") as f:
        data = bytearray(os.fstat(f.fileno()).st_size)
        f.readinto(data)
    return data


def load_file(source: bytes | bytearray | str | os.PathLike, path: str | os.PathLike,
              what: str = "checkpoint file") -> object:
    """The tensors and plain data in checkpoint file `source` (its bytes, or its path),
    on the CPU, without running anything in it: a shard file (``decode``: JSON and
    tensor bytes; a safetensors file), else a torch.save file read with
    ``torch.load(weights_only=True)``. A file that names any other Python object (a
    class, a function such as os.system) is refused with a CheckpointError naming
    `what` `path` and those names; FileNotFoundError and torch's errors of a file of
    another kind pass through."""
    data = source if isinstance(source, (bytes, bytearray)) else _read(source)
    if _is_encoded(data):
        return decode(data if isinstance(data, bytearray) else bytearray(data), path, what)
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        names = _unpickled_globals(bytes(data))
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        if names:
            raise CheckpointError(
                f"{what} {path} is refused: it names Python objects beyond tensors and plain "
                f"data (Unsupported global: {', '.join(names)}), which unpickling would "
                "import and run; nothing of it was run. This training package writes no "
                "such file: do not load it") from None
        if "Weights only load failed" in str(e):  # no global named: torch's own reason
            reason = next((line for line in lines if "nsupported" in line), lines[-1])
            raise CheckpointError(
                f"{what} {path} is refused: it is not a file of tensors and plain data "
                f"that torch.load(weights_only=True) reads ({reason}); nothing of it was "
                "run") from None
        raise CheckpointError(f"{what} {path} is not a checkpoint file (UnpicklingError: "
                              f"{' '.join(lines)})") from None


def load_shard(directory: str | os.PathLike, manifest: dict, stage: int) -> dict:
    """Read and verify (size, sha256) one stage's shard: with ``load_file`` (nothing in
    it runs) unless `manifest` is of a TRUSTED_ONLY format (read_manifest took it with
    TRUST_OPTION), whose shards are read with pickle's full unpickler as they were."""
    directory = Path(directory)
    entry = next((s for s in manifest["shards"] if s["stage"] == stage), None)
    if entry is None:
        raise CheckpointError(f"{directory}/manifest.json lists no shard for stage {stage}")
    path = directory / entry["file"]
    if not path.exists():
        raise CheckpointError(f"shard {path} is missing{_alternatives(directory)}")
    data = _read(path)
    if len(data) != entry["bytes"]:
        raise CheckpointError(f"shard {path} is truncated or overwritten: {len(data)} bytes, "
                              f"the manifest says {entry['bytes']}{_alternatives(directory)}")
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise CheckpointError(f"shard {path} is corrupt: its sha256 differs from the "
                              f"manifest's{_alternatives(directory)}")
    if manifest.get("format") in TRUSTED_ONLY:
        try:
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
        except Exception as e:  # noqa: BLE001 - whatever its unpickling raised
            raise CheckpointError(f"shard {path} (format {manifest['format']}, read with "
                                  f"{TRUST_OPTION}) cannot be read: {type(e).__name__}: "
                                  f"{e}") from None
    return load_file(data, path, "shard")


def read_serial_state_dict(path: str | os.PathLike, template: torch.nn.Module,
                           option: str = "--init-from") -> dict[str, torch.Tensor]:
    """The serial ``state_dict`` in file `path` (``consolidate``'s output, or
    ``torch.save(model.state_dict())``), checked against `template`, the serial model
    of this run's options (built on the meta device: names and shapes only).
    CheckpointError naming `option` and what differs: a name missing or extra (another
    model, or a file of another kind), or a shape (another size)."""
    try:
        state = load_file(path, path, option)
    except CheckpointError:
        raise
    except FileNotFoundError:
        raise CheckpointError(f"{option} {path}: no such file") from None
    except Exception as e:  # torch's errors of a file of another kind
        raise CheckpointError(f"{option} {path}: not a state_dict torch can load "
                              f"({type(e).__name__}: {e})") from None
    want = template.state_dict()
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor)
                                              for v in state.values()):
        held = (f"a dict of {', '.join(map(repr, list(state)[:4]))}"
                if isinstance(state, dict) else f"a {type(state).__name__}")
        raise CheckpointError(f"{option} {path} is not a state_dict (names to tensors) but "
                              f"{held} (a checkpoint's shard?); python -m training.checkpoint "
                              "consolidate writes a checkpoint's state_dict")
    problems = []
    missing = [k for k in want if k not in state]
    extra = [k for k in state if k not in want]
    for what, names in (("lacks", missing), ("has names this model lacks:", extra)):
        if names:
            problems.append(f"{what} {', '.join(map(str, names[:3]))}"
                            + (f" and {len(names) - 3} more" if len(names) > 3 else ""))
    shapes = [f"{k} is {tuple(state[k].shape)}, this model's {tuple(v.shape)}"
              for k, v in want.items() if k in state and state[k].shape != v.shape]
    if shapes:
        problems.append("; ".join(shapes[:3]) + (f" and {len(shapes) - 3} more"
                                                 if len(shapes) > 3 else ""))
    if problems:
        raise CheckpointError(f"{option} {path} does not fit this run's model: "
                              + "; ".join(problems) + " (give the model options it was "
                              "trained with: its .json beside it holds them)")
    return state


def load_serial_part(module: torch.nn.Module, state_dict: dict[str, torch.Tensor],
                     prefix: str = "") -> None:
    """Load `module` (a stage, a unit, one expert) from the serial model's `state_dict`
    entries under `prefix`, one per name of its own (read_serial_state_dict checked them)."""
    module.load_state_dict({k: state_dict[prefix + k] for k in module.state_dict()})


def shard_model(shard: dict) -> dict[str, torch.Tensor]:
    """A shard's model state as dense tensors: SAMO shards (``shard["pruning"]["compressed"]``)
    store each tensor's values at its index, expanded here with zeros elsewhere, and
    each parameter once (``shard["aliases"]``: the other names of a tied one)."""
    pruning = shard.get("pruning")
    if not pruning or not pruning["compressed"]:
        return shard["model"]
    dense = {}
    for name, values in shard["model"].items():
        t = torch.zeros(pruning["shapes"][name], dtype=values.dtype)
        t.view(-1)[pruning["index"][name].long()] = values
        dense[name] = t
    for alias, name in (shard.get("aliases") or {}).items():  # a tied head: the embedding
        dense.setdefault(alias, dense[name])
    return dense


def shard_weights(shard: dict, manifest: dict, directory, masters: bool) -> dict:
    """A shard's model state; with `masters`, each parameter's fp32 master weight from
    the optimizer state instead (OffloadedAdamW keeps one per parameter, flat; "order"
    gives each one's position among the model's parameters, the shard's model order:
    the models have no buffers)."""
    model = shard_model(shard)
    if not masters:
        return model
    optimizer = shard.get("optimizer") or {}
    kept = optimizer.get("master")
    if manifest.get("optimizer") != "OffloadedAdamW" or kept is None:
        raise CheckpointError(
            f"{directory}: --masters: its optimizer ({manifest.get('optimizer')}) keeps no "
            "fp32 master weights apart from the model (fp32 runs without "
            "--offload-optimizer: the model is fp32 already; SAMO and train_moe keep "
            "their own); consolidate without --masters")
    if "order" not in optimizer:
        raise CheckpointError(f"{directory}: --masters: written before the optimizer state "
                              "recorded its parameters' order; consolidate without --masters")
    items = list(model.items())
    if sorted(optimizer["order"]) != list(range(len(items))) or len(kept) != len(items):
        raise CheckpointError(f"{directory}: the optimizer's master weights do not match "
                              "the model's parameters")
    out = dict(model)
    for i, m in zip(optimizer["order"], kept, strict=True):
        name, t = items[i]
        if m.numel() != t.numel():
            raise CheckpointError(f"{directory}: the master weight of {name} has "
                                  f"{m.numel()} elements, the parameter {t.numel()}")
        out[name] = m.reshape(t.shape)
    return out
