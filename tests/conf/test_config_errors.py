"""Each bad config gets one clear message naming the key, the layer, the value and the fix."""

import os
import signal

import pytest
import yaml

from ppoflow.conf import EMBEDDED_DEFAULT, ConfigError, load_config

from .micro import MICRO


def error_of(*overrides: str, path=None, base="embedded") -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides, base=base)
    return str(info.value)


def test_mini_batch_must_divide_train_batch():
    message = error_of("actor_rollout_ref.actor.ppo_mini_batch_size=48", "data.train_batch_size=64")
    assert message.startswith(
        "actor_rollout_ref.actor.ppo_mini_batch_size=48 does not divide data.train_batch_size=64: "
        "choose a mini-batch size that divides 64 (e.g. 8, 16, 32, 64) or change data.train_batch_size"
    )
    # ... and says which layer set each number,
    assert "command-line override #1 'actor_rollout_ref.actor.ppo_mini_batch_size=48'" in message
    assert "data.train_batch_size: command-line override #2 'data.train_batch_size=64'" in message
    # the embedded default included.
    train = yaml.safe_load(EMBEDDED_DEFAULT.read_text())["data"]["train_batch_size"]
    message = error_of(f"actor_rollout_ref.actor.ppo_mini_batch_size={train + 1}")
    assert message.startswith(
        f"actor_rollout_ref.actor.ppo_mini_batch_size={train + 1} does not divide "
        f"data.train_batch_size={train}"
    )
    assert f"data.train_batch_size: embedded default '{EMBEDDED_DEFAULT}'" in message


def test_mini_batch_responses_must_split_over_gpus():
    message = error_of(
        "data.train_batch_size=64",
        "actor_rollout_ref.actor.ppo_mini_batch_size=16",
        "actor_rollout_ref.rollout.n=1",
        "trainer.nnodes=1",
        "trainer.n_gpus_per_node=3",
    )
    assert message.startswith(
        "the mini-batch of 16 responses (actor_rollout_ref.actor.ppo_mini_batch_size=16 × "
        "actor_rollout_ref.rollout.n=1) does not split evenly over world_size=3 "
        "(trainer.nnodes=1 × trainer.n_gpus_per_node=3)"
    )


def test_micro_batch_must_divide_per_gpu_mini_batch():
    message = error_of(
        "data.train_batch_size=64",
        "actor_rollout_ref.actor.ppo_mini_batch_size=16",
        "actor_rollout_ref.rollout.n=3",
        "trainer.nnodes=1",
        "trainer.n_gpus_per_node=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=5",
    )
    assert message.startswith(
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=5 does not divide the per-GPU mini-batch of "
        "24 responses (actor_rollout_ref.actor.ppo_mini_batch_size=16 × actor_rollout_ref.rollout.n=3 / "
        "world_size=2): choose a micro-batch size that divides 24 (e.g. 3, 4, 6, 8)"
    )


def test_micro_batch_larger_than_mini_batch():
    message = error_of(
        "data.train_batch_size=64",
        "actor_rollout_ref.actor.ppo_mini_batch_size=16",
        "actor_rollout_ref.rollout.n=1",
        "trainer.nnodes=1",
        "trainer.n_gpus_per_node=1",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32",
    )
    assert message.startswith(
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32 is larger than the per-GPU mini-batch of 16 "
        "responses"
    )
    assert "set actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu to at most 16" in message


def test_critic_batch_sizes_are_checked_with_their_defaults():
    # A valid actor update, so that the critic's is the one checked.
    batches = (
        "data.train_batch_size=64",
        "actor_rollout_ref.actor.ppo_mini_batch_size=16",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.rollout.n=1",
        "trainer.nnodes=1",
        "trainer.n_gpus_per_node=1",
    )
    # verl's layering: the embedded default sets the critic's own mini-batch, so use the bare defaults.
    message = error_of(*batches, "critic.ppo_micro_batch_size_per_gpu=12", base="verl")
    assert message.startswith(
        "critic.ppo_micro_batch_size_per_gpu=12 does not divide the per-GPU mini-batch of 16 responses "
        "(critic.ppo_mini_batch_size=16 × actor_rollout_ref.rollout.n=1 / world_size=1)"
    )
    assert (
        "critic.ppo_mini_batch_size: unset, so it follows actor_rollout_ref.actor.ppo_mini_batch_size"
        in message
    )
    assert error_of(*batches, "critic.ppo_mini_batch_size=48", base="verl").startswith(
        "critic.ppo_mini_batch_size=48 does not divide data.train_batch_size=64"
    )


