"""python -m training.data prepare: local tokenizers in, token files of the width the
vocabulary needs out, read back by the trainers' readers (training/core/data.py)."""

import json

import numpy as np
import pytest

from training.core.data import Batches, TokenFile, load_dataset
from training.data import main, prepare

TEXTS = ["the cat sat on the mat. " * 6, "a dog ran in the park today. " * 5,
         "birds sing in the morning light. " * 4, "rain falls on the quiet town. " * 5,
         "the river runs to the sea. " * 6]


def _write(tmp_path, texts=TEXTS):
    paths = []
    for i, t in enumerate(texts):
        p = tmp_path / f"doc{i}.txt"
        p.write_text(t)
        paths.append(str(p))
    return paths


def _bpe(directory, vocab=300):
    """A byte-level BPE tokenizer trained here on TEXTS (nothing downloaded)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    directory.mkdir()
    tok.save(str(directory / "tokenizer.json"))
    return tok


def test_prepare_with_a_local_tokenizer(tmp_path):
    """uint16 ids that decode to the documents, a document index whose ranges hold
    each document, meta.json's counts, the tokenizer copied; the readers take it."""
    tok = _bpe(tmp_path / "tok")
    out = tmp_path / "data"
    meta = prepare(str(tmp_path / "tok"), _write(tmp_path), out, val_fraction=0.2,
                   eos_token="</s>")
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == tok.get_vocab_size()
    assert meta["splits"]["train"]["documents"] == 4 and meta["splits"]["val"]["documents"] == 1
    ds = TokenFile(str(out))
    assert ds.vocab_size == meta["vocab_size"] and (out / "tokenizer.json").is_file()
    eos = tok.token_to_id("</s>")
    texts = []
    for split in ("train", "val"):
        ids = np.asarray(ds.splits[split])
        assert len(ids) == meta["splits"][split]["tokens"]
        for start, end, bucket in ds.documents(split):
            assert ids[end - 1] == eos and bucket == 0
            texts.append(tok.decode(ids[start:end - 1].tolist()))
    assert sorted(texts) == sorted(TEXTS)
    x, y = Batches(load_dataset(str(out)), 8, 4, 2, seed=1).global_batch_at(0)
    assert int(x.max()) < meta["vocab_size"] and x.shape == (4, 8)


def test_a_vocabulary_beyond_uint16_writes_uint32(tmp_path):
    """70,000 words: ids above 65,535 survive (uint32), the readers and the option checks
    count tokens of 4 bytes; a directory without meta.json stays uint16."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {f"w{i}": i for i in range(70_000)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    words = [f"w{i}" for i in range(0, 70_000, 7)]
    text = tmp_path / "t.txt"
    text.write_text(" ".join(words))
    meta = prepare(str(tmp_path / "tok"), [str(text)], tmp_path / "d", val_fraction=0.1)
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 70_000
    ds = TokenFile(str(tmp_path / "d"))
    ids = np.concatenate([ds.splits["train"], ds.splits["val"]])
    assert ids.tolist() == list(range(0, 70_000, 7))  # one document, its tail in val
    from training.train_gpt import parse_args
    cfg = parse_args(["--data", str(tmp_path / "d"), "--block-size", "16"])
    assert cfg.data_vocab_size() == 70_000
    with pytest.raises(ValueError, match="--vocab-size 1000 is below the vocabulary"):
        parse_args(["--data", str(tmp_path / "d"), "--vocab-size", "1000"])
    # train.bin holds len(train) tokens of 4 bytes: a window of all but one fits
    n = len(ds.splits["train"])
    parse_args(["--data", str(tmp_path / "d"), "--block-size", str(n - 2)])
    with pytest.raises(ValueError, match=f"train.bin holds {n} tokens"):
        parse_args(["--data", str(tmp_path / "d"), "--block-size", str(n - 1)])


def test_repeated_documents_and_buckets(tmp_path):
    """--repeat 1,3: training documents alternate between the buckets x1 and x3, each
    copy whole in train.bin, the index pointing at one of them."""
    meta = prepare("bytes", _write(tmp_path), tmp_path / "d", val_fraction=0.2,
                   repeat=[1, 3])
    assert meta["buckets"] == ["x1", "x3"] and meta["vocab_size"] == 256
    ds = TokenFile(str(tmp_path / "d"))
    train = bytes(np.asarray(ds.splits["train"], np.uint8))
    index = ds.documents("train")
    assert sorted(index[:, 2].tolist()) == [0, 0, 1, 1]
    for start, end, bucket in index:
        doc = train[start:end]
        assert train.count(doc) == (1, 3)[bucket] and doc.decode() in TEXTS


def test_command_line_and_refusals(tmp_path, capsys):
    paths = _write(tmp_path)
    assert main(["prepare", "--tokenizer", "bytes", "--input", *paths, "-o",
                 str(tmp_path / "o"), "--repeat", "2"]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["dtype"] == "uint16" and last["train_tokens"] == 2 * sum(
        len(TEXTS[i]) for i in range(5)) - 2 * last["val_tokens"]
    assert main(["prepare", "--tokenizer", str(tmp_path), "--input", *paths, "-o",
                 str(tmp_path / "o2")]) == 2
    assert "tokenizer.json not found" in capsys.readouterr().err
    assert main(["prepare", "--tokenizer", "bytes", "--input", str(tmp_path / "none.txt"),
                 "-o", str(tmp_path / "o3")]) == 2
    assert "--input" in capsys.readouterr().err
