"""Parallelism building blocks: the device mesh, data-parallel gradient sync and ZeRO-1."""
