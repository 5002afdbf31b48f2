"""Named model scales: the paper's Table 2 (35M…4B), 10B, and CPU toy scales.

`diloco sizes` (diloco/model/sizes.py) prints each with its exact parameter count.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Scale:
    layers: int
    d_model: int
    heads: int
    mlp_dim: int
    max_seq_len: int = 2048
    label: str = ""  # the scaling-laws paper's label for this shape (tied embeddings)


# Layers/heads/MLP dim from [SD] Table 2; d_model = MLP/4 ([SL] Table 3 "QKV dimension").
SCALES: dict[str, Scale] = {
    # CPU toy scales (byte vocabulary, seconds per hundred steps on 2 cores).
    "tiny": Scale(layers=3, d_model=32, heads=2, mlp_dim=128, max_seq_len=512, label="tiny"),
    "toy": Scale(layers=6, d_model=64, heads=4, mlp_dim=256, max_seq_len=512, label="toy"),
    "toy-l": Scale(layers=12, d_model=128, heads=4, mlp_dim=512, max_seq_len=1024, label="toy-l"),
    # The paper's scales.
    "35M": Scale(6, 512, 8, 2048, label="35M"),
    "100M": Scale(9, 768, 12, 3072, label="90M"),
    "200M": Scale(12, 1024, 16, 4096, label="180M"),
    "300M": Scale(15, 1280, 20, 5120, label="335M"),
    "500M": Scale(18, 1536, 24, 6144, label="550M"),
    "1B": Scale(24, 2048, 32, 8192, label="1.3B"),
    "4B": Scale(36, 3072, 48, 12288, label="4B"),
    "10B": Scale(48, 4096, 64, 16384, label="10B"),
}

PAPER_VOCAB = 32_000  # the paper's nominal vocabulary; `diloco bytes`/`simulate` formulas use it

# The vocabularies runs use (experiments/): the CPU scales read bytes, the paper's scales the T5
# SentencePiece model (32,000 pieces + 100 extra ids + 1, as seqio reports it). The trainer pads the
# embedding to a multiple of VOCAB_PAD rows, which `diloco sizes` counts too.
TOY_SCALES = ("tiny", "toy", "toy-l")
BYTE_VOCAB = 259  # seqio.ByteVocabulary: 3 special ids + 256 bytes
T5_VOCAB = 32_101
VOCAB_PAD = 128


def padded_vocab(n: int) -> int:
    return -(-n // VOCAB_PAD) * VOCAB_PAD


def run_vocab(name: str) -> tuple[str, int]:
    """(name, ids) of the vocabulary a run at this scale uses by default."""
    return ("byte", BYTE_VOCAB) if name in TOY_SCALES else ("T5 32k", T5_VOCAB)


def label_params(label: str) -> float | None:
    """'1.3B' -> 1.3e9; toy labels -> None."""
    mult = {"M": 1e6, "B": 1e9}
    if label and label[-1] in mult:
        return float(label[:-1]) * mult[label[-1]]
    return None


def formula_params(name: str, vocab_size: int = PAPER_VOCAB) -> int:
    """12·L·d² + V·d: attention 4d², MLP 8d² per block, tied embedding V·d (norm scales excluded)."""
    s = SCALES[name]
    return 12 * s.layers * s.d_model**2 + vocab_size * s.d_model
