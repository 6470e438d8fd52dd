"""Stage results as Prefect keeps them: JSON of ppoflow's own result types, checked before reuse.

Prefect stores each finished stage's return value in <run>/.prefect-results/<cache key> and reads
it back, with the serializer the *file* names, when the same stage is asked for again. A run
directory is data, not code: a planted file naming Prefect's pickle serializer would run code on
the next `ppoflow train`. So stage results are written as JSON that can only rebuild ppoflow's
result dataclasses (`ResultSerializer`), and `run_stage` reads a stored result itself before
Prefect does: anything that is not such a record is removed and the stage runs again (a cache miss).

A result that is ours is reused only while everything it points at is intact: its parquet files
(digests) and the model files of the states it returns (`model_files.state_files_intact`).

Discarding is said (a warning of this module's logger, which `ppoflow train` prints): the first
stored result found unreadable has every other one of the folder removed with it, so a folder of
planted files is one line at the stage that found them, not a line per stage and step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
import re
import shutil
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefect.client.schemas.objects import State
from prefect.results import ResultRecord
from prefect.serializers import Serializer
from prefect.utilities.annotations import opaque, quote
from prefect.utilities.engine import link_state_to_task_run_result
from pydantic import Field

from ppoflow.engine.lora import LoraSpec
from ppoflow.engine.optim import OptimSettings
from ppoflow.engine.policy_losses import POLICY_LOSSES, PolicyLossSpec
from ppoflow.engine.rollout_correction import (
    ImportanceSampling,
    RejectionCriterion,
    RolloutCorrectionSettings,
)
from ppoflow.engine.update import ActorUpdateSettings, CriticUpdateSettings
from ppoflow.tasks.pipeline.cache_keys import key_for
from ppoflow.tasks.pipeline.model_files import state_files_intact
from ppoflow.tasks.pipeline.states import ModelState, StageResult, StepResults, UpdateInputs
from ppoflow.tasks.storage.checkpoints import sync_checkpoint_later
from ppoflow.tasks.storage.durability import sync_later
from ppoflow.tasks.storage.tables import RESULTS_DIR, ArtifactRef, artifact_is_valid

if TYPE_CHECKING:
    from ppoflow.tasks.pipeline.run import Run, RunFiles

logger = logging.getLogger(__name__)

SERIALIZER_TYPE = "ppoflow-json"
MAX_RECORD_BYTES = 16 << 20
"""Stage results are references and numbers (kilobytes); a larger record is not one of ours."""

LOSS_SETTINGS_TYPES = tuple(dict.fromkeys(entry.settings for entry in POLICY_LOSSES.values()))
"""Every policy loss's settings type (PolicyLossSpec.settings is one of them)."""
SETTINGS_TYPES = (
    ActorUpdateSettings,
    CriticUpdateSettings,
    OptimSettings,
    PolicyLossSpec,
    *LOSS_SETTINGS_TYPES,
    RolloutCorrectionSettings,
    ImportanceSampling,
    RejectionCriterion,
)
"""The engine settings an update records (UpdateInputs), so that it can be replayed."""
RESULT_TYPES: dict[str, type] = {
    cls.__name__: cls
    for cls in (StageResult, ArtifactRef, ModelState, UpdateInputs, LoraSpec, *SETTINGS_TYPES)
}
"""The only classes a stored result can rebuild."""


def _outputs(value: Any) -> tuple[Any, ...]:
    """The stage outputs a result holds: model states, stage results and their tables."""
    if isinstance(value, tuple):
        return tuple(output for item in value for output in _outputs(item))
    if isinstance(value, StageResult):
        return (value, *value.refs)
    if isinstance(value, (ArtifactRef, ModelState)):
        return (value,)
    return ()


class _Outputs(list):
    """The outputs to link to a task run. Prefect links a value and its items (not theirs), by
    identity, checked through a weak reference where the type allows one: a plain list or tuple
    would stay linked by its id alone, which a later object may reuse."""


