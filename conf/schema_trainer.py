"""The `trainer` section: length of the run, placement, logging, validation and checkpoints."""

import os
import unicodedata
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from .schema_common import Section, Seed, error_at

GLOB_CHARACTERS = "*?[]{}"
"""What DuckDB reads as a pattern in a path: the run's tables are read by glob (tasks/storage/catalog.py)."""

NAME_MAX = 255
"""The longest file name, in bytes, that Linux and macOS file systems take."""


class TrainerConfig(Section):
    """The training loop around the iterations (verl's `trainer`)."""

    balance_batch: bool = True
    """Reorder rollouts so that each GPU gets a similar number of tokens."""
    total_epochs: int = Field(30, gt=0)
    """Passes over the training prompts (total_training_steps, when set, wins)."""
    total_training_steps: int | None = Field(None, gt=0)
    """Iterations to run; None runs total_epochs epochs."""
    project_name: str = "ppoflow"
    """Project name for loggers."""
    default_hdfs_dir: str | None = None
    """Where verl copies checkpoints on HDFS (older verl)."""
    experiment_name: str = "demo"
    """Run name: names the run directory runs/<experiment_name> and the logger run, so it must be a
    plain name (no path separators, not '.' or '..')."""
    logger: list[Literal["console", "wandb"]] = ["console"]
    """Metric sinks; a single name such as logger=console is accepted."""
    log_val_generations: int = Field(0, ge=0)
    """Validation generations printed to loggers per validation."""
    rollout_data_dir: str | None = None
    """Also dump rollouts as JSONL here (verl); the parquet in the run directory always exists."""
    validation_data_dir: str | None = None
    """Also dump validation generations as JSONL here (verl)."""
    nnodes: int = Field(1, gt=0)
    """Machines in the run."""
    n_gpus_per_node: int = Field(1, gt=0)
    """Processes (GPUs) per machine; on CPU, processes."""
    save_freq: int = -1
    """Write model weights every this many iterations; 0 or negative saves only at the end."""
    resume_mode: Literal["auto", "disable", "resume_path"] = "auto"
    """auto resumes from the run directory, disable starts afresh, resume_path uses resume_from_path."""
    resume_from_path: str | None = None
    """Checkpoint directory to resume from when resume_mode is resume_path."""
    val_before_train: bool = True
    """Validate once before the first iteration."""
    val_only: bool = False
    """Validate and stop without training."""
    test_freq: int = -1
    """Validate every this many iterations and after the last; 0 or negative: no validation while
    training (only trainer.val_before_train), as verl."""
    critic_warmup: int = Field(0, ge=0)
    """Iterations that update only the critic before the actor starts."""
    default_local_dir: str | None = None
    """Run directory; None means runs/<experiment_name> (see run_dir). No glob character (*?[]{}) and
    no component longer than 255 bytes, so that the run can be written and read back."""
    max_actor_ckpt_to_keep: int | None = Field(None, gt=0)
    """Actor checkpoints kept on disk; None keeps all."""
    max_critic_ckpt_to_keep: int | None = Field(None, gt=0)
    """Critic checkpoints kept on disk; None keeps all."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Where models run."""
    seed: Seed = 1
    """Global seed for model initialisation and everything not seeded elsewhere."""
    num_threads: int | None = Field(None, gt=0)
    """torch CPU threads; None leaves torch's choice (on a busy 2-core machine 1 can beat 2)."""
    del_local_ckpt_after_load: bool = False
    """Delete a checkpoint from local disk once it has been loaded."""
    esi_redundant_time: int = Field(0, ge=0)
    """Seconds before a cluster job's expiry at which to save (verl's ESI)."""

    @field_validator("logger", mode="before")
    @classmethod
    def _one_logger_is_a_list(cls, value: Any) -> Any:
        # verl's quickstart writes trainer.logger=console.
        return [value] if isinstance(value, str) else value

    @field_validator("experiment_name")
    @classmethod
    def _plain_name(cls, value: str) -> str:
        # runs/<experiment_name> must stay one folder under runs/: an absolute path or '..' would put
        # the run's files anywhere. A run meant to live elsewhere sets trainer.default_local_dir.
        problem = name_problem(value)
        if problem is not None:
            raise ValueError(
                f"a plain name for the run directory runs/<name> ({problem}); "
                "to put the run elsewhere set trainer.default_local_dir"
            )
        size = len(value.encode())
        if size > NAME_MAX:
            raise ValueError(
                f"a name of at most {NAME_MAX} bytes in UTF-8 (it names the folder runs/<name>), "
                f"got {size} bytes"
            )
        return value

    @field_validator("default_local_dir")
    @classmethod
    def _writable_dir(cls, value: str | None) -> str | None:
        # Refused here rather than after a first step has run and written files into it.
        if value is None:
            return value
        value = os.path.expanduser(value)  # "~/runs/x" is in your home, as for every other path key
        if any(char in value for char in GLOB_CHARACTERS):
            raise ValueError(
                f"a run directory without glob characters ({GLOB_CHARACTERS}): "
                "DuckDB reads the run's tables by glob"
            )
        size = max((len(part.encode()) for part in Path(value).parts), default=0)
        if size > NAME_MAX:
            raise ValueError(
                f"path components of at most {NAME_MAX} bytes in UTF-8 (the longest file name), "
                f"got one of {size} bytes"
            )
        return value

    @model_validator(mode="after")
    def _name_globs_only_elsewhere(self) -> "TrainerConfig":
        # The name is a path only when it makes the run directory: elsewhere it just labels the
        # logger's run, where brackets are common (lr[3e-4]).
        name = self.experiment_name
        if self.default_local_dir is None and any(char in name for char in GLOB_CHARACTERS):
            raise error_at(
                ("experiment_name",),
                name,
                f"a name without glob characters ({GLOB_CHARACTERS}) for the run directory runs/<name>: "
                "DuckDB reads the run's tables by glob; to keep this name, set trainer.default_local_dir "
                "to a directory without them",
            )
        return self

    @property
    def world_size(self) -> int:
        """Processes taking part in an update: nnodes × n_gpus_per_node."""
        return self.nnodes * self.n_gpus_per_node

    @property
    def run_dir(self) -> Path:
        """Where the run's parquet, checkpoints and catalog live."""
        if self.default_local_dir is not None:
            return Path(self.default_local_dir)
        return Path("runs") / self.experiment_name


def name_problem(name: str) -> str | None:
    """Why `name` is not one plain path component, or None when it is."""
    if not name.strip():
        return "it is empty"
    if name.startswith(("/", "\\")):
        return "it is an absolute path"
    if "/" in name or "\\" in name:
        return "it has a path separator"
    if name in (".", ".."):
        return f"'{name}' is not a name"
    if any(unicodedata.category(char) == "Cc" for char in name):
        return "it has a control character"
    return None
