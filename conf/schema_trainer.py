"""The `trainer` section: length of the run, placement, logging, validation and checkpoints."""

import unicodedata
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from .schema_common import Section, Seed


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
    save_freq: int = 1
    """Write model weights every this many iterations; 0 or negative saves only at the end."""
    resume_mode: Literal["auto", "disable", "resume_path"] = "auto"
    """auto resumes from the run directory, disable starts afresh, resume_path uses resume_from_path."""
    resume_from_path: str | None = None
    """Checkpoint directory to resume from when resume_mode is resume_path."""
    val_before_train: bool = True
    """Validate once before the first iteration."""
    val_only: bool = False
    """Validate and stop without training."""
    test_freq: int = 1
    """Validate every this many iterations; 0 or negative validates only at the end."""
    critic_warmup: int = Field(0, ge=0)
    """Iterations that update only the critic before the actor starts."""
    default_local_dir: str | None = None
    """Run directory; None means runs/<experiment_name> (see run_dir)."""
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
        return value

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