def _for_prefect(value: Any) -> Any:
    """A parameter as Prefect gets it: an earlier stage's output `opaque` (Prefect links it to the
    task run that returned it, and looks no further into it), a step's results as they are (each
    linked likewise), anything else quoted (Prefect need not search plain values for futures)."""
    if isinstance(value, (ArtifactRef, ModelState, StageResult)):
        return opaque(value)
    if isinstance(value, StepResults):
        return value
    return quote(value)


class UnreadableResult(ValueError):
    """A stored result that is not a ppoflow JSON record of known types."""


class ResultSerializer(Serializer):
    """JSON for stage results: dataclasses of RESULT_TYPES, tuples, dicts with string keys, lists and
    scalars (floats may be NaN or ±inf). Decoding builds nothing else and imports nothing."""

    type: str = Field(default=SERIALIZER_TYPE, frozen=True)

    def dumps(self, obj: Any) -> bytes:
        return json.dumps(_encode(obj), sort_keys=True, separators=(",", ":")).encode()

    def loads(self, blob: bytes) -> Any:
        try:
            return _decode(json.loads(blob))
        except (ValueError, TypeError, KeyError, RecursionError) as error:
            raise UnreadableResult(f"not a ppoflow stage result: {error}") from error


def _encode(obj: Any) -> Any:
    if obj is None or isinstance(obj, bool | int | str):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {"float": repr(obj)}
    if isinstance(obj, tuple):
        return {"tuple": [_encode(v) for v in obj]}
    if isinstance(obj, list):
        return [_encode(v) for v in obj]
    if isinstance(obj, dict):
        if not all(isinstance(k, str) for k in obj):
            raise TypeError(f"result dict keys must be strings: {list(obj)[:5]}")
        return {"dict": {k: _encode(v) for k, v in obj.items()}}
    name = type(obj).__name__
    if RESULT_TYPES.get(name) is type(obj):
        fields = {f.name: _encode(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        return {"type": name, "fields": fields}
    if isinstance(obj, BaseException):  # a failed stage's exception: its type and message, to read
        return {"error": f"{type(obj).__name__}: {obj}"}
    raise TypeError(f"{name} cannot be stored as a stage result")


def _decode(data: Any) -> Any:
    if data is None or isinstance(data, bool | int | float | str):
        return data
    if isinstance(data, list):
        return [_decode(v) for v in data]
    if not isinstance(data, dict) or len(data) not in (1, 2):
        raise ValueError(f"unexpected value {str(data)[:80]!r}")
    match sorted(data):
        case ["float"] if data["float"] in ("nan", "inf", "-inf"):
            return float(data["float"])
        case ["tuple"] if isinstance(data["tuple"], list):
            return tuple(_decode(v) for v in data["tuple"])
        case ["dict"] if isinstance(data["dict"], dict):
            return {str(k): _decode(v) for k, v in data["dict"].items()}
        case ["fields", "type"] if data["type"] in RESULT_TYPES and isinstance(data["fields"], dict):
            cls = RESULT_TYPES[data["type"]]
            fields = {k: _decode(v) for k, v in data["fields"].items()}
            _check_fields(cls, fields)
            return cls(**fields)
        case ["error"] if isinstance(data["error"], str):
            return RuntimeError(data["error"])
    raise ValueError(f"unexpected value {str(data)[:80]!r}")


_NUMBER = (int, float)
_COUNT_LIMIT = 2**31
FIELD_TYPES: dict[type, dict[str, tuple[type, ...]]] = {
    ArtifactRef: {"path": (str,), "digest": (str,), "rows": (int,)},
    StageResult: {
        "stage": (str,),
        "refs": (tuple,),
        "cache_key": (str,),
        "seconds": _NUMBER,
        "values": (tuple,),
    },
    ModelState: {
        "role": (str,),
        "lineage": (str,),
        "step": (int,),
        "checkpoint": (str, type(None)),
        "checkpoint_digest": (str, type(None)),
        "origin": (UpdateInputs, type(None)),
        "optimizer_digest": (str, type(None)),
        "base": (ModelState, type(None)),
    },
    UpdateInputs: {
        "parent": (ModelState,),
        "step": (int,),
        "rollouts": (ArtifactRef,),
        "advantages": (ArtifactRef,),
        "settings": (ActorUpdateSettings, CriticUpdateSettings),
        "optim": (OptimSettings,),
        "lora": (LoraSpec, type(None)),
    },
    LoraSpec: {
        "rank": (int,),
        "alpha": (int,),
        "target_modules": (str, tuple),
        "exclude_modules": (str, tuple, type(None)),
        "seed": (int,),
    },
}
"""The type of every field a stored result may set: a record that decodes to anything else is
unreadable (recomputed), not a failure later in the stage that uses it."""


def _settings_field_types(cls: type) -> dict[str, tuple[type, ...]]:
    """Field types of an engine settings dataclass, from its annotations: a number (or an int), a
    bool, one of a Literal's values (stored as a string), another settings type, a tuple of numbers
    or of settings records, each maybe None; PolicyLossSpec.settings is a policy loss's settings."""
    types = {}
    for name, hint in typing.get_type_hints(cls).items():
        args = typing.get_args(hint)
        optional = (
            (type(None),) if type(None) in args and typing.get_origin(hint) is not typing.Literal else ()
        )
        inner = next((a for a in args if a is not type(None)), hint) if optional else hint
        if hint is typing.Any and cls is PolicyLossSpec:
            types[name] = LOSS_SETTINGS_TYPES
        elif typing.get_origin(inner) is typing.Literal:
            types[name] = (str, *optional)
        elif inner is bool:
            types[name] = (bool, *optional)
        elif inner in (int, float):
            types[name] = (*(_NUMBER if inner is float else (int,)), *optional)
        elif typing.get_origin(inner) is tuple:
            types[name] = (tuple, *optional)
        elif inner in SETTINGS_TYPES:
            types[name] = (inner, *optional)
        else:
            raise TypeError(f"{cls.__name__}.{name}: no stored form for {hint}")
    return types


def _tuple_elements(cls: type, name: str) -> tuple[type, ...] | None:
    """The settings type a tuple field holds (RolloutCorrectionSettings.rejection), or None for a
    tuple of numbers."""
    hint = typing.get_type_hints(cls)[name]
    hint = next((a for a in typing.get_args(hint) if typing.get_origin(a) is tuple), hint)
    element = (typing.get_args(hint) or (None,))[0]
    return (element,) if element in SETTINGS_TYPES else None


FIELD_TYPES |= {cls: _settings_field_types(cls) for cls in SETTINGS_TYPES}
ALLOWED_VALUES: dict[tuple[type, str], tuple] = {
    (cls, name): typing.get_args(literal) + ((None,) if literal is not hint else ())
    for cls in SETTINGS_TYPES
    for name, hint in typing.get_type_hints(cls).items()
    for literal in [
        next((a for a in (hint, *typing.get_args(hint)) if typing.get_origin(a) is typing.Literal), None)
    ]
    if literal is not None
}
"""(class, field) → the values a Literal-typed field may take."""


def _check_fields(cls: type, fields: dict[str, Any]) -> None:
    expected = FIELD_TYPES[cls]
    for name, value in fields.items():
        if name not in expected:
            raise ValueError(f"{cls.__name__} has no field {name!r}")
        _check_value(cls, name, value, expected[name])
    if cls is StageResult:
        if not all(isinstance(ref, ArtifactRef) for ref in fields.get("refs", ())):
            raise ValueError("StageResult.refs holds something other than ArtifactRefs")
        for pair in fields.get("values", ()):
            if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)):
                raise ValueError("StageResult.values holds something other than (name, number) pairs")
            if isinstance(pair[1], bool) or not isinstance(pair[1], _NUMBER):
                raise ValueError(f"StageResult value {pair[0]!r} is not a number")


