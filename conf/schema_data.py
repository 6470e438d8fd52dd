"""The `data` section: which prompts to train and validate on and how they are batched."""

from pydantic import Field, field_validator

from ppoflow.engine.names import Truncation

from .schema_common import Section, Seed


class DataConfig(Section):
    """Datasets, prompt lengths and the iteration batch (verl's `data`)."""

    tokenizer: str | None = None
    """Tokenizer used to measure prompts; None uses the actor's."""
    train_files: str | list[str] = "builtin:addition"
    """JSON/JSONL/parquet file(s) of training prompts, or 'builtin:addition' (single-digit sums)."""
    val_files: str | list[str] = "builtin:addition"
    """JSON/JSONL/parquet file(s) of validation prompts, or 'builtin:addition'."""
    prompt_key: str = "prompt"
    """Column holding the prompt (a chat message list or a string)."""
    reward_fn_key: str = "data_source"
    """Column that selects the reward function and groups validation scores."""
    max_prompt_length: int = Field(512, gt=0)
    """Longest prompt in tokens (verl's default is 512; 16 fits the built-in task)."""
    max_response_length: int = Field(512, gt=0)
    """Longest response in tokens (verl's default is 512; 4 fits the built-in task)."""
    train_batch_size: int = Field(1024, gt=0)
    """Prompts per iteration; each is sampled actor_rollout_ref.rollout.n times."""
    gen_batch_size: int | None = Field(None, gt=0)
    """With algorithm.filter_groups.enable: prompts in each generation batch (verl's dataloader
    batch; the first is the step's own prompts, cut or topped up to it); None: train_batch_size."""
    val_batch_size: int | None = Field(None, gt=0)
    """Prompts per validation batch; None validates the whole set at once."""
    return_raw_chat: bool = False
    """Keep the unformatted chat messages beside the token ids."""
    shuffle: bool = True
    """Shuffle the training prompts each epoch."""
    seed: Seed = 1
    """Seed of the training-prompt shuffle."""
    filter_overlong_prompts: bool = False
    """Drop prompts longer than max_prompt_length at ingest (they go to the rejects table)."""
    truncation: Truncation = "error"
    """What to do with a prompt longer than max_prompt_length that was not filtered."""

    @field_validator("train_files", "val_files")
    @classmethod
    def _names_files(cls, value: str | list[str]) -> str | list[str]:
        """At least one file, each named: `[]` would read no prompts (and fail, or skip validation,
        only once the models are up)."""
        if not (value if isinstance(value, list) else [value]):
            raise ValueError("at least one file (an empty list reads no prompts)")
        if any(not name.strip() for name in (value if isinstance(value, list) else [value])):
            raise ValueError("file names, not an empty one")
        return value

    dataloader_num_workers: int = Field(0, ge=0)
    """Worker processes reading prompts; 0 reads in the main process."""
    train_max_samples: int = -1
    """Use only the first N training prompts that pass ingest (-1: all), as verl's key."""
    val_max_samples: int = -1
    """Use only the first N validation prompts that pass ingest (-1: all), as verl's key."""
    max_reject_fraction: float = Field(0.1, ge=0, le=1)
    """Ingest fails when more than this fraction of rows is rejected (malformed or overlong)."""
