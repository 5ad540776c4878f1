"""asyncrl's config recipes, installed as `asyncrl.configs` (read through importlib.resources)."""