COUNTS = (
    "rows",
    "step",
    "rank",
    "total_steps",
    "warmup_steps",
    "ppo_epochs",
    "mini_batch_size",
    "micro_batch_size",
    "max_token_len",
)
"""Fields that count something: non-negative and below 2³¹."""


def _check_value(cls: type, name: str, value: Any, expected: tuple[type, ...]) -> None:
    where = f"{cls.__name__}.{name}"
    if (isinstance(value, bool) and bool not in expected) or not isinstance(value, expected):
        raise ValueError(f"{where} is a {type(value).__name__}")
    if (cls, name) in ALLOWED_VALUES and value not in ALLOWED_VALUES[(cls, name)]:
        raise ValueError(f"{where}={value!r} is not one of {ALLOWED_VALUES[(cls, name)]}")
    if isinstance(value, tuple) and cls in SETTINGS_TYPES:
        elements = _tuple_elements(cls, name)
        if elements is not None and not all(isinstance(v, elements) for v in value):
            raise ValueError(f"{where} holds something other than {elements[0].__name__} records")
        if elements is None and not all(_is_number(v) for v in value):
            raise ValueError(f"{where} holds something other than numbers")
    if isinstance(value, tuple) and cls is LoraSpec and not all(isinstance(v, str) for v in value):
        raise ValueError(f"{where} holds something other than module names")
    if isinstance(value, int) and name in COUNTS and not 0 <= value < _COUNT_LIMIT:
        raise ValueError(f"{where}={value} is out of range")


