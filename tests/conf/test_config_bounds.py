"""Every number in the config is finite and in its domain, and the run name is a plain name: a bad
value is one clear ConfigError naming the key, the layer, the value and what is expected, while the
edge values verl users legitimately set still load."""

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from ppoflow.conf import ConfigError, PPOFlowConfig, TrainerConfig, load_config
from tests.conf.test_config import quickstart

CONF = Path(__file__).parents[2] / "conf"


def error_of(*overrides: str, path=None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return str(info.value)


def expected(override: str, shown: str, wanted: str, key: str | None = None) -> str:
    """The message of a bad command-line override #1."""
    key = key or override.partition("=")[0]
    return f"invalid value {shown} for '{key}' (command-line override #1 '{override}'): expected {wanted}"


@pytest.mark.parametrize(
    ("override", "shown"),
    [
        ("actor_rollout_ref.actor.optim.lr=inf", "'inf'"),
        ("actor_rollout_ref.actor.optim.lr=.inf", "inf"),
        ("actor_rollout_ref.actor.optim.lr=1e999", "inf"),
        ("actor_rollout_ref.actor.optim.lr=-.inf", "-inf"),
        ("actor_rollout_ref.actor.entropy_coeff=nan", "'nan'"),
        ("actor_rollout_ref.actor.entropy_coeff=.nan", "nan"),
        ("actor_rollout_ref.actor.entropy_coeff=-1e999", "-inf"),
        ("reward.weights.correctness=nan", "'nan'"),
        ("reward.weights.format=.inf", "inf"),
        ("reward.weights.length=-.inf", "-inf"),  # a new component
        ("critic.optim.lr=.NaN", "nan"),
        ("critic.optim.min_lr_ratio=.nan", "nan"),
        ("critic.cliprange_value=.inf", "inf"),
        ("algorithm.gamma=.nan", "nan"),
        ("algorithm.kl_ctrl.kl_coef=.inf", "inf"),
        ("algorithm.pf_ppo.weight_pow=.nan", "nan"),
        ("actor_rollout_ref.actor.clip_ratio_high=.inf", "inf"),
        ("actor_rollout_ref.actor.grad_clip=.inf", "inf"),
        ("actor_rollout_ref.rollout.temperature=.inf", "inf"),
        ("actor_rollout_ref.rollout.val_kwargs.top_p=.nan", "nan"),
        ("reward.timeout_s=.inf", "inf"),
        ("data.max_reject_fraction=.nan", "nan"),
        ("data.max_prompt_length=.inf", "inf"),  # an integer key
        ("actor_rollout_ref.model.override_config.attention_dropout=.nan", "nan"),  # free-form
        ("critic.model.override_config.rope_scaling.factor=1e999", "inf"),
        ("actor_rollout_ref.actor.fsdp_config.wrap_policy.min_num_params=-.inf", "-inf"),
    ],
)
def test_non_finite_override_is_refused(override, shown):
    assert error_of(override) == expected(override, shown, "a finite number")


@pytest.mark.parametrize("index", [0, 1])
def test_non_finite_beta_is_refused(index):
    betas = ["0.9", "0.999"]
    betas[index] = ".nan"
    override = f"actor_rollout_ref.actor.optim.betas=[{', '.join(betas)}]"
    assert error_of(override) == expected(override, "nan", "a finite number")


def test_non_finite_number_in_a_free_form_list_is_refused():
    override = "actor_rollout_ref.model.override_config.scales=[1.0, .inf]"
    assert error_of(override) == expected(override, "[1.0, inf]", "finite numbers only")
    nested = "actor_rollout_ref.model.override_config={rope: {factor: .nan}}"
    assert error_of(nested) == expected(
        nested, "nan", "a finite number", key="actor_rollout_ref.model.override_config.rope.factor"
    )


YAML_SPELLINGS = [(".inf", "inf"), (".nan", "nan"), (".NaN", "nan"), ("-.inf", "-inf"), ("1e999", "inf")]
YAML_SPELLINGS += [("nan", "'nan'"), ("inf", "'inf'"), ("-Infinity", "'-Infinity'")]


@pytest.mark.parametrize(("spelling", "shown"), YAML_SPELLINGS)
@pytest.mark.parametrize(
    "key",
    [
        "actor_rollout_ref.actor.optim.lr",
        "actor_rollout_ref.actor.entropy_coeff",
        "reward.weights.correctness",
        "algorithm.lam",
    ],
)
def test_non_finite_value_in_a_config_file_is_refused(tmp_path, key, spelling, shown):
    path = tmp_path / "run.yaml"
    *sections, name = key.split(".")
    lines = [f"{'  ' * depth}{section}:" for depth, section in enumerate(sections)]
    path.write_text("\n".join([*lines, f"{'  ' * len(sections)}{name}: {spelling}"]) + "\n")
    assert error_of(path=path) == (
        f"invalid value {shown} for '{key}' (file '{path}'): expected a finite number"
    )


def test_non_finite_free_form_entry_in_a_config_file_is_refused(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("actor_rollout_ref:\n  model:\n    override_config:\n      attention_dropout: .nan\n")
    assert error_of(path=path) == (
        "invalid value nan for 'actor_rollout_ref.model.override_config.attention_dropout' "
        f"(file '{path}'): expected a finite number"
    )


@pytest.mark.parametrize(
    ("override", "shown", "wanted"),
    [
        ("actor_rollout_ref.actor.optim.lr=0", "0", "greater than 0"),
        ("actor_rollout_ref.actor.optim.lr=-1e-6", "-1e-06", "greater than 0"),
        ("critic.optim.lr=0.0", "0.0", "greater than 0"),
        ("actor_rollout_ref.actor.optim.min_lr_ratio=1.5", "1.5", "less than or equal to 1"),
        ("actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=-0.1", "-0.1", "greater than or equal to 0"),
        ("actor_rollout_ref.actor.optim.weight_decay=-0.01", "-0.01", "greater than or equal to 0"),
        ("actor_rollout_ref.actor.clip_ratio=0", "0", "greater than 0"),
        ("actor_rollout_ref.actor.clip_ratio_low=-0.2", "-0.2", "greater than 0"),
        ("actor_rollout_ref.actor.clip_ratio_c=1", "1", "greater than 1"),
        ("actor_rollout_ref.actor.grad_clip=0", "0", "greater than 0"),
        ("actor_rollout_ref.actor.kl_loss_coef=-0.001", "-0.001", "greater than or equal to 0"),
        ("actor_rollout_ref.rollout.temperature=-1", "-1", "greater than or equal to 0"),
        ("actor_rollout_ref.rollout.top_p=0", "0", "greater than 0"),
        ("actor_rollout_ref.rollout.top_p=1.1", "1.1", "less than or equal to 1"),
        ("actor_rollout_ref.rollout.top_k=-2", "-2", "greater than or equal to -1"),
        ("actor_rollout_ref.rollout.val_kwargs.top_k=-2", "-2", "greater than or equal to -1"),
        ("actor_rollout_ref.rollout.val_kwargs.temperature=-0.5", "-0.5", "greater than or equal to 0"),
        ("actor_rollout_ref.rollout.gpu_memory_utilization=1.5", "1.5", "less than or equal to 1"),
        ("algorithm.gamma=1.01", "1.01", "less than or equal to 1"),
        ("algorithm.lam=-0.1", "-0.1", "greater than or equal to 0"),
        ("algorithm.kl_ctrl.kl_coef=-0.1", "-0.1", "greater than or equal to 0"),
        ("algorithm.kl_ctrl.target_kl=0", "0", "greater than 0"),
        ("algorithm.pf_ppo.weight_pow=-1", "-1", "greater than or equal to 0"),
        ("critic.cliprange_value=0", "0", "greater than 0"),
        ("reward.timeout_s=0", "0", "greater than 0"),
        ("reward.timeout_s=86401", "86401", "less than or equal to 86400"),
        ("data.max_reject_fraction=1.5", "1.5", "less than or equal to 1"),
        ("trainer.seed=-1", "-1", "greater than or equal to 0"),
        ("data.seed=4294967296", "4294967296", "less than 4294967296"),
        ("actor_rollout_ref.rollout.seed=-5", "-5", "greater than or equal to 0"),
    ],
)
def test_value_outside_its_domain_is_refused(override, shown, wanted):
    assert error_of(override) == expected(override, shown, wanted)


@pytest.mark.parametrize(
    ("override", "shown", "wanted"),
    [
        ("critic.optim.betas=[0.9, 1.0]", "1.0", "less than 1"),
        ("actor_rollout_ref.actor.optim.betas=[-0.1, 0.999]", "-0.1", "greater than or equal to 0"),
    ],
)
def test_beta_outside_zero_one_is_refused(override, shown, wanted):
    assert error_of(override) == expected(override, shown, wanted)


BOOLEAN_SPELLINGS = ["true", "True", "TRUE", "false", "False", "yes", "no", "on", "off"]
"""What YAML 1.1 (PyYAML, as OmegaConf) reads as a boolean, in overrides and files alike."""

NUMBER_KEYS = [
    ("actor_rollout_ref.actor.optim.lr", "a number"),
    ("actor_rollout_ref.actor.entropy_coeff", "a number"),
    ("data.max_reject_fraction", "a number"),
    ("critic.cliprange_value", "a number"),
    ("trainer.total_training_steps", "an integer"),  # int | None
    ("actor_rollout_ref.rollout.n", "an integer"),
    ("trainer.seed", "an integer"),
    ("actor_rollout_ref.actor.optim.lr_warmup_steps", "an integer"),
    ("actor_rollout_ref.actor.ulysses_sequence_parallel_size", "an integer"),  # Literal[1]
    ("actor_rollout_ref.actor.deepspeed_config.zero_stage", "an integer"),  # Literal[0, 1, 2, 3]
]


@pytest.mark.parametrize("spelling", BOOLEAN_SPELLINGS)
@pytest.mark.parametrize(("key", "wanted"), NUMBER_KEYS)
def test_boolean_for_a_number_is_refused(key, wanted, spelling):
    # pydantic's lax mode reads True as 1 and 1.0: lr=true trained at a learning rate of 1.0.
    override = f"{key}={spelling}"
    shown = repr(spelling.lower() in ("true", "yes", "on"))
    assert error_of(override) == expected(override, shown, f"{wanted}, not a boolean")


@pytest.mark.parametrize(
    ("override", "shown", "key"),
    [
        ("actor_rollout_ref.actor.optim.betas=[true, 0.999]", "True", None),
        ("critic.optim.betas=[0.9, false]", "False", None),  # False would have read as a valid 0.0
        ("reward.weights.correctness=true", "True", None),
        ("reward.weights={format: no}", "False", "reward.weights.format"),
    ],
)
def test_boolean_inside_a_numeric_list_or_mapping_is_refused(override, shown, key):
    assert error_of(override) == expected(override, shown, "a number, not a boolean", key=key)


def test_boolean_for_a_number_in_a_config_file_is_refused(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("trainer:\n  total_training_steps: yes\n")
    assert error_of(path=path) == (
        f"invalid value True for 'trainer.total_training_steps' (file '{path}'): "
        "expected an integer, not a boolean"
    )


def test_boolean_for_a_number_is_refused_when_the_tree_is_built_directly():
    with pytest.raises(ValidationError, match="Input should be a number, not a boolean") as info:
        PPOFlowConfig.model_validate({"actor_rollout_ref": {"actor": {"optim": {"betas": [0.9, True]}}}})
    assert info.value.errors()[0]["loc"] == ("actor_rollout_ref", "actor", "optim", "betas", 1)


@pytest.mark.parametrize(
    ("spelling", "value"), [("true", True), ("True", True), ("yes", True), ("off", False)]
)
def test_boolean_keys_and_free_form_entries_still_take_booleans(spelling, value):
    cfg = load_config(
        None,
        [
            f"trainer.val_only={spelling}",
            f"actor_rollout_ref.actor.use_kl_loss={spelling}",
            f"actor_rollout_ref.model.override_config.use_cache={spelling}",
            f"actor_rollout_ref.actor.fsdp_config.wrap_policy.transformer_layer_cls={spelling}",
        ],
    )
    assert cfg.trainer.val_only is value and cfg.actor_rollout_ref.actor.use_kl_loss is value
    assert cfg.actor_rollout_ref.model.override_config["use_cache"] is value
    assert cfg.actor_rollout_ref.actor.fsdp_config.wrap_policy == {"transformer_layer_cls": value}


def test_integers_still_load_as_floats_and_floats_as_whole_integers():
    cfg = load_config(None, ["actor_rollout_ref.actor.optim.lr=1", "trainer.total_training_steps=3.0"])
    assert cfg.actor_rollout_ref.actor.optim.lr == 1.0 and cfg.trainer.total_training_steps == 3


PLAIN_NAME = (
    "a plain name for the run directory runs/<name> ({}); "
    "to put the run elsewhere set trainer.default_local_dir"
)


@pytest.mark.parametrize(
    ("value", "shown", "problem"),
    [
        ("{tmp}/escape", "'{tmp}/escape'", "it is an absolute path"),
        ("../escape", "'../escape'", "it has a path separator"),
        ("runs/nested", "'runs/nested'", "it has a path separator"),
        ("'a\\b'", "'a\\\\b'", "it has a path separator"),
        (".", "'.'", "'.' is not a name"),
        ("..", "'..'", "'..' is not a name"),
        ("''", "''", "it is empty"),
        ("'   '", "'   '", "it is empty"),
        ('"run\\nname"', "'run\\nname'", "it has a control character"),
        ('"run\\x7fname"', "'run\\x7fname'", "it has a control character"),
    ],
)
def test_experiment_name_must_be_a_plain_name(tmp_path, value, shown, problem):
    override = f"trainer.experiment_name={value.format(tmp=tmp_path)}"
    wanted = PLAIN_NAME.format(problem)
    assert error_of(override) == expected(override, shown.format(tmp=tmp_path), wanted)
    assert not (tmp_path / "escape").exists()


def test_experiment_name_in_a_config_file_must_be_a_plain_name(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(f"trainer:\n  experiment_name: {tmp_path}/escape\n")
    assert error_of(path=path) == (
        f"invalid value '{tmp_path}/escape' for 'trainer.experiment_name' (file '{path}'): expected "
        + PLAIN_NAME.format("it is an absolute path")
    )


def test_bad_values_are_refused_when_the_tree_is_built_directly():
    with pytest.raises(ValidationError, match="finite numbers only, but the entry rope.factor is not finite"):
        PPOFlowConfig.model_validate(
            {"actor_rollout_ref": {"model": {"override_config": {"rope": {"factor": float("nan")}}}}}
        )
    with pytest.raises(ValidationError, match="Input should be a finite number"):
        PPOFlowConfig.model_validate({"reward": {"weights": {"correctness": float("inf")}}})
    with pytest.raises(ValidationError, match=r"runs/<name> \(it is an absolute path\)"):
        TrainerConfig(experiment_name="/tmp/escape")


LEGITIMATE = [
    "actor_rollout_ref.actor.optim.lr=1e-7",
    "actor_rollout_ref.actor.optim.min_lr_ratio=0",
    "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=1",
    "actor_rollout_ref.actor.optim.lr_warmup_steps=-1",
    "actor_rollout_ref.actor.optim.weight_decay=0",
    "actor_rollout_ref.actor.optim.betas=[0.0, 0.95]",
    "actor_rollout_ref.actor.clip_ratio_low=0.2",
    "actor_rollout_ref.actor.clip_ratio_high=0.28",
    "actor_rollout_ref.actor.clip_ratio_c=1.0001",
    "actor_rollout_ref.actor.kl_loss_coef=0",
    "actor_rollout_ref.rollout.temperature=0",  # greedy
    "actor_rollout_ref.rollout.top_k=-1",
    "actor_rollout_ref.rollout.val_kwargs.top_k=0",
    "actor_rollout_ref.rollout.top_p=1",
    "actor_rollout_ref.model.override_config.attention_dropout=0.0",
    "algorithm.gamma=0",
    "algorithm.lam=1",
    "algorithm.kl_ctrl.kl_coef=0",
    "algorithm.pf_ppo.weight_pow=0",
    "reward.weights.format=-0.5",  # a penalty
    "reward.timeout_s=86400",
    "data.max_reject_fraction=0",
    "data.train_max_samples=-1",
    "trainer.seed=0",
    "data.seed=4294967295",
    "trainer.save_freq=-1",
    "trainer.test_freq=0",
]


@pytest.mark.parametrize("entropy_coeff", ["0", "0.001", "-0.001"])
def test_legitimate_edge_values_load(entropy_coeff):
    cfg = load_config(None, [*LEGITIMATE, f"actor_rollout_ref.actor.entropy_coeff={entropy_coeff}"])
    actor = cfg.actor_rollout_ref.actor
    assert actor.entropy_coeff == float(entropy_coeff)
    assert actor.optim.lr == 1e-7 and actor.optim.min_lr_ratio == 0
    assert actor.optim.betas == (0.0, 0.95)
    assert cfg.reward.weights == {"correctness": 0.9, "format": -0.5}
    assert cfg.algorithm.pf_ppo.weight_pow == 0
    assert cfg.data.seed == 2**32 - 1


def test_verl_quickstart_with_edge_values_loads(tmp_path, model_dir):
    cfg = load_config(None, [*quickstart(tmp_path, model_dir), *LEGITIMATE], base="verl")
    assert cfg.actor_rollout_ref.actor.optim.lr == 1e-7
    assert cfg.critic.optim.lr == 1e-5


@pytest.mark.parametrize(
    "name", ["demo", "gsm8k-cpu", "2024", "run.v2", "a..b", ".hidden", "my run", "résumé"]
)
def test_plain_names_load(name):
    assert load_config(None, [f"trainer.experiment_name={name}"]).run_dir == Path("runs") / name


def test_run_directory_is_default_local_dir_or_runs_name(tmp_path):
    chosen = load_config(
        None, [f"trainer.default_local_dir={tmp_path}/elsewhere", "trainer.experiment_name=x"]
    )
    assert chosen.run_dir == tmp_path / "elsewhere"
    assert load_config(None, ["trainer.experiment_name=x"]).run_dir == Path("runs/x")


@pytest.mark.parametrize("path", sorted(CONF.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_config_files_load(path):
    cfg = load_config(path, check_paths=False)
    assert cfg.run_dir.parent == Path("runs")


def ppoflow(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ppoflow", *args], capture_output=True, text=True, timeout=120, cwd=cwd
    )


@pytest.mark.parametrize("command", ["config", "train"])
@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("actor_rollout_ref.actor.optim.lr=inf", "invalid value 'inf' for 'actor_rollout_ref.actor.optim"),
        ("reward.weights.correctness=.nan", "invalid value nan for 'reward.weights.correctness'"),
        ("trainer.experiment_name={tmp}/escape", "(it is an absolute path)"),
        ("actor_rollout_ref.actor.optim.lr=true", "expected a number, not a boolean"),
    ],
)
def test_cli_refuses_with_exit_2_before_writing(tmp_path, command, override, message):
    work = tmp_path / "work"
    work.mkdir()
    out = ppoflow(work, command, override.format(tmp=tmp_path))
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("ppoflow: ") and message.format(tmp=tmp_path) in out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""
    assert list(work.iterdir()) == [] and not (tmp_path / "escape").exists()
