"""Tiny random embedding checkpoints (BERT with a WordPiece tokenizer, headless decoders),
sequence classifiers (BERT cross-encoders, decoders with a ``score`` head) and their
reference vectors from transformers (and sentence-transformers when installed).

The sentence-transformers files (``modules.json``, ``1_Pooling/config.json``,
``2_Normalize``) are written by hand, as sentence-transformers saves them, so the tests
run without it; where it is installed the same directory is also loaded with it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "a",
    "cat",
    "sat",
    "on",
    "mat",
    "hello",
    "world",
    "paged",
    "attention",
    "embeddings",
    "are",
    "vectors",
    "of",
    "floats",
    "batch",
    "mixed",
    "lengths",
    "one",
    "two",
    "three",
    "four",
    "five",
]
BERT_SIZES = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=48,
    max_position_embeddings=64,
)
DECODER_SIZES = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    head_dim=8,
)
TEXTS = [
    "hello",
    "the quick brown fox jumps over the lazy dog",
    "a cat sat on the mat",
    "embeddings are vectors of floats one two three four five one two three four five",
]
"""Mixed lengths (3 to 20 WordPiece tokens with [CLS] and [SEP])."""
_ST_MODULES = "sentence_transformers.models."


def _randomize(model: torch.nn.Module) -> torch.nn.Module:
    """Weights large enough to move the vectors; norms away from identity."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name.lower():
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.08)
    return model.eval()


def _write_wordpiece_tokenizer(path: Path, extra: tuple[str, ...] = ()) -> None:
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, *extra]
    vocab += [c for c in "abcdefghijklmnopqrstuvwxyz" if c not in vocab]
    vocab_file = path / "vocab.txt"
    vocab_file.write_text("\n".join(dict.fromkeys(vocab)) + "\n")
    # transformers 5 reads the vocabulary from ``vocab`` (a ``vocab_file`` is ignored,
    # leaving a tokenizer that reads every word as [UNK])
    transformers.BertTokenizerFast(vocab=str(vocab_file)).save_pretrained(path)


def write_sentence_transformers_files(path: Path, pooling: str, normalize: bool) -> None:
    """sentence-transformers' module files for a Transformer + Pooling (+ Normalize)."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": _ST_MODULES + "Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": _ST_MODULES + "Pooling"},
    ]
    if normalize:
        modules.append(
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": _ST_MODULES + "Normalize"}
        )
        (path / "2_Normalize").mkdir(exist_ok=True)
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    dim = json.loads((path / "config.json").read_text())["hidden_size"]
    modes = {"cls": "cls_token", "mean": "mean_tokens", "lasttoken": "lasttoken"}
    config = {"word_embedding_dimension": dim, "include_prompt": True}
    for mode, key in modes.items():
        config[f"pooling_mode_{key}"] = mode == pooling
    (path / "1_Pooling" / "config.json").write_text(json.dumps(config))
    (path / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": 64, "do_lower_case": False})
    )


def write_bert(path: Path, pooling: str | None, normalize: bool = True) -> torch.nn.Module:
    """A random ``BertModel`` with a WordPiece tokenizer; with ``pooling`` ("cls",
    "mean") also sentence-transformers' files. Returns the transformers model."""
    path.mkdir(parents=True, exist_ok=True)
    _write_wordpiece_tokenizer(path)
    vocab_size = len((path / "vocab.txt").read_text().split())
    config = transformers.BertConfig(vocab_size=vocab_size, **BERT_SIZES)
    model = _randomize(transformers.BertModel(config, add_pooling_layer=True))
    model.save_pretrained(path)
    if pooling is not None:
        write_sentence_transformers_files(path, pooling, normalize)
    return model


def write_decoder(
    path: Path, config_class: str, model_class: str, **config_extra: object
) -> torch.nn.Module:
    """A random decoder (``Qwen3Model``, ``LlamaForCausalLM``, ...) saved in ``path``;
    ``config_extra``: more config fields (``num_labels`` for a classifier)."""
    config = getattr(transformers, config_class)(**DECODER_SIZES, **config_extra)
    model = _randomize(getattr(transformers, model_class)(config))
    model.save_pretrained(path)
    return model


def write_bert_classifier(path: Path, num_labels: int, **config_extra: object) -> torch.nn.Module:
    """A random ``BertForSequenceClassification`` (a cross-encoder with one label) with
    the WordPiece tokenizer, which joins pairs with token types 0 and 1."""
    path.mkdir(parents=True, exist_ok=True)
    _write_wordpiece_tokenizer(path)
    vocab_size = len((path / "vocab.txt").read_text().split())
    config = transformers.BertConfig(
        vocab_size=vocab_size, num_labels=num_labels, **BERT_SIZES, **config_extra
    )
    model = _randomize(transformers.BertForSequenceClassification(config))
    model.save_pretrained(path)
    return model


def write_wordpiece_tokenizer(path: Path, extra: tuple[str, ...] = ()) -> None:
    """The BERT tests' WordPiece tokenizer in ``path`` (its ids fit ``DECODER_SIZES``),
    with ``extra`` words as tokens of their own."""
    _write_wordpiece_tokenizer(path, extra)


def hf_hidden(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """[len, hidden] float32 last hidden states (after a decoder's final norm)."""
    with torch.no_grad():
        ids = torch.tensor([token_ids])
        if hasattr(model, "model") and not isinstance(
            model, (transformers.BertModel, transformers.XLMRobertaModel)
        ):
            model = model.model  # a *ForCausalLM: the stack under the head
        kwargs = {"attention_mask": torch.ones_like(ids)}
        return model(ids, **kwargs).last_hidden_state[0].float()


def reference_vector(hidden: torch.Tensor, pooling: str, normalize: bool) -> torch.Tensor:
    pooled = {"cls": hidden[0], "mean": hidden.mean(0), "lasttoken": hidden[-1]}[pooling]
    return F.normalize(pooled, dim=-1) if normalize else pooled


ROBERTA_SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]


def write_roberta(path: Path, num_labels: int | None = None) -> torch.nn.Module:
    """A random ``XLMRobertaModel`` (or, with ``num_labels``, an
    ``XLMRobertaForSequenceClassification``) with a byte-level BPE tokenizer that joins
    pairs as ``<s> a </s></s> b </s>``; the position table has ``pad_token_id + 1`` rows
    more than the tokens it takes, as RoBERTa's."""
    from tokenizers import ByteLevelBPETokenizer, processors

    path.mkdir(parents=True, exist_ok=True)
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        TEXTS * 3 + WORDS, vocab_size=300, min_frequency=1, special_tokens=ROBERTA_SPECIALS
    )
    backend = bpe._tokenizer
    backend.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        pad_token="<pad>",
        eos_token="</s>",
        sep_token="</s>",
        cls_token="<s>",
        unk_token="<unk>",
        mask_token="<mask>",
    ).save_pretrained(path)
    sizes = {**BERT_SIZES, "max_position_embeddings": BERT_SIZES["max_position_embeddings"] + 2}
    config = transformers.XLMRobertaConfig(
        vocab_size=300, pad_token_id=1, type_vocab_size=1, num_labels=num_labels or 2, **sizes
    )
    if num_labels is None:
        model = transformers.XLMRobertaModel(config, add_pooling_layer=True)
    else:
        model = transformers.XLMRobertaForSequenceClassification(config)
    model = _randomize(model)
    model.save_pretrained(path)
    return model
