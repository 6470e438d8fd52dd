"""Every key does what verl does with it, is refused, or is named in one warning: where each value
came from, which defaults a model gets, and which keys have no effect in a run."""

import subprocess
import sys

import pytest

from ppoflow.conf import ConfigError, PPOFlowConfig, all_keys, load_config
from ppoflow.conf.effects import NO_EFFECT
from ppoflow.conf.schema_checks import get_key
from ppoflow.conf.unsupported import UNSUPPORTED
from ppoflow.tasks.pipeline.plan import run_settings

from .micro import MICRO

SMOLLM2 = "actor_rollout_ref.model.path=builtin:smollm2-135m-instruct"


def test_the_builtin_smollm2_gets_verls_defaults_not_the_tiny_models():
    cfg = load_config(None, [SMOLLM2, *MICRO], check_paths=False)
    defaults = PPOFlowConfig()
    assert cfg.actor_rollout_ref.actor.ppo_epochs == defaults.actor_rollout_ref.actor.ppo_epochs == 1
    assert cfg.trainer.total_training_steps is None
    assert cfg.trainer.total_epochs == defaults.trainer.total_epochs == 30
    assert (cfg.data.max_prompt_length, cfg.data.max_response_length) == (512, 512)
    assert (
        cfg.critic.forward_micro_batch_size_per_gpu == 8
    )  # follows critic.ppo_micro_batch_size_per_gpu, as verl
    assert cfg.origin_of("actor_rollout_ref.actor.ppo_epochs") == "the model default"


def test_a_batch_error_with_smollm2_names_the_users_layer_not_the_embedded_default():
    with pytest.raises(ConfigError) as raised:
        load_config(None, [SMOLLM2, "data.train_batch_size=48"], check_paths=False)
    assert "embedded default" not in str(raised.value) and "data.train_batch_size=48" in str(raised.value)


