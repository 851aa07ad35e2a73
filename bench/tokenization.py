"""Data processing throughput: meshtrain's `tokenize_and_pack` beside the usual HF recipe.

The corpus is `load_corpus("builtin")` (English documentation shipped with Python),
the tokenizer is trained on it once with `train_tokenizer` (byte-level BPE,
`--vocab` 4096) and shared by every side. Each side turns the corpus into blocks of
`--block` tokens with `--num-proc` worker processes (the project default, 2):

* meshtrain: `tokenize_and_pack(corpus, tokenizer, block_size, validation_fraction=0.05,
  seed=1234, num_proc)` -- document split, batched tokenizing in workers (input ids
  only, an eos after each document, int32), packing with Arrow compute in-process.
* HF recipe (run_clm): the recipe of the Hugging Face `run_clm` example, written here
  from its description: a batched `map` of `tokenizer(texts)` (input ids and attention
  mask) with `num_proc`, then a batched `map` with `num_proc` that concatenates each
  batch of 1000 rows and cuts it into blocks, dropping the batch's tail, and copies
  the ids into `labels`. No eos between documents (run_clm adds none either).
* HF recipe, meshtrain's output: the same two maps made to produce what meshtrain
  produces (input ids only, eos after each document, no attention mask or labels),
  the strictest baseline.

Both HF variants start from the same train/validation document split
(`split_documents`, timed on every side), so all three tokenize the same text.
Throughput = tokens in the resulting blocks (train + validation) / wall seconds of
the call.

No side can reuse a `datasets` cache: by default, before each run (untimed) the
corpus is saved to a fresh folder of its own and loaded back memory-mapped -- as the
Kedro pipeline stores it in `data/01_raw/corpus` -- so every `map` and `select`
writes its Arrow cache files into that run's empty folder and finds nothing to
reuse (the HF maps also pass `load_from_cache_file=False`); the script checks that
every result's files are in the run's folder. `--in-memory` instead keeps the corpus
in memory (`Dataset.from_dict`), where `datasets` caches nothing at all.

One warm-up run of each side comes first, then `--repeats` runs of each, the order
reversed on every other repeat. Nothing is asserted about speed.

    .venv/bin/python bench/tokenization.py               # ~1-2 min
    .venv/bin/python bench/tokenization.py --in-memory
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from meshtrain.offline import use_offline_defaults

VALIDATION_FRACTION = 0.05
SPLIT_SEED = 1234
ENV_PREFIX = (
    "KEDRO_DISABLE_TELEMETRY=true DO_NOT_TRACK=true MLFLOW_DISABLE_TELEMETRY=true "
    "HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false"
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--num-proc", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--builtin-max-chars", type=int, default=None)
    parser.add_argument("--in-memory", action="store_true", help="keep the corpus in memory")
    parser.add_argument("--work-dir", type=Path, default=None, help="default: a temp dir")
    return parser.parse_args()


# --------------------------------------------------------------------------- the sides


def meshtrain_side(corpus: Any, tokenizer: Any, args: argparse.Namespace) -> Any:
    from meshtrain.data.packing import tokenize_and_pack

    return tokenize_and_pack(
        corpus,
        tokenizer,
        block_size=args.block,
        validation_fraction=VALIDATION_FRACTION,
        seed=SPLIT_SEED,
        num_proc=args.num_proc,
    )


def hf_recipe(corpus: Any, tokenizer: Any, args: argparse.Namespace, *, lean: bool) -> Any:
    """Tokenize with a batched map, then concatenate-and-chunk with a second one.

    `lean=False`: the run_clm shape (input ids, attention mask, labels; no eos).
    `lean=True`: meshtrain's output (input ids only, eos after every document).
    """
    from meshtrain.data.packing import split_documents

    raw = split_documents(corpus, VALIDATION_FRACTION, SPLIT_SEED)
    eos = tokenizer.eos_token_id
    block = args.block

    def encode(batch: dict[str, list[str]]) -> dict[str, list[list[int]]]:
        if not lean:
            return dict(tokenizer(batch["text"]))
        ids = tokenizer(batch["text"], add_special_tokens=False, return_attention_mask=False)
        return {"input_ids": [row + [eos] for row in ids["input_ids"]]}

    def chunk(batch: dict[str, list[list[int]]]) -> dict[str, list[list[int]]]:
        out = {}
        for name, rows in batch.items():
            stream = list(itertools.chain.from_iterable(rows))
            usable = len(stream) - len(stream) % block
            out[name] = [stream[i : i + block] for i in range(0, usable, block)]
        if not lean:
            out["labels"] = list(out["input_ids"])
        return out

    tokenized = raw.map(
        encode,
        batched=True,
        num_proc=args.num_proc,
        remove_columns=["text"],
        load_from_cache_file=False,
    )
    return tokenized.map(chunk, batched=True, num_proc=args.num_proc, load_from_cache_file=False)


SIDES = {
    "meshtrain": meshtrain_side,
    "hf_run_clm": lambda corpus, tokenizer, args: hf_recipe(corpus, tokenizer, args, lean=False),
    "hf_same_output": lambda corpus, tokenizer, args: hf_recipe(corpus, tokenizer, args, lean=True),
}
LABELS = {
    "meshtrain": "meshtrain `tokenize_and_pack`",
    "hf_run_clm": "HF recipe (run_clm: ids + mask + labels)",
    "hf_same_output": "HF recipe, meshtrain's output (ids + eos)",
}


# --------------------------------------------------------------------------- driver


def fresh_corpus(corpus: Any, folder: Path, in_memory: bool) -> Any:
    """The corpus for one run: in memory, or saved to and mapped from an empty folder."""
    import datasets

    if in_memory:
        return corpus
    folder.mkdir(parents=True)
    corpus.save_to_disk(str(folder / "corpus"))
    return datasets.load_from_disk(str(folder / "corpus"))


def check_no_reuse(result: Any, folder: Path, in_memory: bool) -> int:
    """Every file behind the result was written in this run's folder; returns their count."""
    files = [entry["filename"] for split in result.values() for entry in split.cache_files]
    if in_memory:
        if files:
            raise RuntimeError(f"an in-memory run left cache files: {files[:3]}")
        return 0
    outside = [f for f in files if not Path(f).resolve().is_relative_to(folder.resolve())]
    if outside or not files:
        raise RuntimeError(f"result files outside the run's folder {folder}: {outside[:3]}")
    return len(files)


