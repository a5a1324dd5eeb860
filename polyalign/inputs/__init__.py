"""Tokenised datasets: building them (TFDS array_record) and feeding them to the trainer (grain)."""
