"""Loading the config tree: defaults, layers, verl's command lines, derived keys, YAML round trip."""

import subprocess
import sys

import pytest
import yaml

from ppoflow.conf import (
    EMBEDDED_DEFAULT,
    ConfigError,
    PPOFlowConfig,
    all_keys,
    config_fingerprint,
    load_config,
)
from ppoflow.conf.schema_checks import get_key

from .micro import MICRO, MICRO_KEYS


def flatten(tree: dict, prefix: str = "") -> dict:
    """A nested YAML mapping as {dotted key: value}."""
    flat = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        flat.update(flatten(value, f"{dotted}.") if isinstance(value, dict) else {dotted: value})
    return flat


EMBEDDED = flatten(yaml.safe_load(EMBEDDED_DEFAULT.read_text()) or {})
"""What conf/embedded_default.yaml sets, by dotted key: tests read it rather than copy its numbers."""


def embedded_or_default(key: str):
    """The value load_config() gives a key that no other layer sets."""
    return EMBEDDED[key] if key in EMBEDDED else get_key(PPOFlowConfig(), key)


def quickstart(tmp_path, model_dir) -> list[str]:
    """verl's PPO quickstart command line, with paths pointed at temporary files (the vLLM engine it
    runs on is verl's default and not named)."""
    train, val = tmp_path / "train.parquet", tmp_path / "test.parquet"
    train.touch()
    val.touch()
    return f"""data.train_files={train} data.val_files={val} data.train_batch_size=256
        data.max_prompt_length=512 data.max_response_length=512
        actor_rollout_ref.model.path={model_dir} actor_rollout_ref.actor.optim.lr=1e-6
        actor_rollout_ref.actor.ppo_mini_batch_size=64 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4
        actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8
        actor_rollout_ref.rollout.tensor_model_parallel_size=1
        actor_rollout_ref.rollout.gpu_memory_utilization=0.4
        actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4 critic.optim.lr=1e-5
        critic.model.path={model_dir} critic.ppo_micro_batch_size_per_gpu=4 algorithm.kl_ctrl.kl_coef=0.001
        trainer.logger=console trainer.val_before_train=False trainer.n_gpus_per_node=1 trainer.nnodes=1
        trainer.save_freq=10 trainer.test_freq=10 trainer.total_epochs=15""".split()


def test_model_defaults_are_verls_and_need_the_micro_batch_sizes_verl_needs():
    with pytest.raises(ConfigError, match="ppo_micro_batch_size_per_gpu is not set .verl leaves it unset"):
        load_config(base="verl")
    cfg = load_config(None, MICRO, base="verl")
    assert all(get_key(cfg, key) == 8 for key in MICRO_KEYS)
    assert (cfg.data.max_prompt_length, cfg.data.max_response_length, cfg.data.train_batch_size) == (
        512,
        512,
        1024,
    )
    assert (cfg.trainer.save_freq, cfg.trainer.test_freq, cfg.trainer.total_epochs) == (-1, -1, 30)
    assert cfg.actor_rollout_ref.actor.ppo_mini_batch_size == 256
    assert cfg.actor_rollout_ref.actor.optim.lr == 1e-6
    assert cfg.critic.optim.lr == 1e-5
    assert cfg.algorithm.adv_estimator == "gae"
    assert cfg.actor_rollout_ref.model.path == "builtin:tiny-addition"


def test_embedded_default_applies_only_without_a_config_file(tmp_path):
    embedded = load_config()
    defaults = PPOFlowConfig()
    assert any(get_key(defaults, key) != value for key, value in EMBEDDED.items())
    for key, value in EMBEDDED.items():
        assert get_key(embedded, key) == value, key
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_config(empty, MICRO) == load_config(None, MICRO, base="verl")


def test_embedded_default_is_a_packaged_override_file():
    assert EMBEDDED_DEFAULT.name == "embedded_default.yaml" and EMBEDDED_DEFAULT.is_file()
    assert load_config(EMBEDDED_DEFAULT) == load_config()