def _is_number(value: Any) -> bool:
    return isinstance(value, _NUMBER) and not isinstance(value, bool)


def read_stored_result(path: Path) -> Any:
    """The result stored at `path` if it is a record ResultSerializer wrote; UnreadableResult (saying
    why, not naming the file) otherwise: it never deserializes with anything else, as the serializer
    a file names is not trusted."""
    try:
        if path.stat().st_size > MAX_RECORD_BYTES:
            raise UnreadableResult("larger than any stage result")
        record = json.loads(path.read_bytes())
    except OSError as error:
        raise UnreadableResult(f"cannot be read ({error.strerror or error})") from error
    except ValueError as error:
        raise UnreadableResult(f"not a JSON record ({error})") from error
    metadata = record.get("metadata") if isinstance(record, dict) else None
    serializer = metadata.get("serializer") if isinstance(metadata, dict) else None
    if serializer != {"type": SERIALIZER_TYPE} or not isinstance(record.get("result"), str):
        kind = serializer.get("type") if isinstance(serializer, dict) else serializer
        raise UnreadableResult(f"not written by ppoflow (its serializer: {kind!r})")
    return ResultSerializer().loads(record["result"].encode())


def outputs_valid(run: RunFiles, result: Any) -> bool:
    """Every table a (possibly cached) result points at still exists with its digest, and every
    model state it returns still has intact files (see state_files_intact)."""
    items = result if isinstance(result, tuple) else (result,)
    for item in items:
        if isinstance(item, StageResult) and not all(artifact_is_valid(run.path, r) for r in item.refs):
            return False
        if isinstance(item, ModelState) and not state_files_intact(run, item):
            return False
    return True


_STORED_NAME = re.compile(r"^[A-Za-z0-9_]+-[0-9a-f]{40}$")
"""The name Prefect stores a stage's result under: its cache key (cache_keys.key_for)."""
SHOWN_DISCARDS = 3


def discard_unreadable_result(run: RunFiles, task, parameters: dict[str, Any]) -> None:
    """Remove the stored result of this call unless ppoflow wrote it and can read it back; with it,
    every other stored result of the run that ppoflow cannot read (files planted in the folder are
    found at once, not stage by stage), and warn once, naming them and why."""
    folder = run.path / RESULTS_DIR
    path = folder / key_for(task, {"run": run, **parameters})
    if (why := _why_unreadable(path)) is None:
        return
    discarded, names = {path.name: why}, []
    with contextlib.suppress(OSError):  # a results folder that is not one is refused when the run opens
        names = sorted(entry.name for entry in os.scandir(folder) if _STORED_NAME.match(entry.name))
    for name in (name for name in names if name != path.name):
        if (other := _why_unreadable(folder / name)) is not None:
            discarded[name] = other
    for name in discarded:
        _remove(folder / name)
    logger.warning(discarded_line(folder, discarded))


