"""Documentation of the metrics table's columns: verl's metric names, by pattern, with what each
one is computed from (shown by `ppoflow schema metrics`, attached to the parquet fields)."""

from __future__ import annotations

import re

METRICS_DOC = (
    "One row per iteration: `step` (int64, the global training step) and one float64 column per "
    "metric, named with verl's `group/name` (e.g. `actor/pg_clipfrac`, `critic/score/mean`, "
    "`val-core/<data_source>/acc/mean@1`). The column set is not fixed; quote names in SQL: "
    '`SELECT iter, "critic/score/mean" FROM metrics`.'
)

_TOKENS = "over the batch's response tokens (advantages table)"
METRIC_DOCS: dict[str, str] = {
    "critic/score/{mean,max,min}": "Of the scores (rewards.score) of responses with ≥ 1 token (verl).",
    "critic/rewards/{mean,max,min}": "Of Σ token_level_rewards per response (the score minus the KL "
    "penalty with algorithm.use_kl_in_reward), responses with ≥ 1 token.",
    "critic/advantages/{mean,max,min}": f"Of advantages {_TOKENS}.",
    "critic/returns/{mean,max,min}": f"Of returns {_TOKENS}.",
    "critic/values/{mean,max,min}": f"Of the critic's values {_TOKENS}; runs with a critic.",
    "critic/vf_explained_var": f"1 − Var(returns − values) / (Var(returns) + 1e-5) {_TOKENS}, unbiased.",
    "critic/score/zero_spread_group_ratio": "Share of prompts whose n responses all scored the same (no "
    "signal for grouped estimators: GRPO, RLOO, …); only when actor_rollout_ref.rollout.n > 1.",
    "critic/score/group_std_mean": "Mean over prompts of the unbiased std of their responses' scores; "
    "only when actor_rollout_ref.rollout.n > 1.",
    "response_length/{mean,max,min}": "Of the responses' lengths in tokens (rollouts.response_length).",
    "response_length/clip_ratio": "Share of responses of exactly data.max_response_length tokens (cut off).",
    "response_length_non_aborted/{mean,max,min,clip_ratio}": "As response_length/*, over responses with "
    "≥ 1 token (verl leaves out aborted rollouts).",
    "num_turns/{min,max,mean}": "Multi-turn: of the responses' verl num_turns (rollouts.num_turns: the "
    "prompt, each assistant turn and each tool turn).",
    "tool_call_counts/{min,max,mean}": "Multi-turn: of the tool calls per response (rollouts.tool_calls).",
    "response/aborted_ratio": "Share of responses without a token (verl's aborted rollouts).",
    "prompt_length/{mean,max,min}": "Of the batch's prompt lengths in tokens (rollouts.prompt_length).",
    "prompt_length/clip_ratio": "Share of prompts of exactly data.max_prompt_length tokens.",
    "reward/error_rate": "Share of the batch's responses whose reward failed (rewards.error not null).",
    "training/rollout_probs_diff_{max,mean,std}": "Of |exp(rollout_log_probs) − exp(old_log_probs)| over "
    "response tokens (std unbiased): how far the rollout engine's probabilities are from the trainer's.",
    "training/rollout_actor_probs_pearson_corr": "Pearson correlation of exp(old_log_probs) and "
    "exp(rollout_log_probs) over response tokens.",
    "training/rollout_probs_diff_valid": "1: the rollout engine reported log-probs (verl's flag).",
    "rollout_corr/{training_ppl,training_log_ppl}": "Mean over responses of exp(−mean old log-prob) "
    "(and of −mean old log-prob): the trainer's perplexity (verl's compute_offpolicy_metrics; every "
    "response counts, one without tokens as 1 and 0); in bypass mode, of the current policy.",
    "rollout_corr/{rollout_ppl,rollout_log_ppl}": "The same of the rollout engine's log-probs.",
    "rollout_corr/kl": "Mean over response tokens of rollout_log_probs − old_log_probs (KL(π_rollout ‖ "
    "π_train)); decoupled mode: per step (advantages stage); bypass mode: per optimizer step, of π_θ.",
    "rollout_corr/k3_kl": "Mean over response tokens of ρ − log ρ − 1, ρ = π_train/π_rollout.",
    "rollout_corr/{log_ppl_diff,log_ppl_abs_diff,log_ppl_diff_max,log_ppl_diff_min}": "Of each "
    "response's mean rollout log-prob − mean trainer log-prob: mean, mean |·|, max, min.",
    "rollout_corr/ppl_ratio": "Mean over responses of exp(log_ppl_diff): training / rollout perplexity.",
    "rollout_corr/chi2_token": "Mean over response tokens of ρ² − 1 (log ρ clamped to ±20).",
    "rollout_corr/chi2_seq": "Mean over responses of exp(2·Σ log ρ) − 1 (clamped to ±20).",
    "rollout_corr/rollout_is_<stat>": "Importance sampling (algorithm.rollout_correction.rollout_is): "
    "verl's statistics of the truncated weights (advantages.rollout_is_weights): mean, max, min, std, "
    "eff_sample_size, ratio_fraction_{high,low}, seq_{mean,std,max,min,max_deviation,fraction_high,"
    "fraction_low}, batch_norm_factor, oob_ratio (IcePop).",
    "rollout_corr/rollout_rs_<stat>": "Rejection sampling (rollout_correction.rollout_rs): per criterion "
    "rollout_rs_<criterion>_{mean,max,min,std,fraction_high,fraction_low,masked_fraction,"
    "seq_masked_fraction,seq_*}; rollout_rs_masked_fraction (tokens) and rollout_rs_seq_masked_fraction "
    "(responses) of all criteria together (advantages.rollout_rs_rejected).",
    "train/num_gen_batches": "Dynamic sampling (algorithm.filter_groups): the generation batches the step "
    "took to fill data.train_batch_size groups (filter_groups.gen_batch).",
    "training/filter_groups/evicted_samples": "Dynamic sampling: groups dropped because their responses' "
    "metric did not differ (filter_groups.reason = 'no spread').",
    "training/filter_groups/discarded_surplus_samples": "Dynamic sampling: groups with a spread generated "
    "after the batch was full (filter_groups.reason = 'surplus').",
    "training/global_step": "The iteration (verl's global step; the same as the step column).",
    "training/epoch": "Pass over the training prompts that the step's batch comes from, 0-based.",
    "actor/reward_kl_penalty": "Mean over responses of each one's mean per-token KL of old vs reference "
    "policy (advantages.kl); only with algorithm.use_kl_in_reward.",
    "actor/reward_kl_penalty_coeff": "β, the KL coefficient this step's rewards used (algorithm.kl_ctrl); "
    "only with algorithm.use_kl_in_reward.",
    "actor/<column>": "Mean of that actor_update column over the step's optimizer steps (verl's "
    "reduce_metrics): pg_loss, pg_clipfrac, pg_clipfrac_lower, ppo_kl, entropy, grad_norm, lr, kl_loss "
    "(the loss modes that report no clip fraction have none); actor/kl_coef (use_kl_loss) from "
    "actor_update.other_metrics.",
    "critic/<column>": "Mean of that critic_update column over the step's optimizer steps: vf_loss, "
    "vf_clipfrac, vpred_mean, grad_norm, lr.",
    "val-{core,aux}/<data_source>/<variable>/mean@<n>": "Validation at this step: mean over the data "
    "source's prompts of the mean of their n answers' variable (n = rollout.val_kwargs.n): reward (the "
    "score), acc (the score again, for a reward function that returns a number: the built-in rewards, "
    "a custom function returning a float; or a component of that name), or a reward component "
    "(correctness, format, …). val-core for the core variable (acc when there is one, else reward) at "
    "the source's largest n, val-aux otherwise (verl).",
    "val-aux/<data_source>/<variable>/std@<n>": "Validation (n > 1): mean over prompts of the standard "
    "deviation (ddof 0) of their n answers' variable.",
    "val-{core,aux}/<data_source>/<variable>/{best,worst,maj}@<k>/{mean,std}": "Validation (n > 1), verl's "
    "bootstrap: per prompt, 1000 draws of k of its n answers with replacement (numpy, seed 42; k = 2, 4, "
    "… below n, and n); the mean and std over draws of each draw's best (max), worst (min) or majority "
    "value (of the answer, validation.pred, that most of the draw gives; only for prompts whose answers "
    "all have a pred); then the mean over prompts. val-core: best and maj of the core variable at the "
    "largest n.",
    "val-aux/reward/error_rate": "Share of the step's validation responses whose reward failed.",
    "timing_s/step": "Sum of the step's stage seconds (verl's step timer); equals perf/time_per_step.",
    "timing_s/<timer>": "Wall seconds of one of verl's timers, as the stage that measured it recorded "
    "it in the iteration's manifest (the first run's when served from cache): gen (rollouts: generation, "
    "reading and writing, and loading the actor when it is not in memory), old_log_prob and ref "
    "(rollouts), reward (rewards, plus reward_model with a reward model), values (with loading the "
    "critic) and adv (advantages), "
    "update_critic and update_actor (with saving), testing (validation).",
    "timing_per_token_ms/<timer>": "1000 · timing_s/<timer> per token: response tokens for gen, prompt + "
    "response tokens for ref, values, adv, update_critic, update_actor (verl's counts).",
    "perf/total_num_tokens": "Prompt + response tokens of the batch (verl's Σ global_token_num).",
    "perf/time_per_step": "Seconds of the step: timing_s/step.",
    "perf/throughput": "perf/total_num_tokens / (perf/time_per_step · devices): tokens/s per device.",
    "perf/max_memory_allocated_gb": "GiB. CUDA: torch.cuda.max_memory_allocated, the peak since the "
    "training process started (verl). CPU: that process's peak resident set size (getrusage).",
    "perf/max_memory_reserved_gb": "GiB. CUDA: torch.cuda.max_memory_reserved, the peak since the "
    "process started (verl). CPU: the process's peak resident set size, as perf/max_memory_allocated_gb.",
    "perf/cpu_memory_used_gb": "GiB of memory in use on the whole host (total − available, verl's "
    "psutil reading), not only this run's.",
}
"""The doc of every metric column, by name pattern: {a,b} is one of the words, <data_source> any text,
another <placeholder> one name without '/'. The first matching pattern documents a column."""


def _pattern(pattern: str) -> re.Pattern:
    parts = re.split(r"(<data_source>|<[a-z_]+>|\{[^}]*\})", pattern)
    regex = ""
    for part in parts:
        if part == "<data_source>":
            regex += ".+"
        elif part.startswith("<"):
            regex += "[^/]+"
        elif part.startswith("{"):
            regex += "(?:" + "|".join(map(re.escape, part[1:-1].split(","))) + ")"
        else:
            regex += re.escape(part)
    return re.compile(regex)


_METRIC_PATTERNS = [(_pattern(pattern), doc) for pattern, doc in METRIC_DOCS.items()]


def metric_doc(name: str) -> str | None:
    """The documentation of a metrics column, or None for a name no pattern covers."""
    return next((doc for regex, doc in _METRIC_PATTERNS if regex.fullmatch(name)), None)
