"""The elasticrun operator (kopf)."""
