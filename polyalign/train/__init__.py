"""Training: the shared loop, losses, checkpoints, and the SFT, critic and HDPO methods."""
