"""`python -m polyalign`: the `polyalign` program, for an environment whose scripts are not on PATH."""

from polyalign.cli import entry

if __name__ == "__main__":
    entry()
