"""Holds ``sitecustomize.py``: the agent puts this directory first on the worker's PYTHONPATH."""
