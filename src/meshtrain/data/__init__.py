"""Data layer: corpus loading, tokenizer training and fixed-length block packing.

Pure functions over Hugging Face ``datasets`` objects, so the Kedro pipelines can call them
as nodes and the engine can use them without importing Kedro.
"""
