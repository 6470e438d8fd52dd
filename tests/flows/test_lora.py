"""LoRA end to end under Prefect: the actor and critic train adapters only, checkpoints hold the adapters
(peft loads them as the trained policy), the reference is the base with its adapters off, an
interrupted run resumes by replay to the same bits, and `ppoflow export` writes the merged model and
the adapters (`ppoflow show` and the evaluate flow read LoRA checkpoints too)."""

from __future__ import annotations

import json
import os
import shutil

import pyarrow.parquet as pq
import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from ppoflow.cli import main
from ppoflow.engine.forward import compute_log_probs
from ppoflow.engine.lora import LoraSpec
from ppoflow.engine.models import load_actor, load_tokenizer
from ppoflow.tasks.pipeline.states import ModelState, TrainState
from ppoflow.tasks.pipeline.trainer_state import ResumeRefused, resume_state
from ppoflow.tasks.retraining.evaluation import plan_evaluation
from ppoflow.tasks.stages.prepare_model import critic_state
from ppoflow.tasks.storage.checkpoints import directory_digest
from ppoflow.tasks.storage.tensors import sequence_batch, token_tensor

from .conftest import train
from .test_resume import metrics_without_wall_clock

LORA = [
    "actor_rollout_ref.model.lora_rank=8",
    "actor_rollout_ref.model.lora_alpha=16",
    "critic.model.lora_rank=4",
    "algorithm.use_kl_in_reward=true",  # a reference policy: the base, adapters off
    "trainer.total_training_steps=3",
    "trainer.save_freq=2",  # the states of step 1 are never saved: a resume replays them
    "trainer.num_threads=1",
]
ADAPTER_FILES = {"adapter_config.json", "adapter_model.safetensors", "ppoflow_adapter.json"}
TINY_ADAPTER_PARAMETERS = 3 * 8 * (2 * (128 + 128) + 2 * (128 + 64) + 3 * (128 + 256))
"""3 layers; rank 8 × (in + out) of q_proj and o_proj (128 → 128), k_proj and v_proj (128 → 64,
two KV heads), gate_proj, up_proj (128 → 256) and down_proj (256 → 128): 49,152."""


