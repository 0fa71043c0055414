"""Our SentencePiece BPE model as a Hugging Face `tokenizer.json` (built with `tokenizers`).

SentencePiece joins the adjacent pair whose joined piece scores highest: in `tokenizers` that is a
BPE model whose merges are ranked by the score of the piece each makes. The rest mirrors our
training settings (spaces as "▁", no dummy prefix, byte fallback, BOS first)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from scale_llm.data.pretrained_tokenizer import (
    TOKENIZER_FILES,
    PretrainedTokenizer,
    named_class_problem,
)
from scale_llm.data.tokenizer import Tokenizer
from scale_llm.errors import UserError
from scale_llm.files import read_folder_file

SPACE = "\u2581"  # SentencePiece's visible space


def vocab_and_merges(tok: Tokenizer) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """piece -> id for every piece, and the merges that rebuild each multi-character piece,
    best-scoring result first (ties: the merge of lower-id parts first)."""
    sp = tok.sp
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    mergeable = {
        p: i
        for p, i in vocab.items()
        if not (sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i) or sp.is_unused(i))
    }
    ranked = []
    for piece, i in mergeable.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in mergeable and right in mergeable:
                ranked.append(((-sp.get_score(i), i, vocab[left], vocab[right]), (left, right)))
    ranked.sort()
    return vocab, [pair for _, pair in ranked]


def _tokenizer_json(tok: Tokenizer, unk: str, bos: str, eos: str) -> str:
    """The serialized `tokenizers.Tokenizer` equivalent to `tok` (encode: BOS + ids)."""
    from tokenizers import AddedToken, decoders, models, normalizers
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.processors import TemplateProcessing

    vocab, merges = vocab_and_merges(tok)
    hf = HFTokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token=unk, byte_fallback=True, fuse_unk=True)
    )
    hf.normalizer = normalizers.Replace(" ", SPACE)
    hf.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (unk, bos, eos)])
    hf.post_processor = TemplateProcessing(
        single=f"{bos} $A",
        pair=f"{bos} $A {eos} {bos} $B:1",  # two documents as in training: [BOS] a [EOS] [BOS] b
        special_tokens=[(bos, tok.bos_id), (eos, tok.eos_id)],
    )
    return hf.to_str()


def tokenizer_files(tok: Tokenizer, max_length: int) -> dict[str, str]:
    """file name -> text of the Hugging Face tokenizer files for `tok` (but tokenizer.model)."""
    sp = tok.sp
    unk = sp.id_to_piece(sp.unk_id())
    bos, eos = sp.id_to_piece(tok.bos_id), sp.id_to_piece(tok.eos_id)
    special = {"bos_token": bos, "eos_token": eos, "unk_token": unk, "pad_token": eos}
    config: dict[str, Any] = {
        # the generic fast class loads tokenizer.json as it is; the Llama class would rebuild
        # it with a dummy-prefix pre-tokenizer our tokenizer does not have
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": True,
        "add_eos_token": False,
        # SentencePiece reads "<s>" in text as three characters, not as BOS: so does this
        "split_special_tokens": True,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "padding_side": "left",
    }
    return {
        "tokenizer.json": _tokenizer_json(tok, unk, bos, eos),
        "tokenizer_config.json": json.dumps(config, indent=2) + "\n",
        "special_tokens_map.json": json.dumps(special, indent=2) + "\n",
    }


def write_tokenizer_files(
    tok: Tokenizer | PretrainedTokenizer, out_dir: Path, max_length: int
) -> None:
    """Into `out_dir`, export's own new folder; a model's own tokenizer is written back as is."""
    if isinstance(tok, PretrainedTokenizer):
        for name, data in tok.files().items():
            if name not in TOKENIZER_FILES:  # (the bundle's check refused such names already)
                raise UserError(f"{name!r} is not a tokenizer file name; refusing to write it")
            (out_dir / name).write_bytes(data)
        # (a bundle handed over or edited: prepare refused such a folder; transformers would
        # build the class it names when it loads the export, lm-eval in eval's process)
        if problem := named_class_problem(out_dir, f"the tokenizer {tok.path}"):
            said = problem.split(" names ", 1)[-1]
            raise UserError(f"tokenizer {tok.path}: its tokenizer_config.json names {said}")
        return
    for name, text in tokenizer_files(tok, max_length).items():
        (out_dir / name).write_text(text, encoding="utf-8")
    # the run's own copy, read as a folder's file: a link out of the run dir is not exported
    if (data := read_folder_file(tok.path.parent, tok.path.name, "the run's tokenizer")) is None:
        raise UserError(f"{tok.path} is not a regular file; restore the run's tokenizer.model")
    (out_dir / "tokenizer.model").write_bytes(data)