def test_ppoflow_config_says_where_each_value_came_from(tmp_path):
    settings = tmp_path / "run.yaml"
    settings.write_text("trainer:\n  total_epochs: 3\n")
    printed = subprocess.run(
        [
            sys.executable,
            "-m",
            "ppoflow",
            "config",
            "--config",
            str(settings),
            "critic.optim.lr=2e-5",
            *MICRO,
            "data.max_prompt_length=256",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    lines = printed.splitlines()
    assert lines[0].startswith("# The effective config")
    assert f"  total_epochs: 3  # file '{settings}'" in lines
    assert "    lr: 2.0e-05  # command-line override #1 'critic.optim.lr=2e-5'" in lines
    assert "  forward_micro_batch_size_per_gpu: 8  # follows critic.ppo_micro_batch_size_per_gpu" in lines
    assert "    prompt_length: 256  # follows data.max_prompt_length" in lines
    assert "  total_training_steps: null" in lines  # a default: no comment
    assert load_config(None, []) == load_config(None, []) and printed.count("# ") >= 3


VERL_QUICKSTART_NO_EFFECT = [
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.4",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
    "actor_rollout_ref.actor.fsdp_config.param_offload=true",
    "actor_rollout_ref.model.override_config.attention_dropout=0.0",
    "trainer.rollout_data_dir=/tmp/rollouts",
]


TWO_GPUS_FIT = [  # two devices, FSDP2, micro-batches that fit a per-GPU share: these keys take effect
    "trainer.n_gpus_per_node=2",
    "actor_rollout_ref.actor.strategy=fsdp",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
    "critic.ppo_micro_batch_size_per_gpu=16",
]


def test_keys_without_effect_are_named_once_with_why_and_defaults_say_nothing():
    cfg = load_config(None, [*TWO_GPUS_FIT, *VERL_QUICKSTART_NO_EFFECT], check_paths=False)
    unused = dict(cfg.settings_without_effect())
    assert list(unused) == [override.split("=")[0] for override in VERL_QUICKSTART_NO_EFFECT]
    assert "rollout.name=hf" in unused["actor_rollout_ref.rollout.gpu_memory_utilization"]
    assert "without offloading" in unused["actor_rollout_ref.actor.fsdp_config.param_offload"]
    one = load_config(None, ["actor_rollout_ref.actor.strategy=deepspeed"]).settings_without_effect()
    assert dict(one)["actor_rollout_ref.actor.strategy"].startswith("world_size is 1")
    warning = cfg.no_effect_warning()
    assert warning.startswith("no effect in this run: ") and "\n" not in warning
    quiet = load_config(
        None, ["actor_rollout_ref.rollout.gpu_memory_utilization=0.5", "trainer.n_gpus_per_node=1"]
    )
    assert quiet.no_effect_warning() is None  # set to what they are anyway
    assert load_config().no_effect_warning() is None  # the embedded default sets only keys it uses


def test_an_effective_config_read_back_as_a_file_warns_only_of_what_it_changed(tmp_path):
    cfg = load_config(None, ["actor_rollout_ref.rollout.gpu_memory_utilization=0.4"], check_paths=False)
    saved = tmp_path / "config.yaml"
    saved.write_text(cfg.to_yaml(origins=True))
    again = load_config(saved, check_paths=False)
    assert again == cfg
    assert [key for key, _ in again.settings_without_effect()] == [
        "actor_rollout_ref.rollout.gpu_memory_utilization"
    ]


@pytest.mark.parametrize(
    ("override", "why"),
    [
        ("actor_rollout_ref.model.lora_rank=8 trainer.n_gpus_per_node=2", "LoRA trains in one process"),
        ("reward_model.model.path=null reward_model.enable=true", "needs the reward model"),
        (
            "reward_model.enable=true reward_model.model.path=/rm trainer.n_gpus_per_node=2",
            "runs in the trainer's process",
        ),
        ("reward.weights.rm_score=0.5", "weighs the reward model's score, and there is none"),
        ("reward_model.model.input_tokenizer=/elsewhere", "compares the actor's and the reward model's"),
        ("reward_model.model.trust_remote_code=true", "models with their own code are not loaded"),
        ("reward_model.model.external_lib=my_models", "imports no module from a config"),
        (
            "actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode",
            "bypass_mode's loss takes the rollout's log-probs",
        ),
        (
            "actor_rollout_ref.actor.policy_loss.loss_mode=gspo "
            "algorithm.rollout_correction.bypass_mode=true algorithm.rollout_correction.loss_type=reinforce",
            "which replaces this one",
        ),
        (
            "actor_rollout_ref.actor.policy_loss.dro_beta=null "
            "actor_rollout_ref.actor.policy_loss.loss_mode=dro",
            "needs the weight of its log-ratio penalty",
        ),
        ("algorithm.gdpo_reward_keys=null algorithm.adv_estimator=gdpo", "normalises each reward component"),
        (
            "algorithm.adv_estimator=optimal_token_baseline algorithm.rollout_correction.bypass_mode=true",
            "which bypass mode skips",
        ),
        ("algorithm.adv_estimator=grpo_passk actor_rollout_ref.rollout.n=1", "the best two responses"),
        ("algorithm.filter_groups.enable=true actor_rollout_ref.rollout.n=1", "no spread to filter on"),
        (
            "algorithm.filter_groups.enable=true actor_rollout_ref.rollout.n=2 reward_model.enable=true "
            "reward_model.model.path=/rm",
            "before a reward model's stage runs",
        ),
        (
            "reward_model.overlong_buffer.len=0 reward_model.reward_manager=dapo "
            "reward_model.overlong_buffer.enable=true",
            "overlong buffer must be > 0",
        ),
        ("reward.weights.overlong=0.5", "weighs DAPO's overlong penalty"),
        ("actor_rollout_ref.model.override_config.rope_theta=5000", "model config overrides other than"),
        (
            "actor_rollout_ref.model.override_config.attention_dropout=0.1",
            "model config overrides other than",
        ),
        ("actor_rollout_ref.model.trust_remote_code=true", "models with their own code are not loaded"),
        ("critic.model.trust_remote_code=true", "models with their own code are not loaded"),
        ("actor_rollout_ref.model.external_lib=my_models", "imports no module from a config"),
        ("actor_rollout_ref.model.tokenizer_path=/elsewhere", "reads the tokenizer from the actor's model"),
        ("data.tokenizer=/elsewhere", "measured with the actor's tokenizer"),
        (
            "actor_rollout_ref.actor.use_dynamic_bsz=true "
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null",
            "the batch-shape checks need it",
        ),
        (
            "reward_model.use_dynamic_bsz=true reward_model.enable=true reward_model.model.path=/tmp "
            "reward_model.micro_batch_size_per_gpu=null "
            "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true "
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=null",
            "dynamic batching by token count is not implemented here",
        ),
    ],
)
def test_a_setting_that_would_change_the_run_in_a_way_ppoflow_cannot_is_refused(override, why):
    with pytest.raises(ConfigError, match=why) as raised:
        load_config(None, override.split(), check_paths=False)
    key = override.split()[0].split("=")[0]
    key = key.removesuffix(".rope_theta").removesuffix(".attention_dropout").removesuffix(".rm_score")
    key = key.removesuffix(".overlong")
    assert str(raised.value).startswith(key) and "(command-line override #1" in str(raised.value)


def test_settings_ppoflow_honours_load_and_say_nothing(tmp_path):
    same = tmp_path / "model"
    cfg = load_config(
        None,
        [
            f"actor_rollout_ref.model.path={same}",
            f"actor_rollout_ref.model.tokenizer_path={same}",
            "reward_model.reward_manager=batch",
            "actor_rollout_ref.actor.use_dynamic_bsz=true",
            "actor_rollout_ref.rollout.seed=7",
            "data.reward_fn_key=task",
            "actor_rollout_ref.actor.use_kl_loss=true",
            "actor_rollout_ref.actor.kl_loss_coef=0.01",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16",
            "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
            "actor_rollout_ref.rollout.val_kwargs.temperature=0.7",
            "actor_rollout_ref.actor.use_prefix_grouper=true",
            *MICRO,
        ],
        check_paths=False,
    )
    assert cfg.settings_without_effect() == []  # use_dynamic_bsz forms the actor's micro-batches


def test_a_token_budget_has_effect_exactly_where_its_switch_is_on():
    cfg = load_config(
        None,
        [
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096",
            "critic.use_dynamic_bsz=true",
            "critic.ppo_max_token_len_per_gpu=4096",
            "critic.forward_max_token_len_per_gpu=8192",
            "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
            "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=2048",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=null",  # not needed with a budget
        ],
        check_paths=False,
    )
    assert [key for key, _ in cfg.settings_without_effect()] == [
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"
    ]
    off = load_config(
        None, ["actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=2048"], check_paths=False
    )
    assert dict(off.settings_without_effect())[
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu"
    ] == (
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz is off: "
        "its passes have a fixed number of responses"
    )


@pytest.mark.parametrize(
    ("overrides", "why"),
    [
        (["algorithm.adv_estimator=grpo", "critic.optim.lr=2e-5"], "only with algorithm.adv_estimator=gae"),
        (["actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4"], "has no reference policy"),
        (["algorithm.kl_ctrl.kl_coef=0.01"], "use_kl_in_reward=false"),
        (["actor_rollout_ref.actor.kl_loss_type=mse"], "use_kl_loss=false"),
        (
            [  # a constant schedule, whatever the base config sets
                "actor_rollout_ref.actor.optim.warmup_style=constant",
                "actor_rollout_ref.actor.optim.total_training_steps=100",
            ],
            "this actor_rollout_ref.actor.optim schedule has neither",
        ),
        (["trainer.project_name=gsm8k"], "trainer.logger has no wandb"),
        (["actor_rollout_ref.rollout.load_format=auto"], "vLLM settings"),
        (["trainer.default_hdfs_dir=null", "trainer.default_hdfs_dir=hdfs://x"], "run directory only"),
        (["reward_model.micro_batch_size_per_gpu=8"], "there is no reward model"),
        (["actor_rollout_ref.rollout.val_kwargs.do_sample=true"], "decodes greedily"),
        (["reward_model.model.path=/rm"], "there is no reward model"),
        (
            ["reward_model.enable=true", "reward_model.model.path=/rm", "reward_model.strategy=fsdp2"],
            "runs unsharded in the trainer's process",
        ),
        (
            [
                "trainer.n_gpus_per_node=2",
                "actor_rollout_ref.actor.strategy=fsdp2",
                "critic.strategy=fsdp2",
                "actor_rollout_ref.actor.use_prefix_grouper=true",
            ],
            "runs every row whole",
        ),
    ],
)
def test_a_setting_of_a_feature_this_run_does_not_use_is_named(overrides, why):
    cfg = load_config(None, overrides, check_paths=False)
    key = overrides[-1].split("=")[0]
    assert dict(cfg.settings_without_effect())[key].find(why) >= 0


def test_a_set_lr_horizon_has_effect_where_the_schedule_spans_steps():
    sections = ("actor_rollout_ref.actor", "critic")
    horizon = [f"{section}.optim.total_training_steps=30" for section in sections]
    spans = ["actor_rollout_ref.actor.optim.warmup_style=cosine", "critic.optim.lr_warmup_steps_ratio=0.1"]
    assert load_config(None, [*spans, *horizon], check_paths=False).settings_without_effect() == []
    constant = load_config(
        None, ["actor_rollout_ref.actor.optim.warmup_style=constant", *horizon], check_paths=False
    )
    assert [key for key, _ in constant.settings_without_effect()] == [o.split("=")[0] for o in horizon]


def test_every_key_is_read_by_ppoflow_or_accounted_for():
    """A key of the tree that no stage reads must be in conf/unsupported.py (refused) or
    conf/effects.py (named as without effect): new keys cannot become silent no-ops. Keys that
    configure only the config itself (deprecated sizes it converts, keys it derives or checks) are
    listed here."""
    from fnmatch import fnmatchcase
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    source = "\n".join(
        path.read_text()
        for folder in ("engine", "tasks", "flows", "ppoflow")
        for path in (root / folder).rglob("*.py")
    )
    accounted = [pattern for rule in NO_EFFECT for pattern in rule.keys] + [rule.key for rule in UNSUPPORTED]
    config_only = {
        "actor_rollout_ref.actor.ppo_micro_batch_size",  # converted to the per-GPU size
        "actor_rollout_ref.ref.log_prob_micro_batch_size",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size",
        "critic.ppo_micro_batch_size",
        "critic.forward_micro_batch_size",
        "critic.rollout_n",  # must equal rollout.n
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size",  # only 1 is accepted
        "actor_rollout_ref.ref.ulysses_sequence_parallel_size",
        "critic.ulysses_sequence_parallel_size",
    }
    silent = [
        key
        for key in all_keys()
        if key not in config_only
        and not any(fnmatchcase(key, pattern) for pattern in accounted)
        and key.rsplit(".", 1)[-1] not in source
    ]
    assert silent == []
    for key in config_only | {rule.key for rule in UNSUPPORTED}:
        get_key(PPOFlowConfig(), key)  # each names a real key


def test_the_effective_config_reads_back_whatever_the_length_of_a_value(tmp_path):
    """A long value (a path with spaces) is not wrapped onto a second line, where the origin comment
    would have landed inside it."""
    long = tmp_path / ("datasets for reinforcement learning experiments " * 3) / "copy 2" / "test.jsonl"
    long.parent.mkdir(parents=True)
    long.write_text("{}\n")
    cfg = load_config(None, [f"data.val_files={long}", "trainer.project_name=" + "my project " * 12])
    saved = tmp_path / "config.yaml"
    saved.write_text(cfg.to_yaml(origins=True))
    assert load_config(saved, check_paths=False) == cfg


def test_a_refusal_reached_through_a_followed_key_is_said_once():
    with pytest.raises(ConfigError) as raised:
        load_config(None, ["actor_rollout_ref.model.tokenizer_path=builtin:smollm2-135m-instruct"])
    assert "\n" not in str(raised.value) and "critic.model.tokenizer_path" not in str(raised.value)


def test_a_resume_path_without_its_mode_is_named_as_without_effect(tmp_path):
    cfg = load_config(None, [f"trainer.resume_from_path={tmp_path}"], check_paths=False)
    assert dict(cfg.settings_without_effect())["trainer.resume_from_path"].startswith(
        "it is read only with trainer.resume_mode=resume_path"
    )
    with_mode = [f"trainer.resume_from_path={tmp_path}", "trainer.resume_mode=resume_path"]
    assert load_config(None, with_mode, check_paths=False).no_effect_warning() is None


@pytest.mark.parametrize(
    ("overrides", "said"),
    [
        (
            [
                "algorithm.adv_estimator=grpo",
                "actor_rollout_ref.rollout.n=4",
                "actor_rollout_ref.rollout.temperature=0",
            ],
            "actor_rollout_ref.rollout.temperature=0 decodes training rollouts greedily: the n=4 responses "
            "of a prompt are the same, the baseline grpo subtracts, so every advantage is 0 and the actor "
            "does not learn",
        ),
        (
            [
                "algorithm.adv_estimator=rloo",
                "actor_rollout_ref.rollout.n=2",
                "actor_rollout_ref.rollout.do_sample=false",
            ],
            "actor_rollout_ref.rollout.do_sample=false decodes training rollouts greedily: the n=2 responses",
        ),
        (
            ["algorithm.adv_estimator=remax", "actor_rollout_ref.rollout.temperature=0"],
            "each response is the greedy one ReMax subtracts as its baseline, so every advantage is 0",
        ),
        (["actor_rollout_ref.rollout.temperature=0"], None),  # GAE learns from the critic's values
        (["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4"], None),
        (
            [
                "algorithm.adv_estimator=grpo",
                "actor_rollout_ref.rollout.n=4",
                "actor_rollout_ref.rollout.top_k=1",
            ],
            "actor_rollout_ref.rollout.top_k=1 decodes training rollouts greedily",
        ),
        (
            [
                "algorithm.adv_estimator=remax",
                "actor_rollout_ref.rollout.temperature=0",
                "trainer.val_only=true",
            ],
            None,
        ),
    ],
)
def test_greedy_training_rollouts_that_leave_nothing_to_learn_are_named_at_start(overrides, said):
    warnings = load_config(None, overrides, check_paths=False).warnings()
    if said is None:
        assert warnings == []
    else:
        [warning] = warnings
        assert said in warning and warning.endswith(
            "sample with temperature > 0, top_k other than 1 and do_sample=true"
        )


def test_every_verl_policy_loss_is_accepted_and_the_tunings_of_another_are_named_without_effect():
    """verl scripts set actor.policy_loss.loss_mode to any name of its registry; each loads (dro with
    its dro_beta, bypass_mode with rollout_correction.bypass_mode), a misspelt one names the valid
    ones, and the keys that tune a loss this run does not use are named as without effect."""
    from ppoflow.engine.policy_losses import POLICY_LOSSES

    needs = {
        "dro": ["actor_rollout_ref.actor.policy_loss.dro_beta=0.1"],
        "bypass_mode": ["algorithm.rollout_correction.bypass_mode=true"],
    }
    for mode in POLICY_LOSSES:
        cfg = load_config(
            None, [f"actor_rollout_ref.actor.policy_loss.loss_mode={mode}", *needs.get(mode, [])]
        )
        assert cfg.actor_rollout_ref.actor.policy_loss.loss_mode == mode
        assert cfg.warnings() == []
    with pytest.raises(ConfigError, match="expected one of 'vanilla'.*'bypass_mode'"):
        load_config(None, ["actor_rollout_ref.actor.policy_loss.loss_mode=vanila"])
    tuned = load_config(None, ["actor_rollout_ref.actor.policy_loss.clip_cov_ratio=0.001"])
    assert tuned.warnings() == [
        "no effect in this run: actor_rollout_ref.actor.policy_loss.clip_cov_ratio (they tune the clip_cov "
        "policy loss; this run's is another (actor_rollout_ref.actor.policy_loss.loss_mode))"
    ]
    sapo = load_config(
        None, ["actor_rollout_ref.actor.policy_loss.loss_mode=sapo", "actor_rollout_ref.actor.tau_neg=2"]
    )
    assert sapo.warnings() == []


def test_a_token_budget_below_the_longest_sequence_is_refused():
    overrides = [
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=5",
    ]
    with pytest.raises(
        ConfigError, match=r"ppo_max_token_len_per_gpu=5 is below the longest sequence"
    ) as raised:
        load_config(None, overrides, check_paths=False)
    assert "actor_rollout_ref.actor.ppo_max_token_len_per_gpu" in str(raised.value)
    cfg = load_config(None, [*overrides[:1], "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096"])
    assert run_settings(cfg, 1).actor.update.max_token_len == 4096
    assert run_settings(load_config(None, []), 1).actor.update.max_token_len is None


@pytest.mark.parametrize(
    ("switch", "budget", "unused"),
    [
        ("critic.use_dynamic_bsz", "critic.forward_max_token_len_per_gpu", ["algorithm.adv_estimator=grpo"]),
        (
            "actor_rollout_ref.ref.log_prob_use_dynamic_bsz",
            "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
            ["actor_rollout_ref.actor.use_kl_loss=false"],
        ),
        (
            "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz",
            "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
            None,
        ),
    ],
)
def test_a_forward_pass_budget_below_the_longest_sequence_is_refused_where_the_pass_runs(
    switch, budget, unused
):
    kl = ["actor_rollout_ref.actor.use_kl_loss=true"]  # a reference policy, so its pass runs
    with pytest.raises(ConfigError, match=rf"{budget}=9 is below the longest sequence"):
        load_config(None, [*kl, f"{switch}=true", f"{budget}=9"], check_paths=False)
    if unused is not None:  # no critic (grpo), no reference (no KL): that pass never runs
        load_config(None, [f"{switch}=true", f"{budget}=9", *unused], check_paths=False)


def test_padding_free_and_token_budget_settings_reach_every_pass():
    cfg = load_config(
        None,
        [
            "actor_rollout_ref.actor.use_kl_loss=true",
            "actor_rollout_ref.model.use_remove_padding=true",
            "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
            "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=3000",
            "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=true",
            "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=2000",
            "critic.use_dynamic_bsz=true",
            "critic.forward_max_token_len_per_gpu=1000",
        ],
        check_paths=False,
    )
    settings = run_settings(cfg, 1)
    assert settings.rollout.log_prob_batching.max_token_len == 3000
    assert settings.rollout.ref_log_prob_batching.max_token_len == 2000
    assert settings.rollout.log_prob_batching.remove_padding and settings.actor.update.remove_padding
    assert settings.advantages.values_batching.max_token_len == 1000
    assert (
        not settings.advantages.values_batching.remove_padding and not settings.critic.update.remove_padding
    )
    default = run_settings(load_config(None, []), 1)
    assert default.rollout.log_prob_batching.max_token_len is None
    assert not default.rollout.log_prob_batching.remove_padding


def test_packing_gives_way_to_the_prefix_grouper_and_says_so():
    cfg = load_config(
        None,
        [
            "actor_rollout_ref.model.use_remove_padding=true",
            "actor_rollout_ref.actor.use_prefix_grouper=true",
            "critic.model.use_remove_padding=true",
        ],
        check_paths=False,
    )
    unused = dict(cfg.settings_without_effect())
    assert list(unused) == ["actor_rollout_ref.model.use_remove_padding"]
    assert (
        "use_prefix_grouper shares each prompt's forward pass"
        in unused["actor_rollout_ref.model.use_remove_padding"]
    )
    settings = run_settings(cfg, 1)
    assert not settings.actor.update.remove_padding and not settings.rollout.log_prob_batching.remove_padding
    assert settings.critic.update.remove_padding and settings.advantages.values_batching.remove_padding


def test_the_old_log_prob_budget_of_a_bypass_run_is_named_as_without_effect_not_checked():
    overrides = [
        "algorithm.rollout_correction.bypass_mode=true",
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=9",  # below the longest sequence
    ]
    unused = dict(load_config(None, overrides, check_paths=False).settings_without_effect())
    assert {
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz",
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
    } <= set(unused)
    assert "no old-log-prob pass runs" in unused["actor_rollout_ref.rollout.log_prob_use_dynamic_bsz"]
