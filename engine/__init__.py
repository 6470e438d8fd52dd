"""ppoflow's engine: pure compute (models, sampling, advantage, loss and KL math, update loops, rewards).

Tensors and plain values in, tensors and plain values out: no file IO, no Prefect, no config tree.
This package imports nothing, so `import ppoflow.engine` does not load torch; the config layer
imports `ppoflow.engine.names` (the closed vocabularies, torch-free) to check values against them.
The formulas are in docs/ALGORITHMS.md.

Glossary: the argument names used here, which the run's tables reuse as column names (`score` for
scores); in brackets, the key verl 0.9.1 uses for the same thing.

Shapes
    B               prompts per training step (data.train_batch_size).
    n               responses sampled per prompt (actor_rollout_ref.rollout.n).
    N               responses in a step, N = B·n; the leading dimension of every batch tensor.
    P, T            padded prompt length (prompts left-padded) and padded response length
                    (responses right-padded); V is the vocabulary size.
Masks
    response_mask   (N, T) 0/1, 1 on response tokens up to and including EOS [response_mask]. Any
                    dtype; a position is valid where it is non-zero. Inputs at masked positions are
                    ignored (masking.py selects them away); advantages, returns and the
                    no-gradient forward passes return 0 there.
    prompt_mask     (N, P) 0/1, the attention mask of the left-padded prompt.
Groups
    group_id        (N,) int, shared by the n responses to one prompt [uid]; GRPO, RLOO and
                    REINFORCE++-baseline take their baseline over it.
Log-probabilities, all (N, T), log π(a_t | s_t) of logits / sampling temperature
    rollout_log_probs   as the rollout engine reported them while sampling [rollout_log_probs].
    old_log_probs   the sampling policy, recomputed by the trainer's forward pass before the
                    update: the ratio's denominator [old_log_probs].
    ref_log_probs   the frozen reference policy, for a KL loss or in-reward KL [ref_log_prob].
    log_probs       the current policy during the update (with gradient).
Critic
    values          (N, T) V(s_t), the value of the state before token t, before the critic
                    update [values]; vpreds are the critic's outputs during its update.
Rewards
    scores          (N,) one number per response, what the reward function returned (verl's
                    compute_score).
    token_level_scores   (N, T) the score placed at the last valid token, 0 elsewhere
                    [token_level_scores].
    token_level_rewards  (N, T) token_level_scores − β·kl·mask with algorithm.use_kl_in_reward,
                    else equal to them [token_level_rewards].
Estimator outputs
    advantages      (N, T) what the policy loss weighs each token by [advantages].
    returns         (N, T) the critic's regression targets [returns].
Batching of an update
    mini-batch      the rows of one optimizer step: actor.ppo_mini_batch_size prompts × n
                    (critic.ppo_mini_batch_size, defaulting to the actor's, for the critic);
                    ppo_epochs passes over the step's N rows.
    micro-batch     the rows of one forward/backward pass (actor.ppo_micro_batch_size_per_gpu,
                    critic.ppo_micro_batch_size_per_gpu; with use_dynamic_bsz, consecutive rows
                    within ppo_max_token_len_per_gpu tokens: batching.micro_batches); gradients
                    accumulate over a mini-batch's micro-batches, all divided by the mini-batch's
                    denominator. Forward-only passes (batching.ForwardBatching)
                    use rollout.log_prob_micro_batch_size_per_gpu (old log-probs),
                    ref.log_prob_micro_batch_size_per_gpu and critic.forward_micro_batch_size_per_gpu,
                    or their token budgets. With use_remove_padding a micro-batch runs packed: its
                    rows' valid tokens as one sequence (packing.py).

Modules
    names: the closed vocabularies (estimators, loss_agg_mode, KL kinds, …); masking: masked
    sum/mean/var/whiten and loss aggregation (Aggregation); advantages: the estimators' registry
    (advantage_inputs: their inputs and settings; group_advantages, token_advantages: the
    estimators); kl: KL estimators and the β controllers; policy_losses: the policy losses' registry
    (policy_loss_inputs: their inputs and settings); rollout_correction: importance weights,
    rejection sampling and their diagnostics; losses: the value loss, explained variance; logits:
    log-probs, entropy and Σπ² from logits; forward: forward passes over (prompt, response) batches;
    batching: their micro-batches (rows or a token budget); packing: padding-free packed passes;
    update: the actor and critic update loops; optim: AdamW and the LR schedule; pf_ppo: PF-PPO
    resampling; rollout: sampling engines; ppo: the stages as engine calls; metrics: verl's metrics;
    validation_metrics: verl's validation metrics (mean@n, best@k, worst@k, maj@k); rewards, gsm8k:
    rule rewards; data: which prompts each step uses, prompt truncation; models: loading actor,
    reference, critic; lora: LoRA adapters (peft); tiny: the built-in tiny model and its addition
    task.
"""
