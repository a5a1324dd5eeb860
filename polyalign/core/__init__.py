"""Foundation every other home builds on: user-facing errors, local-or-bucket paths, strict JSONL,
YAML settings into dataclasses, stage outputs and their settings, optional extras. Imports nothing else of
polyalign."""