@pytest.fixture(scope="module")
def lora_run(prefect_server, tiny_model_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("lora-run")
    summary, _ = train(run_dir, *LORA)
    return run_dir, summary


def _rollouts_of_step_3(run_dir):
    """Step 3's responses as a batch, with the old (actor state 2) and reference log-probs recorded."""
    table = pq.read_table(run_dir / "iter=000003/rollouts/part-00000.parquet")
    batch = sequence_batch(table, load_tokenizer(run_dir / "model/base").pad_token_id)
    width = batch.response_ids.shape[1]
    return batch, token_tensor(table, "old_log_probs", width), token_tensor(table, "ref_log_probs", width)


def _log_probs(model, batch):
    return compute_log_probs(model, batch, temperature=1.0, batching=len(batch))


def test_checkpoints_hold_the_adapters_only_and_peft_loads_them_as_the_trained_policy(lora_run):
    run_dir, summary = lora_run
    actor = run_dir / "checkpoints/iter=000002/actor"
    assert summary["actor_checkpoint"] == str(run_dir / "checkpoints/iter=000003/actor")
    assert sorted(p.name for p in actor.iterdir()) == sorted(ADAPTER_FILES)
    adapters = load_file(actor / "adapter_model.safetensors")
    assert all(".lora_A." in name or ".lora_B." in name for name in adapters)  # no base weight
    assert sum(t.numel() for t in adapters.values()) == TINY_ADAPTER_PARAMETERS
    base_bytes = (run_dir / "model/base/model.safetensors").stat().st_size
    assert (actor / "adapter_model.safetensors").stat().st_size < 0.15 * base_bytes
    record = json.loads((actor / "ppoflow_adapter.json").read_text())
    assert record["base"] == {
        "role": "actor",
        "lineage": directory_digest(run_dir / "model/base"),
        "checkpoint": "model/base",
    }
    assert record["lora"]["rank"] == 8 and record["lora"]["alpha"] == 16
    batch, old, ref = _rollouts_of_step_3(run_dir)
    trained = PeftModel.from_pretrained(load_actor(run_dir / "model/base"), str(actor))
    mask = batch.response_mask.bool()
    assert torch.allclose(_log_probs(trained, batch)[mask], old[mask], atol=1e-5, rtol=0)
    direct = AutoModelForCausalLM.from_pretrained(actor)  # transformers finds the base and peft
    assert torch.allclose(_log_probs(direct, batch)[mask], old[mask], atol=1e-5, rtol=0)
    assert (old - ref)[mask].abs().max() > 1e-3  # the adapters moved the policy away from the base
    critic = load_file(run_dir / "checkpoints/iter=000002/critic/adapter_model.safetensors")
    head = [name for name in critic if ".lora_" not in name]
    assert sorted(head) == ["base_model.model.score.bias", "base_model.model.score.weight"]  # whole
    assert torch.count_nonzero(critic["base_model.model.score.weight"]) > 0  # left its zero init


def test_the_reference_is_the_base_model_with_the_adapters_off(lora_run):
    run_dir, _ = lora_run
    batch, _, ref = _rollouts_of_step_3(run_dir)
    base = _log_probs(load_actor(run_dir / "model/base"), batch)
    mask = batch.response_mask.bool()
    # peft's wrapped linear layers run the base's matmuls on the batch another way: equal bit for bit
    # one row at a time, within float32 rounding (~2e-6 here) on the whole batch
    assert torch.allclose(base[mask], ref[mask], atol=1e-5, rtol=0)


def test_an_interrupted_lora_run_resumes_by_replay_to_the_same_bits(lora_run, tmp_path, monkeypatch):
    run_dir, _ = lora_run
    monkeypatch.setenv("PPOFLOW_FAULT", "actor_update@2:raise")
    with pytest.raises(Exception, match="injected failure in actor_update at step 2"):
        train(tmp_path, *LORA)
    assert not (tmp_path / "checkpoints/iter=000001").exists()  # actor state 1 only in that process
    monkeypatch.delenv("PPOFLOW_FAULT")
    train(tmp_path, *LORA)  # replays step 1's update from the base, then trains steps 2 and 3
    for role in ("actor", "critic"):
        ours = load_file(tmp_path / f"checkpoints/iter=000003/{role}/adapter_model.safetensors")
        theirs = load_file(run_dir / f"checkpoints/iter=000003/{role}/adapter_model.safetensors")
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[name], theirs[name]) for name in ours), role
    assert metrics_without_wall_clock(tmp_path) == metrics_without_wall_clock(run_dir)


def test_a_truncated_adapter_checkpoint_is_rebuilt_by_replay_bit_for_bit(lora_run, tmp_path):
    run_dir, _ = lora_run
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    adapters = copy / "checkpoints/iter=000002/actor/adapter_model.safetensors"
    original = adapters.read_bytes()
    adapters.write_bytes(original[:1000])
    (copy / "iter=000003/rollouts/part-00000.parquet").unlink()  # step 3's rollout needs actor state 2
    train(copy, *LORA)  # state 2 from the base: step 1's update replayed (never saved), then step 2's
    assert adapters.read_bytes() == original
    rollouts = "iter=000003/rollouts/part-00000.parquet"
    assert (copy / rollouts).read_bytes() == (run_dir / rollouts).read_bytes()


def test_export_writes_the_merged_model_and_the_adapters(lora_run, tmp_path, capsys):
    run_dir, _ = lora_run
    assert main(["export", str(run_dir), str(tmp_path / "out")]) == 0
    model_dir, adapter_dir = tmp_path / "out/model", tmp_path / "out/adapter"
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= {p.name for p in model_dir.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json"} == {
        p.name for p in adapter_dir.iterdir() if p.name != "tokenizer_config.json"
    }
    umask = os.umask(0o077)
    os.umask(umask)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in [*model_dir.iterdir(), *adapter_dir.iterdir()]}
    assert modes == dict.fromkeys(modes, oct(0o666 & ~umask))  # weights too, not 0600
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(run_dir / "model/base")
    batch, _, _ = _rollouts_of_step_3(run_dir)
    merged = _log_probs(load_actor(model_dir), batch)  # plain transformers, no peft
    adapted = PeftModel.from_pretrained(load_actor(config["base_model_name_or_path"]), str(adapter_dir))
    final = _log_probs(adapted, batch)
    mask = batch.response_mask.bool()
    # W + 2·B·A summed once into the weights rounds differently from adding 2·B·(A·x) per forward
    assert torch.allclose(merged[mask], final[mask], atol=1e-5, rtol=0)
    base = _log_probs(load_actor(run_dir / "model/base"), batch)
    assert (merged - base)[mask].abs().max() > 1e-3
    assert main(["export", str(run_dir), str(tmp_path / "out")]) == 2  # never over an earlier export
    assert "exists: remove it" in capsys.readouterr().err


