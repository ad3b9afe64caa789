"""Checkpoints cannot run code: every file a resume, a consolidation or ``--init-from``
reads is loaded with ``torch.load(weights_only=True)`` (training/core/checkpoint.py
``load_file``), a file crafted to run a command when unpickled is refused by name with
the global it would call, and a checkpoint of the previous format loads only with
``--trust-checkpoint``."""

import dataclasses
import hashlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ._launch import mpiexec_or_skip, pythonpath, run_launcher
from .training.crafted_checkpoint import crafted_bytes, replace_shard

HERE = os.path.join(os.path.dirname(__file__), "training")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GLOBAL = f"{os.system.__module__}.system"  # the name a crafted pickle stores


def _checkpoint(root: Path, shards: list[dict]) -> Path:
    """A published checkpoint of step 1 under `root` with these shards (pipeline layout)."""
    from training.core import checkpoint as ckpt
    final = ckpt.step_dir(root, 1)
    staging = ckpt.staging_dir(final, "t")
    staging.mkdir(parents=True)
    entries = [ckpt.save_shard(staging, i, s) for i, s in enumerate(shards)]
    manifest = {"format": ckpt.FORMAT, "engine": "pipeline", "step": 1,
                "grid": {"G_inter": len(shards)}, "model": {"n_layer": 0}, "shards": entries}
    ckpt.write_manifest(staging, manifest, publish_as=final)
    return final


def test_the_crafted_file_runs_code_under_the_old_loader(tmp_path):
    """The control: the crafted file does create its marker when fully unpickled (what
    the loaders did before), so the marker's absence below means the loader refused it."""
    for kind in ("torch", "pickle"):
        marker = tmp_path / f"ran-{kind}"
        try:
            torch.load(io.BytesIO(crafted_bytes(marker, kind)), weights_only=False)
        except RuntimeError as e:  # a bare pickle: after it ran, "Invalid magic number"
            assert kind == "pickle" and "magic number" in str(e), e
        assert marker.exists(), kind


@pytest.mark.parametrize("kind", ["torch", "pickle"])
def test_crafted_shard_is_refused_by_resume_and_consolidate(tmp_path, capsys, kind):
    """A shard replaced by a crafted file, the manifest updated to its size and sha256:
    load_shard (every engine's resume) and ``checkpoint consolidate`` refuse it naming
    the file and posix.system, and nothing runs; an honest shard loads."""
    from training import checkpoint as checkpoint_tool
    from training.core import checkpoint as ckpt
    marker = tmp_path / "MARKER"
    honest = {"model": {"units.0.w": torch.arange(4.0)}, "step": 1,
              "optimizer": {"kind": "adamw", "torch": {"state": {0: {"step": torch.tensor(1.0)}},
                                                       "param_groups": [{"betas": (0.9, 0.95)}]}}}
    step = _checkpoint(tmp_path / "ck", [honest, honest])
    manifest = ckpt.read_manifest(step)
    assert torch.equal(ckpt.load_shard(step, manifest, 1)["model"]["units.0.w"],
                       torch.arange(4.0))
    shard = replace_shard(step, 1, crafted_bytes(marker, kind))
    manifest = ckpt.read_manifest(step)
    assert ckpt.shard_problems(step, manifest, verify=True) == []  # the hash proves nothing
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.load_shard(step, manifest, 1)
    assert f"shard {shard} is refused" in str(e.value), e.value
    assert re.search(f"Unsupported global: .*{GLOBAL}", str(e.value)), e.value
    assert checkpoint_tool.main(["consolidate", str(step), "-o", str(tmp_path / "g.pt")]) == 2
    err = capsys.readouterr().err
    assert str(shard) in err and GLOBAL in err, err
    # --trust-checkpoint widens only to the previous format: this one still refused
    assert checkpoint_tool.main(["consolidate", str(step), "-o", str(tmp_path / "g.pt"),
                                 "--trust-checkpoint"]) == 2
    assert GLOBAL in capsys.readouterr().err
    assert not marker.exists() and not (tmp_path / "g.pt").exists()


