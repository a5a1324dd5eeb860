"""polyalign: align language models to the human response distribution of each interaction context."""

__version__ = "0.1.0"
