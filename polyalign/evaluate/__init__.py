"""Evaluation: utility, diversity, naturalness (BNG, HCR, MAUVE), turn dynamics, frontier, aggregate."""