def test_crafted_init_from_file_is_refused(tmp_path):
    """--init-from (a consolidated state_dict): a crafted file is refused naming the
    option, the file and the global; nothing runs."""
    from training.core import checkpoint as ckpt
    marker, path = tmp_path / "MARKER", tmp_path / "gpt.pt"
    path.write_bytes(crafted_bytes(marker))
    with pytest.raises(ckpt.CheckpointError, match=f"--init-from {path} is refused: .*"
                                                   f"Unsupported global: {GLOBAL}"):
        ckpt.read_serial_state_dict(path, torch.nn.Linear(4, 4))
    assert not marker.exists()


def test_a_shard_holds_only_what_the_safe_loader_reads(tmp_path):
    """A save refuses what a checkpoint file cannot hold (a dataclass, a numpy value),
    naming the entry, before writing anything; so does the consolidated (torch.save)
    file's."""
    from training.core import checkpoint as ckpt

    @dataclasses.dataclass
    class Position:
        step: int

    for bad, where in (({"data": Position(3)}, "/data"),
                       ({"optimizer": {"rng": [np.int64(3)]}}, "/optimizer/rng/0")):
        with pytest.raises(ckpt.CheckpointError, match=f"checkpoint entry {where} is a "):
            ckpt.atomic_save(bad, tmp_path / "s.pt")
        with pytest.raises(ckpt.CheckpointError, match=f"checkpoint entry {where} is a "):
            ckpt.atomic_torch_save(bad, tmp_path / "s.pt")
    assert not list(tmp_path.iterdir())



def test_shard_files_round_trip_and_malformed_ones_are_refused(tmp_path):
    """A shard file (safetensors layout, the structure as JSON) gives back what was
    saved, types included (tuples, int keys, dtypes, bf16, int32, 0-d and empty
    tensors); a malformed one is refused by name; a plain safetensors file reads as
    its state_dict."""
    from training.core import checkpoint as ckpt
    state = {"model": {"w": torch.arange(6.0).view(2, 3).t(), "h": torch.ones(3).bfloat16()},
             "optimizer": {"state": {0: {"step": torch.tensor(3.0)}}, "betas": (0.9, 0.95)},
             "index": torch.tensor([1, 4], dtype=torch.int32), "empty": torch.zeros(0, 2),
             "units": (0, 3), "rounds": [[1, 0.5]], "scale": float("inf"), "none": None,
             "dtype": torch.bfloat16, "shape": torch.Size([2, 3]), "@odd": True}
    ckpt.atomic_save(state, tmp_path / "s.pt")
    got = ckpt.load_file(tmp_path / "s.pt", tmp_path / "s.pt")
    assert list(got) == list(state)
    for k in ("units", "rounds", "scale", "none", "dtype", "shape", "@odd"):
        assert got[k] == state[k] and type(got[k]) is type(state[k]), k
    assert got["optimizer"]["betas"] == (0.9, 0.95)
    assert torch.equal(got["optimizer"]["state"][0]["step"], torch.tensor(3.0))
    for k in ("w", "h"):
        t = got["model"][k]
        assert t.dtype == state["model"][k].dtype and torch.equal(t, state["model"][k]), k
    assert got["index"].dtype == torch.int32 and got["empty"].shape == (0, 2)
    data = bytearray((tmp_path / "s.pt").read_bytes())
    n = int.from_bytes(data[:8], "little")
    header = json.loads(bytes(data[8:8 + n]))
    for damage in ({"mcrdl": json.dumps({"@call": ["os.system", "touch x"]})},
                   {"mcrdl": json.dumps({"@tensor": 99})}):
        bad = json.dumps(dict(header, __metadata__=damage)).encode()
        with pytest.raises(ckpt.CheckpointError, match="s.pt is not a well-formed checkpoint"):
            ckpt.load_file(len(bad).to_bytes(8, "little") + bad + data[8 + n:], "s.pt")
    first = next(k for k in header if k != "__metadata__")
    bad = json.dumps(dict(header, **{first: dict(header[first], data_offsets=[0, 10**9])}))
    with pytest.raises(ckpt.CheckpointError, match="does not fit bytes"):
        ckpt.load_file(len(bad).to_bytes(8, "little") + bad.encode() + data[8 + n:], "s.pt")
    with pytest.raises(ckpt.CheckpointError, match="junk.pt is refused: it is not a file "
                                                   "of tensors and plain data"):
        ckpt.load_file(b"\x80\x02 not a pickle", "junk.pt")
    # safetensors' own files: a state_dict of its tensors
    plain = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    got = ckpt.load_file(len(plain).to_bytes(8, "little") + plain
                         + torch.tensor([1.0, 2.0]).numpy().tobytes(), "w.safetensors")
    assert torch.equal(got["w"], torch.tensor([1.0, 2.0]))


