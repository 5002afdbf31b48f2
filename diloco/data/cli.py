"""`diloco data tokenize|info|check …`: make a token store once, print its manifest, check it for a run.
(`diloco data warm|peek|prepare|info --data …` are python -m diloco.data's commands.)"""

from __future__ import annotations

import argparse
import json
import sys

from diloco.errors import ConfigError


def main(argv: list[str]) -> int:
    argv = list(argv)
    if not argv or argv[0] not in ("tokenize", "info", "check") or (argv[0] == "info" and argv[1:2] and argv[1].startswith("-")):
        if argv and argv[0] in ("-h", "--help"):
            print(__doc__)
            return 0
        from diloco.data.__main__ import main as corpus_main

        corpus_main(argv)
        return 0
    p = argparse.ArgumentParser(prog="diloco data", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tokenize", help="tokenize a corpus into a token store (resumable: rerun to finish)")
    t.add_argument("--data", required=True, help="stdlib | c4 | c4:<dir> | dolma:<glob> | jsonl:<glob> | text:<glob>")
    t.add_argument("--vocab", default="byte", help="byte | sentencepiece:<path>")
    t.add_argument("--data_dir", default=None)
    t.add_argument("--out", required=True, help="the store: a local folder or gs://bucket/path")
    t.add_argument("--splits", default="train,validation")
    t.add_argument("--workers", type=int, default=0, help="processes (default: every core; at most one per 1.5 GiB of available memory)")
    i = sub.add_parser("info", help="print a store's manifest")
    i.add_argument("store")
    c = sub.add_parser("check", help="the preflight check: manifest present, vocabulary and seq_len fit")
    c.add_argument("store")
    c.add_argument("--vocab", required=True)
    c.add_argument("--seq_len", type=int, required=True)
    a = p.parse_args(argv)
    from diloco.data import store

    try:
        if a.cmd == "tokenize":
            man = store.tokenize(a.data, a.vocab, a.out, a.data_dir, tuple(s for s in a.splits.split(",") if s),
                                 a.workers or None)
            counts = {k: {"tokens": v["tokens"], "docs": v["docs"]} for k, v in man["splits"].items()}
            print(json.dumps({"store": a.out, "fingerprint": man["fingerprint"], **counts}), flush=True)
        elif a.cmd == "info":
            print(json.dumps(store.info(a.store), indent=1, sort_keys=True))
        else:
            man = store.check_store(a.store, a.vocab, a.seq_len)
            print(f"{a.store}: fingerprint {man['fingerprint']}, ok for vocab {a.vocab} at seq_len {a.seq_len}")
    except ConfigError as e:
        print(f"diloco data: bad input: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if a.cmd != "tokenize":
            raise
        print(f"diloco data tokenize: interrupted; the finished parts in {a.out} are kept and no manifest was "
              "written: run the same command to finish", file=sys.stderr)
        return 130
    return 0
