"""Building blocks shared by the config sections: the base model, the error type, shared choices and
the sub-sections that several sections embed (optimizer, FSDP, DeepSpeed, checkpoint contents)."""

import math
import types
from collections.abc import Iterable, Sequence
from itertools import repeat
from typing import Annotated, Any, ClassVar, Literal, Union, get_args, get_origin

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_core import InitErrorDetails, PydanticCustomError

from ppoflow.engine.names import KLPenalty, WarmupStyle


class ConfigError(ValueError):
    """A configuration that cannot run. The message names the key, the layer that set it, the bad
    value and what is expected; `keys` lists the dotted keys involved (for provenance)."""

    def __init__(self, message: str, *, keys: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.keys = tuple(keys)


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, field docstrings are the docs."""

    # Numbers are accepted for strings because `trainer.experiment_name=2024` parses as an int.
    # nan and ±inf (YAML's .nan, .inf, 1e999) are refused in every float: each one loads fine and
    # then trains silently wrong (NaN weights, NaN scores).
    model_config = ConfigDict(
        extra="forbid", use_attribute_docstrings=True, coerce_numbers_to_str=True, allow_inf_nan=False
    )

    key_aliases: ClassVar[dict[str, str]] = {}
    """Other accepted spellings of a key (e.g. a newer verl name) → the field they set."""

    @model_validator(mode="before")
    @classmethod
    def _rename_aliases(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not cls.key_aliases:
            return data
        data = dict(data)
        for alias, name in cls.key_aliases.items():
            if alias not in data:
                continue
            value = data.pop(alias)
            if name in data and data[name] != value:
                raise ValueError(f"'{alias}' and '{name}' are the same setting; set only one of them")
            data[name] = value
        return data

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic's lax mode reads True as 1 and 1.0, so `optim.lr=true` trained at a learning rate
        # of 1.0; YAML also reads yes/no/on/off as booleans.
        if info.field_name is None:
            return value
        found = misplaced_boolean(cls.model_fields[info.field_name].annotation, value)
        if found is None:
            return value
        loc, wanted = found
        raise error_at(loc, found_value(value, loc), f"Input should be {wanted}, not a boolean")


def section_type(field: FieldInfo) -> type[Section] | None:
    """The sub-section class a field holds, or None for a value (leaf) field."""
    annotation = field.annotation
    if isinstance(annotation, type) and issubclass(annotation, Section):
        return annotation
    return None


def error_at(loc: tuple[int | str, ...], value: Any, message: str) -> ValidationError:
    """An error at `loc` below the field or section being validated: pydantic prefixes the enclosing
    keys, so the loader names the exact key (betas[0], weights.correctness) with the bad value."""
    error = PydanticCustomError("value_error", message)
    return ValidationError.from_exception_data(
        "Section", [InitErrorDetails(type=error, loc=loc, input=value)]
    )


def found_value(value: Any, loc: tuple[int | str, ...]) -> Any:
    """The element at `loc` inside a value: the error shows it rather than the whole list."""
    for key in loc:
        value = value[key]
    return value


def misplaced_boolean(annotation: Any, value: Any) -> tuple[tuple[int | str, ...], str] | None:
    """Where a bool sits in `value` at a place `annotation` types as int or float (and what it wants
    there: 'an integer' or 'a number'), or None. Places that take a bool (bool, Any, Literal[True],
    free-form entries) keep it."""
    members = _members(annotation)
    if isinstance(value, bool):
        wanted = _number_wanted(members)
        return ((), wanted) if wanted and not _takes_boolean(members) else None
    for key, slot, item in _slots(members, value):
        found = misplaced_boolean(slot, item)
        if found is not None:
            return (key, *found[0]), found[1]
    return None


def _members(annotation: Any) -> list[Any]:
    """The alternatives of a (possibly Annotated, possibly optional) type."""
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    if get_origin(annotation) in (Union, types.UnionType):
        return [member for arg in get_args(annotation) for member in _members(arg)]
    return [annotation]


def _number_wanted(members: list[Any]) -> str | None:
    if float in members:
        return "a number"
    literals = [arg for m in members if get_origin(m) is Literal for arg in get_args(m)]
    if int in members or any(isinstance(arg, int) and not isinstance(arg, bool) for arg in literals):
        return "an integer"
    return None


def _takes_boolean(members: list[Any]) -> bool:
    literals = [arg for m in members if get_origin(m) is Literal for arg in get_args(m)]
    return bool in members or Any in members or any(isinstance(arg, bool) for arg in literals)


def _slots(members: list[Any], value: Any) -> Iterable[tuple[int | str, Any, Any]]:
    """(key, element type, element) of a list, tuple or dict value against a container type."""
    for member in members:
        origin, args = get_origin(member), get_args(member)
        if isinstance(value, list | tuple) and origin in (list, tuple) and args:
            variadic = origin is list or (len(args) == 2 and args[1] is Ellipsis)
            return zip(range(len(value)), repeat(args[0]) if variadic else args, value, strict=False)
        if isinstance(value, dict) and origin is dict and args:
            return ((key, args[1], item) for key, item in value.items())
    return ()


def is_open_mapping(field: FieldInfo) -> bool:
    """A dict-valued leaf whose entries are free-form (override_config, reward.weights, …)."""
    return get_origin(field.annotation) is dict


def first_non_finite(value: Any, place: str = "") -> str | None:
    """Where the first nan or ±inf inside a free-form value sits ('' for the value itself, '.key' or
    '[index]' below it), or None when there is none: typed floats are checked by pydantic, but the
    entries of a dict[str, Any] are not."""
    if isinstance(value, float):
        return None if math.isfinite(value) else place
    if isinstance(value, dict):
        items = ((f"{place}.{key}", item) for key, item in value.items())
    elif isinstance(value, list | tuple):
        items = ((f"{place}[{index}]", item) for index, item in enumerate(value))
    else:
        return None
    for sub, item in items:
        found = first_non_finite(item, sub)
        if found is not None:
            return found
    return None


def _finite_entries(value: dict[str, Any]) -> dict[str, Any]:
    place = first_non_finite(value)
    if place is not None:
        raise ValueError(f"finite numbers only, but the entry {place.removeprefix('.')} is not finite")
    return value


FreeForm = Annotated[dict[str, Any], AfterValidator(_finite_entries)]
"""A free-form mapping (override_config, wrap_policy) whose numbers must still be finite."""

Beta = Annotated[float, Field(ge=0, lt=1)]
"""An Adam moment coefficient: torch's AdamW refuses one outside [0, 1)."""

Seed = Annotated[int, Field(ge=0, lt=2**32)]
"""A random seed in numpy's and transformers' range; a larger one overflows torch's generator once
ppoflow derives per-step seeds from it (seed × 1,000,003 + step)."""

KLType = KLPenalty
CheckpointContent = Literal["model", "optimizer", "extra", "hf_model"]


class OptimConfig(Section):
    """AdamW with a warm-up and a constant or cosine schedule (verl's `optim`)."""

    key_aliases: ClassVar[dict[str, str]] = {"lr_scheduler_type": "warmup_style"}

    lr: float = Field(1e-6, gt=0)
    """Peak learning rate."""
    lr_warmup_steps: int = -1
    """Linear warm-up steps; 0 or negative means use lr_warmup_steps_ratio (as every verl engine)."""
    lr_warmup_steps_ratio: float = Field(0.0, ge=0, le=1)
    """Warm-up length as a fraction of total_training_steps (used when lr_warmup_steps ≤ 0)."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """Floor of the cosine schedule as a fraction of lr."""
    warmup_style: WarmupStyle = "constant"
    """Schedule after warm-up; verl's newer name lr_scheduler_type is accepted for it."""
    weight_decay: float = Field(0.01, ge=0)
    """AdamW decoupled weight decay."""
    betas: tuple[Beta, Beta] = (0.9, 0.999)
    """AdamW moment coefficients (β1, β2), each in [0, 1)."""
    total_training_steps: int = Field(-1, ge=-1)
    """Steps the LR schedule (cosine decay, warm-up ratio) spans; -1 (verl's value) follows the run's
    training steps. Set, it fixes the horizon: a longer run keeps every step's learning rate and runs
    its extra steps at the schedule's last value (verl always overwrites it with the run's length)."""

    @property
    def spans_steps(self) -> bool:
        """A cosine decay or a warm-up given as a ratio: a schedule whose shape depends on its horizon."""
        return self.warmup_style == "cosine" or (self.lr_warmup_steps <= 0 and self.lr_warmup_steps_ratio > 0)


class FsdpConfig(Section):
    """verl's FSDP settings, accepted for compatibility; the torch strategy ignores them."""

    param_offload: bool = False
    """Keep parameters on CPU between uses (fsdp/fsdp2 only)."""
    optimizer_offload: bool = False
    """Keep optimizer state on CPU between steps (fsdp/fsdp2 only)."""
    fsdp_size: int = -1
    """Ranks per FSDP shard group; -1 shards over all ranks (fsdp/fsdp2 only)."""
    wrap_policy: FreeForm = {}
    """Module wrapping policy, e.g. min_num_params (fsdp/fsdp2 only)."""


class DeepSpeedConfig(Section):
    """DeepSpeed ZeRO settings, used only by strategy=deepspeed."""

    zero_stage: Literal[0, 1, 2, 3] = 2
    """ZeRO stage: 1 shards optimizer state, 2 also gradients, 3 also parameters."""
    offload_optimizer: bool = False
    """Keep optimizer state and its step on CPU."""


class CheckpointConfig(Section):
    """What a checkpoint holds (verl's `checkpoint`)."""

    save_contents: list[CheckpointContent] = ["model", "optimizer", "extra"]
    """Parts written at each save: model weights, optimizer state, extra (RNG, scheduler), hf_model."""
    load_contents: list[CheckpointContent] | None = None
    """Parts read on resume; None means the same as save_contents."""

    @model_validator(mode="after")
    def _load_what_was_saved(self) -> "CheckpointConfig":
        if self.load_contents is None:
            self.load_contents = list(self.save_contents)
        return self
