"""Config strings → a token store (tokenized once by seqio Tasks) → int32 token batches read by global index
(TensorFlow/seqio are imported lazily, only to tokenize).

data: stdlib | c4 | c4:<prepared tfds dir> | dolma | dolma:<glob> | jsonl:<glob> | text:<glob> | tokens:<store>
vocab: byte | sentencepiece:<path>
"""

from diloco.data.batches import TokenBatches, cache_dir, eval_batches, train_batches
from diloco.data.prepare import corpus_info, store_for, validate_data
from diloco.data.specs import parse_data, parse_vocab


class Vocabulary:
    """The seqio vocabulary of `spec`, built on first use of anything but its size and special ids:
    the byte vocabulary's are fixed, so a run on a warm token cache never imports TensorFlow."""

    BYTE = {"vocab_size": 259, "pad_id": 0, "eos_id": 1, "unk_id": 2}  # seqio.ByteVocabulary (tested)

    def __init__(self, spec: str = "byte"):
        self.spec = spec
        self.known = dict(self.BYTE) if parse_vocab(spec)[0] == "byte" else {}

    def __getattr__(self, name: str):
        if name.startswith("__") or name in ("spec", "known"):
            raise AttributeError(name)
        if name in self.known:
            return self.known[name]
        return getattr(self.seqio(), name)

    def seqio(self):
        """The seqio.Vocabulary itself (imports TensorFlow and seqio)."""
        from diloco.data import tasks

        return tasks.get_vocabulary(self.spec)


def get_vocabulary(spec: str = "byte") -> Vocabulary:
    """seqio.ByteVocabulary ('byte') or seqio.SentencePieceVocabulary ('sentencepiece:<path>'), loaded lazily."""
    return Vocabulary(spec)


__all__ = ["TokenBatches", "cache_dir", "train_batches", "corpus_info", "eval_batches", "store_for", "Vocabulary", "get_vocabulary", "parse_data", "parse_vocab", "validate_data"]
