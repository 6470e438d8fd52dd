"""DAPO's dynamic sampling (algorithm.filter_groups): the rollouts stage drops the prompt groups whose
responses are all right or all wrong and generates further batches until data.train_batch_size
groups are left; every generated group is a row of filter_groups; a kill between two generation
batches resumes from the batches already kept, to the same tables. Real `ppoflow train` processes
(tests/flows/test_resume.py's), one torch thread each, so that numerics are identical."""

from __future__ import annotations

import pytest

from ppoflow.tasks.storage.confined_query import query

from .test_resume import ppoflow_train

DAPO = [
    "algorithm.adv_estimator=grpo",
    "algorithm.use_kl_in_reward=false",
    "actor_rollout_ref.rollout.n=4",
    "data.train_batch_size=8",
    "data.gen_batch_size=4",
    "algorithm.filter_groups.enable=true",
    "algorithm.filter_groups.metric=acc",
    "actor_rollout_ref.actor.ppo_mini_batch_size=8",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32",
    "actor_rollout_ref.rollout.val_kwargs.n=1",
    "actor_rollout_ref.rollout.val_kwargs.do_sample=false",
    "trainer.val_before_train=false",
    "trainer.test_freq=0",
    "trainer.total_training_steps=1",
]
TABLES = ("rollouts", "filter_groups", "rewards", "advantages")


def rows_of(run_dir, table: str) -> list[tuple]:
    order = "iter, gen_batch, prompt_id" if table == "filter_groups" else "iter, prompt_id, sample_idx"
    return query(run_dir, f"SELECT * FROM {table} ORDER BY {order}")[1]


@pytest.mark.slow
def test_dynamic_sampling_keeps_a_full_batch_of_groups_with_a_spread_and_resumes_between_batches(
    prefect_server, tmp_path
):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    done = ppoflow_train(whole, *DAPO)
    assert done.returncode == 0, done.stderr[-2000:]

    [(groups, kept, batches, no_spread, surplus)] = query(
        whole,
        "SELECT count(*), count(*) FILTER (WHERE kept), max(gen_batch) + 1, "
        "count(*) FILTER (WHERE reason = 'no spread'), count(*) FILTER (WHERE reason = 'surplus') "
        "FROM filter_groups",
    )[1]
    assert kept == 8 and batches >= 2 and no_spread > 0 and groups == kept + no_spread + surplus
    sizes = query(whole, "SELECT count(*) FROM filter_groups GROUP BY gen_batch ORDER BY gen_batch")[1]
    assert all(n == 4 for (n,) in sizes[:-1])  # data.gen_batch_size prompts a batch, the first one too
    [(trained_groups, responses, flat)] = query(
        whole,
        "SELECT count(*), sum(n), count(*) FILTER (WHERE lo = hi) FROM ("
        "SELECT group_id, count(*) n, min(components['correctness']) lo, max(components['correctness']) hi "
        "FROM rollouts JOIN rewards USING (iter, prompt_id, sample_idx) GROUP BY group_id)",
    )[1]
    assert (trained_groups, responses, flat) == (8, 32, 0)  # each trained group has a spread
    [(kept_prompts,)] = query(
        whole,
        "SELECT count(*) FROM filter_groups f JOIN (SELECT DISTINCT prompt_id FROM rollouts) r "
        "USING (prompt_id) WHERE f.kept",
    )[1]
    assert kept_prompts == 8
    columns, [row] = query(whole, "SELECT * FROM metrics WHERE iter = 1")
    metrics = dict(zip(columns, row, strict=True))
    assert metrics["train/num_gen_batches"] == batches
    assert metrics["training/filter_groups/evicted_samples"] == no_spread
    assert metrics["training/filter_groups/discarded_surplus_samples"] == surplus

    stopped = ppoflow_train(killed, *DAPO, fault="filter_groups@1")  # after the second batch is kept
    assert stopped.returncode != 0
    staged = sorted(p.name for p in killed.glob("iter=000001/rollouts/.generation/*/batch-*.parquet"))
    assert staged == ["batch-00000.parquet", "batch-00001.parquet"]
    resumed = ppoflow_train(killed, *DAPO)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "generation batch 2: kept from an earlier attempt" in resumed.stdout
    assert not (killed / "iter=000001/rollouts/.generation").exists()
    for table in TABLES:
        assert rows_of(killed, table) == rows_of(whole, table), table
