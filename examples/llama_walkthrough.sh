#!/usr/bin/env bash
# The README's Llama continued-pretraining walkthrough, end to end, on a tiny model made
# here (nothing downloaded): a byte-level BPE tokenizer trained on Python's own sources,
# a random 4-layer LlamaForCausalLM (8 heads, 2 key/value heads) saved by transformers,
# then prepare -> import and train on a 2x2 pipeline grid -> evaluate on another layout
# -> export -> load in transformers -> memorization. Usage:
#     bash examples/llama_walkthrough.sh [WORK_DIR]       (4 ranks; about 2 minutes)
set -euo pipefail
W=${1:-runs/llama-walkthrough}
N=${NP:-4}
mkdir -p "$W"
PY=${PYTHON:-python}
STDLIB=$($PY -c "import os, sysconfig; print(sysconfig.get_paths()['stdlib'])")

# 0. a tokenizer and a Hugging Face Llama directory (stand-ins for a downloaded one)
$PY - "$W" "$STDLIB" <<'PY'
import glob, os, sys
import torch, transformers
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
w, stdlib = sys.argv[1], sys.argv[2]
files = sorted(glob.glob(os.path.join(stdlib, "*.py")))[:60]
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.train(files, trainers.BpeTrainer(vocab_size=1024, special_tokens=["<|eot|>"],
                                     initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
torch.manual_seed(0)
cfg = transformers.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=64,
                               intermediate_size=176, num_hidden_layers=4,
                               num_attention_heads=8, num_key_value_heads=2,
                               max_position_embeddings=128, rope_theta=10000.0,
                               bos_token_id=0, eos_token_id=0)
transformers.LlamaForCausalLM(cfg).save_pretrained(f"{w}/llama-dir")
tok.save(f"{w}/llama-dir/tokenizer.json")
with open(f"{w}/files.txt", "w") as f:
    f.write("\n".join(files))
PY

# 1. data
$PY -m training.data prepare --tokenizer "$W/llama-dir" --input $(cat "$W/files.txt") \
    -o "$W/data" --val-fraction 0.1
# 2-3. import and train on a 2x2 grid, val loss every 10 steps, Goldfish k=2 h=13
mpiexec -n "$N" $PY -m training.train_gpt --init-from "hf:$W/llama-dir" --data "$W/data" \
    --G-inter 2 --G-data 2 --block-size 64 --steps 30 --lr 3e-3 --eval-interval 10 \
    --eval-windows 16 --goldfish-k 2 --goldfish-h 13 --checkpoint-dir "$W/ckpt" \
    --out-dir "$W/out" --no-progress
STEP=$(ls -d "$W"/ckpt/step_* | sort | tail -1)
# 4. evaluate: the checkpoint on its layout, consolidated on 4D, the import serially
mpiexec -n "$N" $PY -m training.evaluate --init-from "$STEP" --data "$W/data" \
    --windows 32 --block-size 64 --G-inter 2 --G-data 2 | tail -1
$PY -m training.checkpoint consolidate "$STEP" -o "$W/m.pt"
mpiexec -n "$N" $PY -m training.evaluate --init-from "$W/m.pt" --data "$W/data" \
    --windows 32 --block-size 64 --G-x 2 --G-data 2 | tail -1
$PY -m training.evaluate --init-from "hf:$W/llama-dir" --data "$W/data" --windows 32 \
    --block-size 64 --serial | tail -1
# 5. export; transformers loads it and computes the same loss on the same windows
$PY -m training.checkpoint export-hf "$STEP" -o "$W/my-llama"
$PY - "$W" <<'PY'
import json, sys
import numpy as np, torch, transformers
w = sys.argv[1]
meta = json.load(open(f"{w}/data/meta.json"))
ids = np.fromfile(f"{w}/data/val.bin", dtype=meta["dtype"]).astype(np.int64)
T, W = 64, 32
x = torch.from_numpy(np.stack([ids[i * T:i * T + T + 1] for i in range(W)]))
model = transformers.AutoModelForCausalLM.from_pretrained(f"{w}/my-llama").eval()
with torch.no_grad():
    logits = model(input_ids=x[:, :T]).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)),
                                             x[:, 1:].reshape(-1))
print(json.dumps({"transformers_loss": loss.item(), "tokens": W * T}))
PY
# 6. memorization of the first training documents
$PY -m training.memorization --init-from "$W/m.pt" --data "$W/data" --docs 8 --suffix 50 \
    | tail -1