def run(side: str, corpus, tokenizer, args, root: Path, tag: str) -> dict[str, Any]:
    from meshtrain.data.packing import count_tokens

    folder = root / tag
    data = fresh_corpus(corpus, folder, args.in_memory)
    began = time.perf_counter()
    result = SIDES[side](data, tokenizer, args)
    seconds = time.perf_counter() - began
    files = check_no_reuse(result, folder, args.in_memory)
    tokens = sum(count_tokens(split) for split in result.values())
    blocks = {name: len(split) for name, split in result.items()}
    print(
        f"  {tag:<28} {tokens / seconds:>10,.0f} tokens/s  {seconds:6.2f}s  "
        f"{tokens:,} tokens in {blocks['train']:,} + {blocks['validation']:,} blocks, "
        f"columns {result['train'].column_names}, {files} cache file(s)",
        flush=True,
    )
    return {"tokens_per_s": tokens / seconds, "tokens": tokens, "blocks": blocks}


def main() -> None:
    use_offline_defaults()  # before datasets and tokenizers load
    import datasets

    from meshtrain.data.corpus import load_corpus
    from meshtrain.data.tokenizer import train_tokenizer

    args = parse_args()
    datasets.disable_progress_bars()
    with tempfile.TemporaryDirectory(prefix="mt-tokenize-") as tmp:
        root = args.work_dir or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        began = time.perf_counter()
        corpus = load_corpus("builtin", builtin_max_chars=args.builtin_max_chars)
        characters = sum(len(text) for text in corpus["text"])
        loaded = time.perf_counter() - began
        began = time.perf_counter()
        tokenizer = train_tokenizer(corpus, args.vocab)
        trained = time.perf_counter() - began
        header = (
            f"builtin corpus: {len(corpus):,} documents, {characters:,} characters "
            f"(loaded in {loaded:.1f}s); byte-level BPE of {len(tokenizer):,} tokens "
            f"(trained once, {trained:.1f}s); blocks of {args.block}, num_proc "
            f"{args.num_proc}; corpus "
            + ("in memory" if args.in_memory else "saved to a fresh folder per run")
        )
        print(header, flush=True)
        sides = list(SIDES)
        print("warm-up (not counted)", flush=True)
        for side in sides:
            run(side, corpus, tokenizer, args, root, f"warmup-{side}")
        results: dict[str, list[float]] = defaultdict(list)
        tokens: dict[str, int] = {}
        for repeat in range(args.repeats):
            order = sides if repeat % 2 == 0 else list(reversed(sides))
            print(f"repeat {repeat + 1}: {' -> '.join(order)}", flush=True)
            for side in order:
                outcome = run(side, corpus, tokenizer, args, root, f"r{repeat + 1}-{side}")
                results[side].append(outcome["tokens_per_s"])
                tokens[side] = outcome["tokens"]

    mean = {side: statistics.fmean(values) for side, values in results.items()}
    reps = " | ".join(f"rep {r + 1}" for r in range(args.repeats))
    lines = [
        header,
        "",
        f"| side | {reps} | mean tokens/s | tokens in blocks |",
        "|---|" + "---:|" * (args.repeats + 2),
    ]
    for side in sides:
        cells = " | ".join(f"{v:,.0f}" for v in results[side])
        lines.append(f"| {LABELS[side]} | {cells} | {mean[side]:,.0f} | {tokens[side]:,} |")
    lines.append("")
    for other in sides[1:]:
        paired = [m / o for m, o in zip(results["meshtrain"], results[other], strict=True)]
        ratio = mean["meshtrain"] / mean[other]
        met = "met" if ratio >= 1.0 else "NOT met"
        lines.append(
            f"meshtrain / {LABELS[other]}: {ratio:.3f}x (per repeat: "
            f"{', '.join(f'{r:.3f}' for r in paired)}); target >= 1.00x {met}"
        )
    print()
    print(f"command: {ENV_PREFIX} .venv/bin/python {' '.join(sys.argv)}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