def test_yaml_file_may_be_nested_or_dotted(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "trainer:\n  total_epochs: 3\n  logger: [console, wandb]\n"
        "actor_rollout_ref.actor.optim:\n  lr: 1e-4\n"
        "algorithm.kl_ctrl.type: adaptive\n"
        "critic:\n"  # an emptied section is not an error
    )
    cfg = load_config(path, MICRO)
    assert cfg.trainer.total_epochs == 3
    assert cfg.trainer.logger == ["console", "wandb"]
    assert cfg.actor_rollout_ref.actor.optim.lr == 1e-4
    assert cfg.algorithm.kl_ctrl.type == "adaptive"


def test_layer_precedence(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("trainer:\n  total_training_steps: 7\n  total_epochs: 2\n")
    steps = "trainer.total_training_steps"
    assert get_key(load_config(None, MICRO, base="verl"), steps) is None  # model default
    assert get_key(load_config(), steps) == EMBEDDED[steps]  # embedded beats defaults
    assert get_key(load_config(None, [f"{steps}=3"]), steps) == 3  # override beats embedded
    from_file = load_config(path, MICRO)
    assert get_key(from_file, steps) == 7  # file replaces embedded
    assert from_file.actor_rollout_ref.actor.optim.lr == 1e-6
    both = load_config(path, [*MICRO, f"{steps}=5", f"{steps}=6"])
    assert get_key(both, steps) == 6  # the last override beats earlier ones and the file
    assert both.trainer.total_epochs == 2


def test_embedded_default_applies_only_to_the_builtin_model(model_dir):
    """A command line that points the actor at another model gets the model defaults (verl's), not
    the tiny model's tuning; naming the built-in model keeps the embedded default."""
    defaults = PPOFlowConfig()
    own_model = f"actor_rollout_ref.model.path={model_dir}"
    other = load_config(None, [own_model, *MICRO])
    assert other == load_config(None, [own_model, *MICRO], base="verl")
    assert other.actor_rollout_ref.actor.optim.lr == 1e-6
    assert other.data.train_batch_size == defaults.data.train_batch_size == 1024
    for key in set(EMBEDDED) - set(MICRO_KEYS):
        assert get_key(other, key) == get_key(defaults, key), key
    builtin = "actor_rollout_ref.model.path=builtin:tiny-addition"
    tiny = load_config(None, [builtin])
    assert tiny == load_config()
    for key, value in EMBEDDED.items():
        assert get_key(tiny, key) == value, key
    assert load_config(None, [own_model, builtin]) == tiny  # the last path set decides


@pytest.mark.parametrize("base", ["verl", "embedded"])
def test_verl_quickstart_overrides_load_unchanged(tmp_path, model_dir, base):
    cfg = load_config(None, quickstart(tmp_path, model_dir), base=base)
    actor = cfg.actor_rollout_ref.actor
    assert actor.optim.lr == 1e-6 and isinstance(actor.optim.lr, float)
    assert cfg.trainer.logger == ["console"]
    assert cfg.trainer.val_before_train is False
    assert cfg.data.train_batch_size == 256
    assert actor.ppo_mini_batch_size == 64 and actor.ppo_micro_batch_size_per_gpu == 4
    assert cfg.actor_rollout_ref.rollout.name == "hf"
    assert cfg.actor_rollout_ref.rollout.gpu_memory_utilization == 0.4
    assert cfg.actor_rollout_ref.rollout.response_length == 512
    assert cfg.critic.model.path == str(model_dir)
    assert cfg.critic.ppo_mini_batch_size == 64
    assert cfg.trainer.total_epochs == 15


def test_the_vllm_engine_generates_on_a_gpu_said_at_load_in_one_line(tmp_path, model_dir):
    """Not after ingest, as it once was: before anything runs, saying what to set."""
    with pytest.raises(ConfigError) as raised:
        load_config(None, [*quickstart(tmp_path, model_dir), "actor_rollout_ref.rollout.name=vllm"])
    assert str(raised.value).count("\n") == 0
    assert str(raised.value).startswith(
        "actor_rollout_ref.rollout.name=vllm generates on a GPU: set trainer.device=cuda"
    )
    assert "command-line override #" in str(raised.value)
    cfg = load_config(
        None, [*quickstart(tmp_path, model_dir), "actor_rollout_ref.rollout.name=vllm", "trainer.device=cuda"]
    )
    assert cfg.actor_rollout_ref.rollout.gpu_memory_utilization == 0.4


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
            "one vLLM engine per rank, each on its own GPU",
        ),
        (
            "actor_rollout_ref.rollout.enable_chunked_prefill=false",
            "max_num_batched_tokens=1000 is below prompt_length \\+ response_length = 1024",
        ),
        (
            "actor_rollout_ref.rollout.temperature=2.5",
            "rollout.temperature=2.5: vLLM samples with temperatures up to 2",
        ),
        ("actor_rollout_ref.rollout.val_kwargs.temperature=3", "val_kwargs.temperature=3.0: vLLM samples"),
        (
            "actor_rollout_ref.rollout.load_format=megatron",
            "load_format='megatron': use one of dummy_dtensor, ",
        ),
        (
            "actor_rollout_ref.rollout.max_num_seqs=1024",
            "max_num_batched_tokens=1000 is below max_num_seqs=1024",
        ),
    ],
)
def test_vllm_settings_it_cannot_honour_are_refused(tmp_path, model_dir, override, message):
    vllm = ["actor_rollout_ref.rollout.name=vllm", "trainer.device=cuda"]
    with pytest.raises(ConfigError, match=message):
        load_config(
            None,
            [
                *quickstart(tmp_path, model_dir),
                *vllm,
                "actor_rollout_ref.rollout.max_num_batched_tokens=1000",
                "actor_rollout_ref.rollout.max_num_seqs=256",
                "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
                override,
            ],
        )