def test_both_micro_batch_settings():
    message = error_of(
        "actor_rollout_ref.actor.ppo_micro_batch_size=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
    )
    assert message.startswith(
        "actor_rollout_ref.actor.ppo_micro_batch_size=8 and "
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 are both set: "
        "remove actor_rollout_ref.actor.ppo_micro_batch_size (verl's deprecated global size)"
    )


def test_unknown_key_in_override_suggests_the_closest():
    assert error_of("trainer.total_epochs=2", "actor_rollout_ref.actor.optim.lrr=1e-3") == (
        "unknown key 'actor_rollout_ref.actor.optim.lrr' (command-line override #2 "
        "'actor_rollout_ref.actor.optim.lrr=1e-3'); did you mean 'actor_rollout_ref.actor.optim.lr'?"
    )
    assert error_of("critic.lr=1e-5").endswith("did you mean 'critic.optim.lr'?")


def test_unknown_key_in_yaml_file_suggests_the_closest(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("trainer:\n  total_epoch: 3\n")
    assert error_of(path=path) == (
        f"unknown key 'trainer.total_epoch' (file '{path}'); did you mean 'trainer.total_epochs'?"
    )


def test_unknown_key_without_a_close_match_lists_valid_keys():
    assert "valid keys at the top level: data, actor_rollout_ref, critic" in error_of("zzz=1")


def test_unknown_estimator_lists_the_valid_ones():
    assert error_of("algorithm.adv_estimator=ppo") == (
        "invalid value 'ppo' for 'algorithm.adv_estimator' (command-line override #1 "
        "'algorithm.adv_estimator=ppo'): expected one of 'gae', 'grpo', 'grpo_vectorized', 'gdpo', "
        "'grpo_passk', 'rloo', 'rloo_vectorized', 'opo', 'gpg', 'reinforce_plus_plus', "
        "'reinforce_plus_plus_baseline', 'remax', 'optimal_token_baseline' or 'tir_optimal_token_baseline'"
    )


def test_bad_type():
    assert error_of("trainer.total_epochs=two") == (
        "invalid value 'two' for 'trainer.total_epochs' "
        "(command-line override #1 'trainer.total_epochs=two'): "
        "expected a valid integer, unable to parse string as an integer"
    )


def test_bad_value_in_yaml_file_names_the_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("actor_rollout_ref:\n  actor:\n    clip_ratio_c: 0.5\n")
    assert error_of(path=path) == (
        f"invalid value 0.5 for 'actor_rollout_ref.actor.clip_ratio_c' (file '{path}'): "
        "expected greater than 1"
    )


def test_override_without_equals_sign():
    assert error_of("trainer.total_epochs") == (
        "command-line override #1 'trainer.total_epochs' is not of the form key=value "
        "(e.g. trainer.total_epochs=15)"
    )


def test_section_set_to_a_value():
    assert error_of("trainer=1").startswith("'trainer' is a section, not a value (command-line override #1")


def test_model_path_that_does_not_exist(tmp_path):
    missing = tmp_path / "nope"
    assert error_of(f"actor_rollout_ref.model.path={missing}").startswith(
        f"model path '{missing}' (actor_rollout_ref.model.path) does not exist"
    )


def test_model_directory_without_tokenizer(tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text("{}")
    assert error_of(f"actor_rollout_ref.model.path={bare}").startswith(
        f"model directory '{bare}' has no tokenizer (tokenizer.json / tokenizer_config.json); "
        "set actor_rollout_ref.model.tokenizer_path"
    )
    # A separate tokenizer makes it loadable.
    load_config(
        None,
        [f"actor_rollout_ref.model.path={bare}", f"actor_rollout_ref.model.tokenizer_path={bare}", *MICRO],
    )


def test_model_directory_without_config_json(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    assert error_of(f"actor_rollout_ref.model.path={tmp_path}").startswith(
        f"model directory '{tmp_path}' (actor_rollout_ref.model.path) has no config.json"
    )


def test_gguf_must_be_a_file(tmp_path, model_dir):
    gguf = tmp_path / "m.gguf"
    gguf.mkdir()
    assert "ends in .gguf but is not a file" in error_of(f"actor_rollout_ref.model.path={gguf}")
    gguf.rmdir()
    gguf.write_bytes(b"GGUF")
    cfg = load_config(None, [f"actor_rollout_ref.model.path={gguf}", *MICRO])
    assert cfg.actor_rollout_ref.model.path == str(gguf)


def test_critic_model_path_is_checked(tmp_path):
    assert error_of(f"critic.model.path={tmp_path / 'nope'}").startswith("model path")


def test_data_files_must_exist(tmp_path):
    missing = tmp_path / "train.parquet"
    assert error_of(f"data.train_files=[{missing}]").startswith(
        f"data file '{missing}' (data.train_files) does not exist"
    )
    assert load_config(None, [f"data.train_files={missing}"], check_paths=False).data.train_files == str(
        missing
    )


def test_a_data_or_reward_file_that_is_a_pipe_or_a_folder_is_refused_at_load(tmp_path):
    """Reading a FIFO would wait forever (after the server and the models had started); a folder
    failed with EISDIR, naming no key."""
    pipe, folder = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    os.mkfifo(pipe)
    folder.mkdir()
    assert error_of(f"data.train_files={pipe}").startswith(
        f"data file '{pipe}' (data.train_files) is a pipe, socket or device, not a file"
    )
    assert error_of(f"data.val_files=[{folder}]").startswith(
        f"data file '{folder}' (data.val_files) is a folder, not a file"
    )
    assert error_of(f"custom_reward_function.path={folder}").startswith(
        f"reward function file '{folder}' (custom_reward_function.path) is a folder, not a file"
    )


def test_an_empty_list_of_data_files_is_refused_at_load():
    for key in ("data.train_files", "data.val_files"):
        assert error_of(f"{key}=[]").startswith(
            f"invalid value [] for '{key}' (command-line override #1 '{key}=[]'): expected at least one "
            "file (an empty list reads no prompts)"
        )


def test_a_rollout_prompt_budget_below_the_ingest_limit_is_refused_at_load():
    """Ingest keeps prompts up to data.max_prompt_length; a smaller rollout budget failed in the
    rollout stage, naming data.max_prompt_length."""
    assert error_of("actor_rollout_ref.rollout.prompt_length=4").startswith(
        "actor_rollout_ref.rollout.prompt_length=4 is below data.max_prompt_length=16"
    )
    assert (
        load_config(
            None, ["actor_rollout_ref.rollout.prompt_length=32"]
        ).actor_rollout_ref.rollout.prompt_length
        == 32
    )


def test_unreadable_config_file(tmp_path):
    assert error_of(path=tmp_path / "missing.yaml").startswith("cannot read config file")
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: [\n")
    assert error_of(path=bad).startswith(f"cannot parse YAML file '{bad}'")
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfetrainer: {}\n")
    assert (
        error_of(path=binary)
        == f"cannot read config file '{binary}': not UTF-8 text (byte 0: invalid start byte)"
    )
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)  # opened without blocking, refused without reading
    assert error_of(path=fifo) == f"cannot read config file '{fifo}': not a regular file"
    assert error_of(path=tmp_path) == f"cannot read config file '{tmp_path}': Is a directory"


def test_a_key_set_twice_in_one_mapping_is_refused_as_omegaconf_does(tmp_path):
    twice = tmp_path / "twice.yaml"
    twice.write_text("trainer:\n  save_freq: 2\ntrainer:\n  total_training_steps: 3\n")
    error = error_of(path=twice)
    assert error.startswith(f"cannot parse YAML file '{twice}'") and "key 'trainer' is set twice" in error
    nested = tmp_path / "nested.yaml"
    nested.write_text("trainer: {save_freq: 2, save_freq: 3}\n")
    assert "key 'save_freq' is set twice" in error_of(path=nested)
    merged = tmp_path / "merged.yaml"  # a key a YAML merge brings may be set again: that is its use
    merged.write_text("critic:\n  <<: {ppo_epochs: 1, ppo_mini_batch_size: 64}\n  ppo_epochs: 3\n")
    from ppoflow.conf.yaml_files import ConfigYamlLoader

    read = yaml.load(merged.read_text(), Loader=ConfigYamlLoader)
    assert read == {"critic": {"ppo_epochs": 3, "ppo_mini_batch_size": 64}}
    for merges in (  # a merged mapping that itself merges: read as PyYAML's own safe loader reads it
        "common: &c {lr: 0}\ndefaults: &d {<<: *c, lr: 1}\nx:\n  <<: *d\n",
        "x: {base: &b {<<: {k: 0}, k: 1}, <<: *b}\n",
        "a: &a {x: 1}\nb: &b {y: 2}\nc: {<<: [*a, *b], x: 3}\n",
    ):
        assert yaml.load(merges, Loader=ConfigYamlLoader) == yaml.safe_load(merges)
    with pytest.raises(yaml.YAMLError, match="key 'yes' is set twice"):  # the key as written
        yaml.load("true: 1\nyes: 2\n", Loader=ConfigYamlLoader)
    dotted = tmp_path / "dotted.yaml"  # the same key, once dotted and once nested: YAML sees two keys
    dotted.write_text("data.train_batch_size: 16\ndata:\n  train_batch_size: 32\n")
    assert error_of(path=dotted) == (
        f"YAML file '{dotted}' sets 'data.train_batch_size' twice (once as a dotted key, once under its "
        "section): keep one"
    )
    merged.write_text("critic:\n  <<: {ppo_epochs: 1}\n  ppo_epochs: 3\ncritic.ppo_mini_batch_size: 8\n")
    micro = [f"{s}.ppo_micro_batch_size_per_gpu=8" for s in ("actor_rollout_ref.actor", "critic")]
    micro.append("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8")
    cfg = load_config(merged, micro)
    assert (cfg.critic.ppo_epochs, cfg.critic.ppo_mini_batch_size) == (3, 8)


def test_divisor_hints_are_found_at_once_for_any_batch_size():
    # 999999999999 = 3³·7·11·13·37·101·9901; the divisors nearest the embedded mini-batch size 32 are
    # 27, 33, 37 and 39. The hint once tried every number up to the batch size (hours for this one).
    # The limit is 5 s of this process's CPU time, not of the clock: a loaded machine that gives the
    # test a fraction of a core must not fail it, and hours of search still would.
    before = signal.signal(signal.SIGPROF, _too_slow)
    signal.setitimer(signal.ITIMER_PROF, 5)
    try:
        message = error_of("data.train_batch_size=999999999999")
        assert "choose a mini-batch size that divides 999999999999 (e.g. 27, 33, 37, 39)" in message
        # A prime batch size has two divisors, 1 and itself.
        prime = 2**89 - 1
        message = error_of(f"data.train_batch_size={prime}")
        assert f"that divides {prime} (e.g. 1, {prime})" in message
        # The micro-batch hint too: a per-GPU mini-batch of 999999999999 responses split into 16s.
        message = error_of(
            "data.train_batch_size=999999999999",
            "actor_rollout_ref.actor.ppo_mini_batch_size=999999999999",
            "actor_rollout_ref.rollout.n=1",
            "trainer.nnodes=1",
            "trainer.n_gpus_per_node=1",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
        )
        assert "choose a micro-batch size that divides 999999999999 (e.g. 9, 11, 13, 21)" in message
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, before)


def _too_slow(signum, frame):
    raise TimeoutError("the divisor hint took more than 5 s of CPU time")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["algorithm.rollout_correction.rollout_is_threshold=-1"],
            "'algorithm.rollout_correction.rollout_is_threshold'.*the upper bound must be > 0",
        ),
        (
            [
                "algorithm.rollout_correction.rollout_is=token",
                "algorithm.rollout_correction.rollout_is_threshold=2_1",
            ],
            "'lower_upper' needs 0 < lower ≤ upper, got '2_1'",
        ),
        (["algorithm.rollout_correction.rollout_rs=token_k9"], "unknown rejection criterion 'token_k9'"),
        (
            ["algorithm.rollout_correction.rollout_rs=token_k2"],
            "rollout_rs_threshold=None for rollout_rs='token_k2': it is not set",
        ),
        (
            [
                "algorithm.rollout_correction.rollout_rs=token_k2",
                "algorithm.rollout_correction.rollout_rs_threshold=0",
            ],
            "token_k2 needs an upper bound > 0",
        ),
        (
            [
                "algorithm.rollout_correction.rollout_rs=token_k1,seq_mean_k3",
                "algorithm.rollout_correction.rollout_rs_threshold=1,2,3",
            ],
            "3 values for 2 rollout_rs criteria",
        ),
        (
            [
                "algorithm.rollout_correction.rollout_rs=seq_max_k2",
                "algorithm.rollout_correction.rollout_rs_threshold=1_2",
            ],
            "seq_max_k2 takes one upper bound",
        ),
    ],
)
def test_a_bad_rollout_correction_threshold_is_one_line_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message) as raised:
        load_config(None, overrides)
    assert "\n" not in str(raised.value) and "rollout_correction" in str(raised.value)


def test_lower_upper_thresholds_stay_text_where_yaml_1_1_would_read_a_number():
    """0.5_2 is 0.52 to YAML 1.1 and 1_5 is 15: read as YAML 1.2, they stay the 'lower_upper' text."""
    cfg = load_config(
        None,
        [
            "algorithm.rollout_correction.rollout_is=token",
            "algorithm.rollout_correction.rollout_is_threshold=0.5_2",
            "algorithm.rollout_correction.rollout_rs=token_k1",
            "algorithm.rollout_correction.rollout_rs_threshold=1_5",
        ],
    )
    assert cfg.algorithm.rollout_correction.is_bounds == (2.0, 0.5)
    assert cfg.algorithm.rollout_correction.rs_criteria == (("token_k1", 5.0, 1.0),)
