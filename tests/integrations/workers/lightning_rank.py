"""Prints the rank Lightning's ``rank_zero_only`` holds right after ``import lightning``, before
any Trainer sets it, beside the worker's ``RANK``: in a worker forked from a warm template that
imported Lightning, the two must agree as in a cold start."""

import os

import lightning  # noqa: F401 (its import sets rank_zero_only.rank)
from lightning_utilities.core.rank_zero import rank_zero_only

print(f"RANK {os.environ['RANK']} rank_zero_only.rank {rank_zero_only.rank}", flush=True)
