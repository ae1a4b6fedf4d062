"""The node agent: torch's LocalElasticAgent plus failure classification, policy and events."""
