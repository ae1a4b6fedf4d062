"""Holds the ``sitecustomize.py`` of pre-started worker interpreters (elasticft.agent.warmpool).

The agent puts this directory first on a pre-started interpreter's PYTHONPATH only; it is never
on a running worker's path.
"""
