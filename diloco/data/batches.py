"""The batches a run reads: every data spec through its token store (diloco/data/prepare.py), read by
global row index (diloco/data/reader.py). One reader and one order rule for every corpus and host count."""

from __future__ import annotations

import numpy as np

from diloco.data import prepare
from diloco.data.reader import StoreBatches, local_row_ids, refuse_foreign_state, store_eval_batches
from diloco.data.specs import cache_dir  # noqa: F401  (diloco.cli and diloco.compile use batches.cache_dir)
from diloco.errors import ConfigError


class TokenBatches(StoreBatches):
    """Endless int32 (batch_size, seq_len) batches of a data spec, seeded and resumable: the store of `data`
    (made in $DILOCO_CACHE on first use for a corpus spec) read by reader.StoreBatches' order rule.
    rows: the flattened global rows this caller holds (default all); get_state()/set_state() as StoreBatches."""

    def __init__(self, data: str, vocab: str = "byte", seq_len: int = 128, batch_size: int = 8, seed: int = 0,
                 data_dir: str | None = None, split: str = "train", rows=None, prefetch: int = 2):
        prepare.validate_data(data, vocab, data_dir, seq_len, split)
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ConfigError("batch_size", f"batch_size={batch_size!r} must be an int >= 1")
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ConfigError("prefetch", f"prefetch={prefetch!r} must be an int >= 0 (0: no background thread)")
        self.data, self.vocab, self.data_dir = data, vocab, data_dir
        super().__init__(prepare.store_for(data, vocab, data_dir), seq_len, batch_size, seed, rows, prefetch, split)


def train_batches(cfg, sharding, shape: tuple[int, int, int], saved: dict | None = None) -> StoreBatches:
    """This process's reader of a run's train split: the rows of the (R, b, L) global batch its devices
    hold, from the run's token store. `saved`: the newest checkpoint's data state, checked here (another
    reader's state, another store, seed, seq_len or batch size: one ConfigError), before the model state
    is read. Every process must read the same store (checked by its fingerprint)."""
    from diloco import distributed as dist

    if saved:
        refuse_foreign_state(saved, cfg.data)  # before a store is prepared: nothing to do for this run
    it = StoreBatches(prepare.store_for(cfg.data, cfg.vocab, cfg.data_dir or None), cfg.seq_len, cfg.batch_size,
                      cfg.seed, local_row_ids(sharding, shape))
    if dist.num_processes() > 1:
        fps = [int(x) for x in dist.allgather(np.int64(int(it.store.fingerprint[:15], 16)))]
        if len(set(fps)) > 1:
            it.close()
            raise ConfigError("data", f"the processes of this run prepared different token stores from "
                              f"data={cfg.data!r} (fingerprints {sorted({f'{f:015x}' for f in fps})}: their copies "
                              "of the corpus differ); tokenize it once (`diloco data tokenize --out gs://…`) and "
                              "run with --config.data=tokens:gs://…")
    if saved:
        it.set_state(saved)
    return it


def eval_batches(data: str, vocab: str, seq_len: int, batch_size: int, num_batches: int,
                 data_dir: str | None = None) -> list[np.ndarray]:
    """The first num_batches·batch_size rows of the store's validation split, in order (wrapping if short)."""
    return store_eval_batches(prepare.store_for(data, vocab, data_dir), seq_len, batch_size, num_batches)