def _why_unreadable(path: Path) -> str | None:
    """Why the stored result at `path` cannot be used; None when there is none, or ppoflow reads it."""
    if not os.path.lexists(path):
        return None
    if path.is_symlink():
        return "a link, never a stored result"
    if not path.is_file():  # a folder, a FIFO (reading it would block)
        return "a folder" if path.is_dir() else "not a regular file"
    try:
        read_stored_result(path)
    except UnreadableResult as error:
        return str(error)
    return None


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def discarded_line(folder: Path, discarded: dict[str, str]) -> str:
    """One line naming the stored results removed (the first few) and why."""
    shown = "; ".join(f"{name}: {why}" for name, why in list(discarded.items())[:SHOWN_DISCARDS])
    more = f"; and {len(discarded) - SHOWN_DISCARDS} more" if len(discarded) > SHOWN_DISCARDS else ""
    count = "1 stored stage result" if len(discarded) == 1 else f"{len(discarded)} stored stage results"
    return (
        f"removed {count} from {folder} that ppoflow did not write or cannot read ({shown}{more}): "
        "their stages are computed again"
    )


@functools.lru_cache(maxsize=256)
def _with_storage(task, storage: Path, refresh_cache: bool | None):
    """`task` storing its results in `storage` (made once per task and run: a copy of a task costs
    milliseconds, a tenth of a short stage's orchestration)."""
    return task.with_options(
        result_storage=storage,
        result_serializer=ResultSerializer(),
        persist_result=True,
        refresh_cache=refresh_cache,
    )


def run_stage(task, run: Run, **parameters: Any):
    """Call a stage task with the run's result storage. A stored result that ppoflow cannot read
    safely, or whose files are gone or altered, is a miss: the task runs again. Returns
    (result, was_cached).

    Prefect's run graph links a task run to the runs whose results it takes, by object identity:
    each result's tables and model states are linked to the run that returned them (a table taken
    from a result is a new edge), and passed on `opaque`. Every other parameter goes to Prefect
    quoted: unquoted, Prefect searches every nested dataclass of it (the run, the settings) for
    futures and results, ~10 ms an iteration. The task receives and keys its cache on the same
    values either way."""
    discard_unreadable_result(run, task, parameters)
    bound = _with_storage(task, run.path / RESULTS_DIR, run.recompute or None)
    passed = {"run": quote(run)} | {name: _for_prefect(value) for name, value in parameters.items()}
    state = bound(**passed, return_state=True)
    result = _state_value(state)
    if state.name == "Cached" and not outputs_valid(run, result):
        stored = key_for(task, {"run": run, **parameters})
        logger.info("stored result %s names files that are gone or changed: computed again", stored)
        state = bound.with_options(refresh_cache=True)(**passed, return_state=True)
        result = _state_value(state)
    if state.name == "Cached":
        sync_outputs_later(run, result)
    link_state_to_task_run_result(state, _Outputs(_outputs(result)))
    return result, state.name == "Cached"


def sync_outputs_later(run: RunFiles, result: Any) -> None:
    """Queue the fsync of a cached result's tables and checkpoints (durability.py): the process that
    wrote them may have been killed before they reached the disk, and the step's commit is about to
    name them."""
    for output in _outputs(result):
        if isinstance(output, ArtifactRef):
            path = run.path / output.path
            sync_later([path, path.parent])
        elif (
            isinstance(output, ModelState) and output.checkpoint and not Path(output.checkpoint).is_absolute()
        ):
            sync_checkpoint_later(run.path / output.checkpoint)


def _state_value(state: State) -> Any:
    """The return value of a finished task run: read from the state when Prefect holds it there
    (a completed or cached run), else through `State.result` (which raises a failure's error)."""
    if state.is_completed() and isinstance(state.data, ResultRecord):
        return state.data.result
    return state.result()
