"""Command-line tools over the whole stack (the kv-math calculator and its host measurements)."""