def test_override_values_are_parsed_as_yaml():
    cfg = load_config(
        None,
        [
            "trainer.logger=['console','wandb']",
            "trainer.max_actor_ckpt_to_keep=null",
            "actor_rollout_ref.actor.optim.lr=1e-3",
            "trainer.val_before_train=False",
            "+trainer.experiment_name=2024",  # Hydra's add prefix; a number becomes a name
            "++actor_rollout_ref.actor.optim.betas=[0.9, 0.95]",
        ],
    )
    assert cfg.trainer.logger == ["console", "wandb"]
    assert cfg.trainer.max_actor_ckpt_to_keep is None
    assert cfg.actor_rollout_ref.actor.optim.lr == 1e-3
    assert cfg.trainer.val_before_train is False
    assert cfg.trainer.experiment_name == "2024"
    assert cfg.actor_rollout_ref.actor.optim.betas == (0.9, 0.95)


def test_newer_verl_scheduler_name_is_accepted():
    cfg = load_config(None, ["actor_rollout_ref.actor.optim.lr_scheduler_type=cosine"])
    assert cfg.actor_rollout_ref.actor.optim.warmup_style == "cosine"


def test_free_form_mappings_merge_entry_by_entry():
    wrap = "actor_rollout_ref.actor.fsdp_config.wrap_policy"
    cfg = load_config(None, ["reward.weights.format=0.2", f"{wrap}.x.y=1"])
    assert cfg.reward.weights == {"correctness": 0.9, "format": 0.2}
    assert cfg.actor_rollout_ref.actor.fsdp_config.wrap_policy == {"x": {"y": 1}}


def test_derived_keys_follow_their_sources():
    cfg = load_config(
        None,
        [
            "actor_rollout_ref.actor.ppo_epochs=3",
            "actor_rollout_ref.rollout.n=4",
            "data.max_response_length=8",
            "actor_rollout_ref.actor.clip_ratio_high=0.28",
            "trainer.nnodes=2",
            "trainer.experiment_name=abc",
            *MICRO,
        ],
        base="verl",
    )
    assert cfg.critic.ppo_mini_batch_size == cfg.actor_rollout_ref.actor.ppo_mini_batch_size
    assert cfg.critic.ppo_epochs == 3 and cfg.critic.rollout_n == 4
    assert cfg.critic.model.path == cfg.actor_rollout_ref.model.path
    assert cfg.actor_rollout_ref.rollout.prompt_length == cfg.data.max_prompt_length
    assert cfg.actor_rollout_ref.rollout.response_length == 8
    actor = cfg.actor_rollout_ref.actor
    assert (actor.effective_clip_ratio_low, actor.effective_clip_ratio_high) == (0.2, 0.28)
    assert cfg.world_size == 2
    assert str(cfg.run_dir) == "runs/abc"
    assert str(load_config(None, ["trainer.default_local_dir=/tmp/x"]).run_dir) == "/tmp/x"


