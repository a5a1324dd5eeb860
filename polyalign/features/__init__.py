"""Measures of a response: the text feature set, LM features, and per-bucket human support
statistics with the support distance they define."""
