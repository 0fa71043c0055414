"""SentencePiece BPE tokenizer, trained on a sample of the corpus: lossless on code and text
(identity normalization, whitespace kept, byte fallback, no dummy prefix), but for U+2581, its
own mark for a space, which decodes as a space. Documents are
[BOS] tokens [EOS]; the file's SHA-256 is in the manifest and every run directory has a copy."""

from __future__ import annotations

import hashlib
import io
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import sentencepiece as spm

from scale_llm.data.pretrained_tokenizer import BUNDLE_FILE, RESTORE_FIX, PretrainedTokenizer
from scale_llm.errors import UserError
from scale_llm.files import atomic_write_bytes

UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
SP_FILE = "tokenizer.model"  # a SentencePiece model prepare trained
# The names a tokenizer has in data.dir and in a run dir: ours, or a model's (data.tokenizer)
TOKENIZER_NAMES = (SP_FILE, BUNDLE_FILE)
MIN_VOCAB = 256 + 3 + 61  # byte-fallback pieces + specials + room for merges
_CHUNK_CHARS = 16_384  # SentencePiece skips "sentences" longer than max_sentence_length


class Tokenizer:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise UserError(
                f"tokenizer {self.path} does not exist; run `scale-llm prepare CONFIG` to train it"
            )
        try:
            self.sp = spm.SentencePieceProcessor(model_file=str(self.path))
        except (RuntimeError, OSError) as e:
            raise UserError(
                f"tokenizer {self.path} is not a SentencePiece model ({str(e).splitlines()[0]}); "
                f"{RESTORE_FIX}"
            ) from None
        self.bos_id, self.eos_id = self.sp.bos_id(), self.sp.eos_id()
        if min(self.bos_id, self.eos_id) < 0:  # (SentencePiece's -1: a piece turned off)
            raise UserError(
                f"tokenizer {self.path} has no BOS or EOS piece (its ids {self.bos_id}, "
                f"{self.eos_id}): not one prepare trains; {RESTORE_FIX}"
            )
        self.vocab_size = self.sp.get_piece_size()
        self.doc_start, self.doc_end = [self.bos_id], [self.eos_id]  # each is [BOS] ids [EOS]
        self.pad_id = self.eos_id  # no pad piece: a model's export pads with EOS

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        """The ids of each text, without BOS / EOS, in one single-threaded call."""
        return self.sp.encode(texts, num_threads=1)

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        ids = self.sp.encode(text)
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def decode(self, ids: Iterable[int]) -> str:
        return self.sp.decode([i for i in ids if i not in (self.bos_id, self.eos_id)])

    def sha256(self) -> str:
        return file_sha256(self.path)


def file_sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def load_tokenizer(path: str | Path) -> Tokenizer | PretrainedTokenizer:
    """The tokenizer in file `path`: a model's (hf-tokenizer.json), else our SentencePiece."""
    return PretrainedTokenizer(path) if Path(path).name == BUNDLE_FILE else Tokenizer(path)


def continuation(
    tokenizer: Tokenizer | PretrainedTokenizer, prompt: list[int], new: list[int]
) -> str:
    """The text `new` ids add after `prompt`'s, decoded after them: a decoder that strips a
    text's leading space (Llama 2's, Mistral's) or joins bytes lost it alone."""
    head, whole = tokenizer.decode(prompt), tokenizer.decode([*prompt, *new])
    return whole[len(head) :] if whole.startswith(head) else tokenizer.decode(new)


def refuse_unfit(tokenizer: Tokenizer | PretrainedTokenizer, vocab_size: int, ckpt: Path) -> None:
    """A run's tokenizer of more ids than the checkpoint's embedding rows (its records rewritten
    to name another tokenizer) is refused: its ids past the rows would index nothing."""
    if tokenizer.vocab_size > vocab_size:
        raise UserError(
            f"{tokenizer.path} has {tokenizer.vocab_size:,} token ids, but {ckpt}'s model has "
            f"{vocab_size:,} embedding rows: it was not trained with this tokenizer; restore the "
            f"run's own tokenizer, or pick another checkpoint"
        )


def run_copy_name(manifest_file: str) -> str:
    """The name a run dir keeps its copy of data.dir's tokenizer under (never another file's)."""
    return manifest_file if manifest_file in TOKENIZER_NAMES else SP_FILE


