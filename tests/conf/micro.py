"""verl leaves every micro-batch size unset, and so does ppoflow's config model: a run outside the
embedded default sets them, as on verl's command lines."""

MICRO = [
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
    "critic.ppo_micro_batch_size_per_gpu=8",
]
MICRO_KEYS = [line.split("=")[0] for line in MICRO] + ["critic.forward_micro_batch_size_per_gpu"]
