"""Framework adapters, installed as ``hyper_gen.backends``; each imports its framework lazily."""
