"""Preference pairs: made from the policy's generations against the human responses, or imported from
users' TRL and ShareGPT files."""
