"""Config strings → seqio Tasks → int32 token batches (TensorFlow/seqio are imported lazily, on first use).

data: stdlib | c4 | c4:<prepared tfds dir> | dolma | dolma:<glob> | jsonl:<glob> | text:<glob>
vocab: byte | sentencepiece:<path>
"""

from diloco.data.batches import TokenBatches, cache_dir, eval_batches
from diloco.data.specs import corpus_info, parse_data, parse_vocab, validate_data


def get_vocabulary(spec: str = "byte"):
    """seqio.ByteVocabulary ('byte') or seqio.SentencePieceVocabulary ('sentencepiece:<path>')."""
    from diloco.data import tasks

    return tasks.get_vocabulary(spec)


__all__ = ["TokenBatches", "cache_dir", "corpus_info", "eval_batches", "get_vocabulary", "parse_data", "parse_vocab", "validate_data"]
