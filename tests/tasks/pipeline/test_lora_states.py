"""LoRA states: stored results keep a state's base and an update's adapters (to replay it), and the
host gives a LoRA actor's reference as its own base with the adapters off, never a second copy."""

from __future__ import annotations

import pytest

from ppoflow.conf import load_config
from ppoflow.engine.lora import AdaptersOff, LoraSpec, add_adapters
from ppoflow.engine.models import load_actor
from ppoflow.tasks.models.host import ModelHost
from ppoflow.tasks.pipeline.plan import run_settings
from ppoflow.tasks.pipeline.results import ResultSerializer, UnreadableResult
from ppoflow.tasks.pipeline.run import RunFiles
from ppoflow.tasks.pipeline.states import ModelState, UpdateInputs
from ppoflow.tasks.storage.tables import ArtifactRef

SPEC = LoraSpec(8, 16, ("q_proj", "v_proj"), "lm_head", seed=1)


def _lora_state(base: ModelState) -> ModelState:
    settings = run_settings(load_config(), total_steps=2)
    ref = ArtifactRef("iter=000001/rollouts/part-00000.parquet", "sha256:" + "a" * 64, 32)
    inputs = UpdateInputs(base, 1, ref, ref, settings.actor.update, settings.actor.optim, SPEC)
    return ModelState("actor", "lineage-1", 1, None, origin=inputs, base=base)


def test_a_lora_state_round_trips_with_its_base_and_its_adapters():
    base = ModelState("actor", "lineage-0", 0, "model/base")
    state = _lora_state(base)
    back = ResultSerializer().loads(ResultSerializer().dumps(state))
    assert back == state and back.base == base and back.origin.lora == SPEC


def test_a_stored_lora_spec_naming_something_other_than_modules_is_unreadable():
    blob = ResultSerializer().dumps(_lora_state(ModelState("actor", "lineage-0", 0, "model/base")))
    forged = blob.replace(b'{"tuple":["q_proj","v_proj"]}', b'{"tuple":["q_proj",7]}')
    assert forged != blob
    with pytest.raises(UnreadableResult, match="LoraSpec.target_modules holds something other than"):
        ResultSerializer().loads(forged)


def test_the_reference_of_a_lora_actor_is_its_base_with_the_adapters_off(tiny_model_dir, tmp_path):
    run, host = RunFiles(str(tmp_path)), ModelHost()
    base = ModelState("actor", "lineage-0", 0, str(tiny_model_dir))
    plain = load_actor(tiny_model_dir)
    assert host.reference_for(run, base, plain, base) is plain  # step 1: the actor is the reference
    adapted = add_adapters(load_actor(tiny_model_dir), SPEC)
    reference = host.reference_for(run, _lora_state(base), adapted, base)
    assert isinstance(reference, AdaptersOff) and reference.module is adapted  # the same weights
    whole = ModelState("actor", "lineage-1", 1, None)  # an update of every weight
    copy = host.reference_for(run, whole, plain, base)
    assert copy is not plain and not copy.training  # the frozen copy, loaded once
    assert host.reference_for(run, whole, plain, base) is copy
