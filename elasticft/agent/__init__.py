"""The node agent: torch's LocalElasticAgent driving the add-ons, with its warm pool.

It sits above the add-ons it runs; what they implement is :mod:`elasticft.addon`.
"""
