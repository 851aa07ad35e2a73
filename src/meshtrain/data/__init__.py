"""Data layer: corpus or fine-tuning examples, the tokenizer, and the packed blocks.

The entry points are in `data/prepare.py` (load the corpus or the examples, make the
tokenizer, pack into blocks; each chooses its path from `data.*`); the workers read the
blocks with `blocks.py`, `batch.py` and `sampler.py`. Pure functions over Hugging Face
``datasets`` objects, so the Kedro pipelines can call them as nodes and the engine can use
them without importing Kedro. This package imports nothing itself, so a worker that only
reads blocks loads neither `datasets` nor `transformers`.
"""
