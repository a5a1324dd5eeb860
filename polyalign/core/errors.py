"""Every error polyalign raises for a problem the user can fix, under one base class.

`polyalign.cli.main` catches PolyalignError and prints its message as one line (exit status 2), so a
new kind of error only has to derive from it. Each message names the file, the line or the key, and
what to do. The classes also keep the built-in base they always had (ValueError, RuntimeError), so
code that caught those still does.
"""

from __future__ import annotations


class PolyalignError(Exception):
    """A problem the user can fix; the message says where and what to do."""


class ConfigError(PolyalignError, ValueError):
    """A configuration problem; the message names the file and the key."""


class UnknownKeyError(ConfigError):
    """A key the config's schema does not have: `key`, and whether it stands at the config's top level (a
    caller that knows other schemas, as the training methods do, can say whose key it is)."""

    def __init__(self, message: str, key: str, top_level: bool):
        super().__init__(message)
        self.key, self.top_level = key, top_level


class InputError(PolyalignError):
    """A problem with a whole input (missing file, unreadable JSON document, bad config). The message
    names the file and, where known, the line."""


class RowProblem(PolyalignError):
    """A problem with one row; the importer attaches the row's location."""


class PrepareError(PolyalignError):
    """Stops `prepare` with one line that names the file, the row and the problem."""


class StatsError(PolyalignError):
    """A run whose statistics cannot be computed (no prepared data, an empty split)."""


class TokenizerError(PolyalignError, ValueError):
    """A tokenizer that cannot be loaded or trained, named with its path."""


class ChatTemplateError(PolyalignError, ValueError):
    """A conversation a template cannot render, or an unknown template."""


class ModelConfigError(PolyalignError, ValueError):
    """An architecture polyalign cannot build, or a config.json it cannot read."""


class CheckpointError(PolyalignError, ValueError):
    """A checkpoint directory polyalign cannot read, or a destination it will not overwrite."""


class ParallelError(PolyalignError, ValueError):
    """A mesh that does not fit the devices, or a broken multi-process setup."""


class TrainingError(PolyalignError, RuntimeError):
    """Training cannot go on (too many non-finite steps, a batch that does not fit the mesh)."""


class CriticCollapse(TrainingError):
    """The critic gives every pair the same score; its scores would carry no information."""


class GenerationError(PolyalignError, ValueError):
    """Bad sampling settings or inputs."""


class EvaluationError(PolyalignError, ValueError):
    """Predictions that do not line up with the records, or unusable inputs."""


class LaunchError(PolyalignError, ValueError):
    """A launch that cannot start: no command, or SLURM variables missing."""


class Interrupted(PolyalignError):
    """A run stopped before its end (Ctrl-C, SIGTERM, `train.stop_at`) with its progress saved; the
    message says where, and that the same command resumes. Exit status 130, not an error."""


class JsonProblem(PolyalignError, ValueError):
    """Why a JSON text is refused by strict parsing (polyalign/core/jsonl.py); callers add the file and, for a
    syntax error, the `line` inside the text that it carries."""

    def __init__(self, message: str, line: int | None = None):
        super().__init__(message)
        self.line = line