def test_show_decodes_the_tokens_and_evaluate_takes_the_checkpoint_folder_of_a_lora_run(
    lora_run, tmp_path, capsys
):
    run_dir, _ = lora_run
    assert main(["show", str(run_dir), "--random", "1"]) == 0
    assert "<eos>" in capsys.readouterr().out  # decoded with the base model's tokenizer
    plan = plan_evaluation(str(run_dir / "checkpoints/iter=000003/actor"), tmp_path, None, [])
    assert plan.checkpoint == run_dir / "checkpoints/iter=000003"
    assert f"trainer.resume_from_path={plan.checkpoint}" in plan.overrides


def test_an_altered_adapter_checkpoint_is_not_exported(lora_run, tmp_path, capsys):
    run_dir, _ = lora_run
    copy = tmp_path / "run"
    shutil.copytree(run_dir / "model", copy / "model")
    shutil.copytree(run_dir / "checkpoints/iter=000003", copy / "checkpoints/iter=000003")
    weights = copy / "checkpoints/iter=000003/actor/adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8] + bytes(8))
    assert main(["export", str(copy / "checkpoints/iter=000003"), str(tmp_path / "out")]) == 2
    assert "altered or truncated since its run saved it" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    # Without the record of its digest, the damage cannot be seen: refused unless asked for.
    (copy / "checkpoints/iter=000003/trainer_state.json").unlink()
    assert main(["export", str(copy / "checkpoints/iter=000003"), str(tmp_path / "out")]) == 2
    assert "trainer_state.json, which records the digest of" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    assert main(["export", "--unverified", str(copy / "checkpoints/iter=000003"), str(tmp_path / "out")]) == 0
    assert (tmp_path / "out/adapter/adapter_model.safetensors").is_file()


def test_resuming_an_adapter_checkpoint_needs_the_same_lora_settings(lora_run):
    run_dir, _ = lora_run
    base = ModelState("actor", directory_digest(run_dir / "model/base"), 0, "model/base")
    initial = TrainState(actor=base, critic=critic_state(base), reference=base, kl_coef=0.001)
    folder = run_dir / "checkpoints/iter=000002"
    actor_lora, critic_lora = LoraSpec(8, 16, "all-linear", None, 1), LoraSpec(4, 16, "all-linear", None, 1)
    step, state = resume_state(
        folder, initial, run_dir=run_dir, lora={"actor": actor_lora, "critic": critic_lora}
    )
    assert step == 3 and state.actor.base == base and state.critic.base == initial.critic
    with pytest.raises(ResumeRefused, match=r"holds LoRA adapters \(rank 8\).*lora_rank=8"):
        resume_state(folder, initial, run_dir=run_dir, lora={"critic": critic_lora})
    wider = LoraSpec(16, 16, "all-linear", None, 1)
    with pytest.raises(ResumeRefused, match=r"lora_rank=8, but actor_rollout_ref.model.lora_rank=16"):
        resume_state(folder, initial, run_dir=run_dir, lora={"actor": wider, "critic": critic_lora})
    other = ModelState("actor", "sha256:another-model", 0, "model/base")
    with pytest.raises(ResumeRefused, match="trained on another base model"):
        resume_state(
            folder,
            TrainState(other, initial.critic, other, 0.001),
            run_dir=run_dir,
            lora={"actor": actor_lora, "critic": critic_lora},
        )