def run_tokenizer_path(run_dir: Path, sha256: str) -> Path:
    """The run dir's tokenizer with this SHA-256, else the one there for the error to name."""
    present = [run_dir / name for name in TOKENIZER_NAMES if (run_dir / name).is_file()]
    for path in present:
        if file_sha256(path) == sha256:
            return path
    return present[0] if len(present) == 1 else run_dir / SP_FILE


def check_vocab_size(vocab_size: int) -> None:
    if vocab_size < MIN_VOCAB:
        raise UserError(
            f"model.vocab_size={vocab_size} is too small for a byte-fallback tokenizer (256 byte "
            f"pieces, 3 special ones and room for merges): set model.vocab_size to at least "
            f"{MIN_VOCAB} (e.g. 4096)"
        )


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_path: str | Path) -> Tokenizer:
    """Train a BPE model on `texts` and write it atomically to `out_path`."""
    check_vocab_size(vocab_size)
    buf = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=_chunks(texts),
            model_writer=buf,
            model_type="bpe",
            vocab_size=vocab_size,
            byte_fallback=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            character_coverage=0.9999,
            max_sentence_length=_CHUNK_CHARS * 4,
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            pad_id=-1,
            num_threads=os.cpu_count() or 1,
            minloglevel=2,
        )
    except RuntimeError as e:  # e.g. a sample with too few distinct pieces for vocab_size
        raise UserError(_training_failed(str(e), vocab_size)) from None
    atomic_write_bytes(out_path, _one_thread(buf.getvalue()))  # into prepare's own build folder
    return Tokenizer(out_path)


def _one_thread(model: bytes) -> bytes:
    """The model with one training thread recorded, so that its bytes (and the SHA-256 a resume
    checks) are the same on machines of other core counts; as written where protobuf (a
    dependency of tensorboard) cannot read it."""
    try:
        from sentencepiece import sentencepiece_model_pb2

        proto = sentencepiece_model_pb2.ModelProto.FromString(model)
    except Exception:  # (protobuf missing, or of a version its generated code refuses)
        return model
    proto.trainer_spec.num_threads = 1
    return proto.SerializeToString()


def _training_failed(error: str, vocab_size: int) -> str:
    """SentencePiece's refusal as which way to move which key."""
    most = re.search(r"Vocabulary size too high \(\d+\)\. Please set it to a value <= (\d+)", error)
    if most and int(most[1]) >= MIN_VOCAB:
        return (
            f"model.vocab_size={vocab_size} is more pieces than the tokenizer's sample of the "
            f"corpus gives (at most {most[1]}): set model.vocab_size <= {most[1]}, or give it "
            f"more text (raise data.tokenizer_sample_bytes, or use a larger data.source)"
        )
    if most:
        return (
            f"the tokenizer's sample of the corpus gives at most {most[1]} pieces, fewer than "
            f"the {MIN_VOCAB} a byte-fallback tokenizer needs: give it more text (raise "
            f"data.tokenizer_sample_bytes, or use a larger data.source)"
        )
    if least := re.search(r"smaller than required_chars\. \d+ vs (\d+)", error):
        return (
            f"model.vocab_size={vocab_size} is fewer pieces than the tokenizer's sample needs: "
            f"it holds so many distinct characters that one piece each, with the byte and "
            f"special pieces, makes {least[1]}; set model.vocab_size >= {least[1]}"
        )
    first = error.strip().splitlines()[0].rstrip(".") if error.strip() else "no reason given"
    return (
        f"tokenizer training failed for model.vocab_size={vocab_size} ({first}); check "
        f"model.vocab_size against the sample it is trained on (data.tokenizer_sample_bytes, "
        f"data.source)"
    )


def _chunks(texts: Iterable[str]) -> Iterator[str]:
    """Split documents at line ends into pieces SentencePiece accepts as one 'sentence'."""
    for text in texts:
        start = 0
        while start < len(text):
            end = min(len(text), start + _CHUNK_CHARS)
            if end < len(text):
                cut = text.rfind("\n", start, end)
                end = cut + 1 if cut > start else end
            yield text[start:end]
            start = end