def test_deprecated_global_micro_batch_becomes_per_gpu():
    overrides = [
        "actor_rollout_ref.actor.ppo_micro_batch_size=16",
        "critic.ppo_micro_batch_size=16",
        "trainer.n_gpus_per_node=2",
        *MICRO[1:3],
    ]
    cfg = load_config(None, overrides, base="verl")
    actor = cfg.actor_rollout_ref.actor
    assert actor.ppo_micro_batch_size is None and actor.ppo_micro_batch_size_per_gpu == 8
    assert cfg.critic.ppo_micro_batch_size is None and cfg.critic.ppo_micro_batch_size_per_gpu == 8


def test_critic_free_estimators_skip_critic_checks():
    cfg = load_config(None, ["algorithm.adv_estimator=grpo", "critic.ppo_micro_batch_size_per_gpu=5"])
    assert not cfg.use_critic


@pytest.mark.parametrize("extra", [[], ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4"]])
def test_to_yaml_round_trips(tmp_path, extra):
    cfg = load_config(
        None, ["actor_rollout_ref.actor.optim.lr=1e-6", "trainer.logger=[console,wandb]", *extra]
    )
    path = tmp_path / "config.yaml"
    path.write_text(cfg.to_yaml())
    assert load_config(path) == cfg


def test_fingerprint_is_stable_and_sensitive():
    cfg = load_config()
    section = cfg.actor_rollout_ref.rollout
    dumped = section.model_dump()
    assert config_fingerprint(section) == config_fingerprint(dict(reversed(list(dumped.items()))))
    assert len(config_fingerprint(section)) == 64
    assert config_fingerprint({"a": 1, "b": {"c": 2}}) == config_fingerprint({"b": {"c": 2}, "a": 1})
    changed = load_config(None, ["actor_rollout_ref.rollout.temperature=0.7"]).actor_rollout_ref.rollout
    assert config_fingerprint(changed) != config_fingerprint(section)
    # Each task hashes its own section: a validation setting does not touch the actor's key.
    other = load_config(None, ["trainer.test_freq=5"])
    assert config_fingerprint(other.actor_rollout_ref.actor) == config_fingerprint(
        cfg.actor_rollout_ref.actor
    )


def test_every_key_is_documented():
    keys = all_keys()
    assert len(keys) == len(set(keys)) > 150
    assert "actor_rollout_ref.actor.optim.lr" in keys and "reward.weights" in keys
    for key in keys:
        section, _, name = key.rpartition(".")
        model = get_key(PPOFlowConfig(), section) if section else PPOFlowConfig()
        assert type(model).model_fields[name].description, f"{key} has no docstring"


def test_conf_stays_light():
    code = (
        "import sys, ppoflow.conf; "
        "heavy = {'torch', 'prefect', 'pyarrow', 'duckdb'} & set(sys.modules); assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_validation_only_run_needs_no_micro_batch_size(model_dir):
    """The evaluate flow validates a Hugging Face directory with trainer.val_only: nothing trains."""
    cfg = load_config(None, [f"actor_rollout_ref.model.path={model_dir}", "trainer.val_only=true"])
    assert cfg.trainer.val_only and cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu is None


def test_a_config_file_for_the_built_in_model_is_told_where_its_sizes_are(tmp_path):
    """The embedded default applies only without a config file: a file of one's own for the tiny
    model starts from verl's defaults, whose micro-batch sizes are unset."""
    mine = tmp_path / "mine.yaml"
    mine.write_text("actor_rollout_ref:\n  actor:\n    optim:\n      lr: 1.0e-5\n")
    with pytest.raises(ConfigError) as refused:
        load_config(mine)
    assert str(refused.value).startswith("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu is not set")
    assert str(refused.value).endswith(
        "; the built-in model's sizes are in conf/embedded_default.yaml, which applies only without a "
        "config file: copy what your file needs from it"
    )