def test_previous_format_loads_only_with_trust(tmp_path, capsys):
    """A checkpoint of mcrdl-training-checkpoint/1 (its shard held any picklable object:
    a numpy value here) is refused naming --trust-checkpoint, by resume, consolidate and
    list, and loads with it, read as it was (full unpickler)."""
    from training import checkpoint as checkpoint_tool
    from training.core import checkpoint as ckpt
    old = ckpt.TRUSTED_ONLY[-1]
    shard = {"model": {"units.0.w": torch.arange(3.0)}, "seen": np.int64(7)}
    step = ckpt.step_dir(tmp_path / "ck", 1)
    step.mkdir(parents=True)
    buf = io.BytesIO()
    torch.save(shard, buf)  # the previous writer: torch.save of whatever the shard held
    data = buf.getvalue()
    (step / "stage_00.pt").write_bytes(data)
    entry = {"stage": 0, "file": "stage_00.pt", "bytes": len(data),
             "sha256": hashlib.sha256(data).hexdigest()}
    ckpt.write_manifest(step, {"format": old, "engine": "pipeline", "step": 1,
                               "grid": {"G_inter": 1}, "model": {"n_layer": -1},
                               "shards": [entry]})  # n_layer -1: the one unit 0
    with pytest.raises(ckpt.CheckpointError, match=f"format '{old}' .*--trust-checkpoint "
                                                   ".*arbitrary code execution"):
        ckpt.read_manifest(step)
    manifest = ckpt.read_manifest(step, trust=True)
    assert ckpt.load_shard(step, manifest, 0)["seen"] == 7
    assert checkpoint_tool.main(["list", str(tmp_path / "ck")]) == 1
    assert "UNUSABLE" in capsys.readouterr().out
    assert checkpoint_tool.main(["list", str(tmp_path / "ck"), "--trust-checkpoint"]) == 0
    out = tmp_path / "gpt.pt"
    assert checkpoint_tool.main(["consolidate", str(step), "-o", str(out)]) == 2
    assert "--trust-checkpoint" in capsys.readouterr().err and not out.exists()
    assert checkpoint_tool.main(["consolidate", str(step), "-o", str(out),
                                 "--trust-checkpoint"]) == 0
    # what consolidation writes is plain: read back by the safe loader
    assert torch.equal(ckpt.load_file(out, out)["units.0.w"], torch.arange(3.0))


@pytest.mark.parametrize("module", ["training.train_gpt", "training.train_moe",
                                    "training.checkpoint consolidate",
                                    "training.checkpoint list"])
def test_trust_option_says_what_it_allows(module):
    r = subprocess.run([sys.executable, "-m", *module.split(), "--help"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    text = " ".join(r.stdout.split())
    assert r.returncode == 0 and "--trust-checkpoint" in text, r.stderr
    assert "ARBITRARY CODE EXECUTION" in text, text


def test_crafted_shards_in_every_engines_checkpoints():
    """tests/training/crafted_resume.py under mpiexec -n 2: real checkpoints of the
    pipeline, 4D, SAMO and TED engines, one shard replaced by a crafted one: resume
    (also with --trust-checkpoint) and consolidate refused on every rank, nothing ran;
    --init-from a crafted file refused; the previous format resumes only with the flag."""
    env = dict(os.environ, MCRDL_TIMEOUT="90", PYTHONPATH=pythonpath(ROOT))
    out = run_launcher([mpiexec_or_skip(), "-n", "2", sys.executable,
                        os.path.join(HERE, "crafted_resume.py")], env=env, timeout=600)
    for what in ("pipeline", "4d", "samo", "ted", "init-from", "previous-format"):
        assert f"crafted {what} OK" in out, out
