#!/usr/bin/env python3
"""Reference vectors computed with verl 0.9.1's own code, written as JSON test data.

Writes, under tests/engine/verl_reference/ (or --out DIR):
  policy_losses.json         every loss in core_algos.POLICY_LOSS_REGISTRY, called as
                             verl/workers/utils/losses.py `ppo_loss` calls it
  advantage_estimators.json  every estimator in core_algos.ADV_ESTIMATOR_REGISTRY, through
                             verl/trainer/ppo/ray_trainer.py `compute_advantage` (and
                             verl/trainer/ppo/v1/utils.py `compute_advantage_for_multi_trajectories`)
  rollout_correction.json    rollout_corr_helper.compute_rollout_correction_and_rejection_mask and
                             compute_offpolicy_metrics
  kl_and_agg.json            core_algos.kl_penalty and core_algos.agg_loss

How to run (from the repository root), in a virtual environment of its own (CPU torch):

    python3 -m venv /tmp/verlenv
    printf 'torch==2.13.0\\n' > /tmp/verl-constraints.txt
    /tmp/verlenv/bin/pip install -c /tmp/verl-constraints.txt torch==2.13.0
    /tmp/verlenv/bin/pip install --no-deps verl==0.9.1
    /tmp/verlenv/bin/pip install -c /tmp/verl-constraints.txt packaging tensordict==0.10.0 omegaconf numpy \\
        ray codetiming "transformers>=5.5.3,<5.11,!=5.6.0" torchdata datasets pillow peft cachetools \\
        uvicorn fastapi
    /tmp/verlenv/bin/python scripts/verl_reference_vectors.py

The output is deterministic: fixed seeds, one torch thread; a second run writes identical bytes.
Floats are Python floats (float64; float32 results are stored as their exact float64 value).
Tensors are nested lists, rows first; masks are lists of 0/1 with their torch dtype recorded.
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import importlib.util
import json
import os
import sys
import types
import warnings
from pathlib import Path

os.environ.setdefault("VERL_FORCE_DEVICE", "cpu")
warnings.filterwarnings("ignore")

import numpy as np  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

import verl.trainer.ppo.core_algos as core_algos  # noqa: E402
import verl.trainer.ppo.rollout_corr_helper as rch  # noqa: E402
from verl.protocol import DataProto  # noqa: E402
from verl.trainer.config import AlgoConfig  # noqa: E402
from verl.trainer.config.algorithm import RolloutCorrectionConfig  # noqa: E402
from verl.trainer.ppo.ray_trainer import apply_kl_penalty, compute_advantage  # noqa: E402
from verl.workers.config import ActorConfig  # noqa: E402
from verl.workers.config.actor import PolicyLossConfig  # noqa: E402

VERL_VERSION = importlib.metadata.version("verl")
TORCH_VERSION = torch.__version__
SCRIPT = "scripts/verl_reference_vectors.py"
assert VERL_VERSION == "0.9.1", f"verl 0.9.1 expected, found {VERL_VERSION}"

DTYPES = {"float64": torch.float64, "float32": torch.float32}
AGG_MODES = [
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
]

# ----------------------------------------------------------------------------------------------
# Common helpers
# ----------------------------------------------------------------------------------------------


def fl(t):
    """A float tensor as nested Python floats (exact float64 values)."""
    if t is None:
        return None
    return t.detach().to(torch.float64).cpu().tolist()


def ints(t):
    return t.detach().to(torch.int64).cpu().tolist()


def scalar(v):
    if isinstance(v, torch.Tensor):
        v = v.detach().item()
    if isinstance(v, bool):
        return v
    if isinstance(v, (int, float, np.integer, np.floating)):
        return float(v)
    return v


def metrics_json(metrics: dict) -> dict:
    return {k: scalar(v) for k, v in metrics.items()}


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


# The shared layout of response masks, N=8 rows x T=10 tokens: rows of different lengths,
# zeros inside some responses (multi-turn tool tokens) and one empty row (row 4).
N, T = 8, 10
ROW_LEN = [10, 7, 4, 9, 0, 6, 10, 2]
HOLES = {0: [3, 4], 3: [5, 6], 5: [2]}


def make_mask(row_len=ROW_LEN, holes=HOLES, width=T) -> np.ndarray:
    m = np.zeros((len(row_len), width), dtype=np.int64)
    for i, length in enumerate(row_len):
        m[i, :length] = 1
    for i, cols in holes.items():
        m[i, cols] = 0
    return m


MASK = make_mask()
N_TOKENS = int(MASK.sum())
MASK_NOTE = (
    "response_mask rows have lengths 10,7,4,9,0,6,10,2; row 0 has zeros at 3-4, row 3 at 5-6, row 5 at 2 "
    "(tool tokens); row 4 is empty"
)

# Per-row shift of log pi_new - log pi_old (drives sequence-level ratios away from 1) and a few
# tokens with large log-ratios (|log r| > 1.1, i.e. ratio > 3 or < 1/3).
ROW_BIAS = np.array([0.0, 0.35, 0.0, 0.2, 0.0, -0.35, 0.0, 0.0])
OUTLIERS = {(0, 1): 1.3, (3, 2): 1.4, (1, 5): 1.2, (6, 3): 1.5, (6, 7): -1.3, (2, 1): -1.2}
OUTLIER_ADV = {(0, 1): -1.7, (3, 2): -2.2, (1, 5): 1.1, (6, 3): -0.9, (6, 7): 1.5, (2, 1): 0.8}


LOGPROB_NOTE = (
    "log_prob - old_log_prob within +-0.6 (rows 1, 3, 5 shifted by +0.35, +0.2, -0.35) except 6 tokens at "
    "+-1.2 to 1.5; inputs at masked positions are random"
)


def make_logprob_batch(seed: int) -> dict:
    """float64 numpy inputs: old/new log-probs, token and row advantages, IS weights."""
    rng = np.random.default_rng(seed)
    p_old = rng.uniform(0.05, 0.95, (N, T))
    for (i, j), d in OUTLIERS.items():
        if d > 0:
            p_old[i, j] = rng.uniform(0.05, 0.2)
    old = np.log(p_old)
    delta = np.clip(ROW_BIAS[:, None] + rng.uniform(-0.45, 0.45, (N, T)), -0.6, 0.6)
    for (i, j), d in OUTLIERS.items():
        delta[i, j] = d
    new = old + delta
    flip = new > -0.01  # keep log-probs negative
    new[flip] = old[flip] - np.abs(delta[flip])
    adv_tok = rng.choice([-1.0, 1.0], (N, T)) * rng.uniform(0.2, 3.0, (N, T))
    for (i, j), a in OUTLIER_ADV.items():
        adv_tok[i, j] = a
    adv_row = np.repeat((rng.choice([-1.0, 1.0], N) * rng.uniform(0.2, 3.0, N))[:, None], T, axis=1)
    is_w = np.exp(rng.uniform(-0.5, 0.5, (N, T))) * MASK
    return {"old": old, "new": new, "adv_tok": adv_tok, "adv_row": adv_row, "is_w": is_w}


def tensor(a, dtype):
    return torch.tensor(np.asarray(a), dtype=dtype)


def write_json(path: Path, cases: list) -> None:
    head = {"verl_version": VERL_VERSION, "torch_version": TORCH_VERSION, "script": SCRIPT}
    lines = [json.dumps(c, separators=(",", ":")) for c in cases]
    text = json.dumps(head, separators=(",", ":"))[:-1] + ',"cases":[\n' + ",\n".join(lines) + "\n]}\n"
    json.loads(text)
    path.write_text(text)


# ----------------------------------------------------------------------------------------------
# 1. Policy losses
# ----------------------------------------------------------------------------------------------


def actor_config(loss_mode, agg, cfg_kw, pl_kw, loss_scale_factor):
    pl_kw = dict(pl_kw)
    rc = pl_kw.pop("rollout_correction", None)
    if rc is not None:
        pl_kw["rollout_correction"] = RolloutCorrectionConfig(**rc)
    return ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_mini_batch_size=N,
        ppo_micro_batch_size_per_gpu=N,
        loss_agg_mode=agg,
        loss_scale_factor=loss_scale_factor,
        policy_loss=PolicyLossConfig(loss_mode=loss_mode, **pl_kw),
        **cfg_kw,
    )


def config_json(config: ActorConfig) -> dict:
    pl = config.policy_loss
    out = {
        "loss_mode": pl.loss_mode,
        "loss_agg_mode": config.loss_agg_mode,
        "clip_ratio": config.clip_ratio,
        "clip_ratio_low": config.clip_ratio_low,
        "clip_ratio_high": config.clip_ratio_high,
        "clip_ratio_c": config.clip_ratio_c,
        "tau_pos": config.tau_pos,
        "tau_neg": config.tau_neg,
        "loss_scale_factor": config.loss_scale_factor,
        "global_batch_info": dict(config.global_batch_info),
        "policy_loss": {
            "clip_cov_ratio": pl.clip_cov_ratio,
            "clip_cov_lb": pl.clip_cov_lb,
            "clip_cov_ub": pl.clip_cov_ub,
            "kl_cov_ratio": pl.kl_cov_ratio,
            "ppo_kl_coef": pl.ppo_kl_coef,
            "dro_beta": pl.dro_beta,
        },
    }
    if pl.loss_mode == "bypass_mode":
        rc = pl.rollout_correction
        out["policy_loss"]["rollout_correction"] = {
            "loss_type": rc.loss_type,
            "rollout_is": rc.rollout_is,
            "rollout_is_threshold": rc.rollout_is_threshold,
            "rollout_is_batch_normalize": rc.rollout_is_batch_normalize,
            "rollout_rs": rc.rollout_rs,
            "rollout_rs_threshold": rc.rollout_rs_threshold,
        }
    return out


def clip_cov_candidates(inputs, dtype, adv_kind, config) -> int:
    """How many tokens clip_cov can choose from (cov in (lb, ub), not clipped by PPO): for the notes."""
    old = tensor(inputs["old"], dtype)
    lp = tensor(inputs["new"], dtype)
    adv = tensor(inputs[adv_kind], dtype)
    mask = torch.tensor(MASK).bool()
    lo = config.clip_ratio_low if config.clip_ratio_low is not None else config.clip_ratio
    hi = config.clip_ratio_high if config.clip_ratio_high is not None else config.clip_ratio
    ratio = torch.exp(lp - old)
    clipped = (-adv * torch.clamp(ratio, 1 - lo, 1 + hi) > -adv * ratio) & mask
    m = mask.to(dtype)
    cov = (adv - (adv * m).sum() / (m.sum() + 1e-8)) * (lp - (lp * m).sum() / (m.sum() + 1e-8))
    pl = config.policy_loss
    sel = (cov > pl.clip_cov_lb) & (cov < pl.clip_cov_ub) & mask & ~clipped
    return int(sel.sum())


POLICY_BATCH = make_logprob_batch(seed=1234)

BASE = {
    # loss: (ActorConfig kwargs, PolicyLossConfig kwargs, advantages, note)
    "vanilla": (
        {},
        {},
        "adv_tok",
        "PPO clip eps 0.2/0.2 and dual clip c=3: eps-clipped tokens and dual-clipped "
        "tokens (ratio > 3, A < 0) both present",
    ),
    "dppo_tv": (
        {},
        {},
        "adv_tok",
        "DPPO binary-TV, TV threshold 0.2 (clip_ratio_low/high); some tokens invalid; "
        "TIS cap config.clip_ratio_c (ActorConfig default 3.0)",
    ),
    "dppo_kl": (
        {},
        {},
        "adv_tok",
        "DPPO binary-KL, KL threshold 0.2 (clip_ratio_low/high); some tokens invalid; "
        "TIS cap config.clip_ratio_c (ActorConfig default 3.0)",
    ),
    "gspo": (
        {},
        {},
        "adv_row",
        "GSPO sequence ratio (mean log-ratio per row) clipped to [0.8, 1.2] on some rows; "
        "row-constant advantages",
    ),
    "sapo": (
        {},
        {},
        "adv_tok",
        "SAPO gates tau_pos 1.0 / tau_neg 1.05; always aggregates with "
        "seq-mean-token-mean whatever loss_agg_mode says",
    ),
    "gpg": ({}, {}, "adv_tok", "GPG: -log_prob * A"),
    "clip_cov": (
        {},
        {"clip_cov_ratio": 0.1},
        "adv_tok",
        "Clip-Cov: clip_cov_ratio 0.1 -> int(0.1*43)=4 tokens "
        "drawn by torch.randperm (global generator, seeded with case_seed) from the candidates with "
        "covariance in (1, 5)",
    ),
    "kl_cov": (
        {},
        {"kl_cov_ratio": 0.1},
        "adv_tok",
        "KL-Cov: kl_cov_ratio 0.1 -> the int(0.1*43)=4 tokens with "
        "the largest covariance get the |log-ratio| penalty (ppo_kl_coef 0.1)",
    ),
    "geo_mean": (
        {},
        {},
        "adv_row",
        "GMPO: token log-ratio clipped to [-0.2, 0.2] by sign(A), geometric mean per "
        "row; torch.mean over all N rows (ignores loss_agg_mode and global_batch_info); row-constant "
        "advantages",
    ),
    "dro": ({}, {"dro_beta": 0.1}, "adv_tok", "DRO: -(log_prob*A - 0.5*beta*log_ratio^2), beta 0.1"),
    "cispo": ({}, {}, "adv_tok", "CISPO: -sg(clip(ratio, 0.8, 1.2)) * A * log_prob; clipped ratios present"),
    "bypass_mode": (
        {},
        {
            "rollout_correction": {
                "loss_type": "reinforce",
                "rollout_is": "token",
                "rollout_is_threshold": 2.0,
                "rollout_rs": "token_k1",
                "rollout_rs_threshold": "0.5_2.0",
            }
        },
        "adv_tok",
        "bypass: REINFORCE with token TIS (2.0) weights from log_prob vs old_log_prob and "
        "token_k1 rejection 0.5_2.0 (some tokens rejected)",
    ),
}


def run_policy_case(
    cid,
    loss_mode,
    agg,
    dtype_key,
    *,
    cfg_kw=None,
    pl_kw=None,
    adv_kind="adv_tok",
    global_batch_info=True,
    loss_scale_factor=None,
    use_is_weights=False,
    note="",
    check=None,
    case_seed=0,
):
    dtype = DTYPES[dtype_key]
    inputs = POLICY_BATCH
    config = actor_config(loss_mode, agg, cfg_kw or {}, pl_kw or {}, loss_scale_factor)
    old = tensor(inputs["old"], dtype)
    lp = tensor(inputs["new"], dtype).requires_grad_(True)
    adv = tensor(inputs[adv_kind], dtype)
    mask = torch.tensor(MASK).to(torch.bool)  # ppo_loss: data["response_mask"].to(bool)
    isw = tensor(inputs["is_w"], dtype) if use_is_weights else None
    if global_batch_info:  # as workers/utils/losses.py ppo_loss sets it
        config.global_batch_info["dp_size"] = 1
        config.global_batch_info["batch_num_tokens"] = int(mask.sum().item())
        config.global_batch_info["global_batch_size"] = N
        config.global_batch_info["loss_scale_factor"] = config.loss_scale_factor
    fn = core_algos.get_policy_loss_fn(config.policy_loss.get("loss_mode", "vanilla"))
    torch.manual_seed(case_seed)
    loss, metrics = fn(
        old_log_prob=old,
        log_prob=lp,
        advantages=adv,
        response_mask=mask,
        loss_agg_mode=config.loss_agg_mode,
        config=config,
        rollout_is_weights=isw,
    )
    loss.backward()
    grad = lp.grad
    if check is not None:
        ok = check(metrics)
        assert ok, f"{cid}: case does not exercise what its note says ({metrics})"
    return {
        "id": cid,
        "loss_mode": loss_mode,
        "loss_agg_mode": agg,
        "dtype": dtype_key,
        "note": note,
        "case_seed": case_seed,
        "config": config_json(config),
        "inputs": {
            "old_log_prob": fl(old),
            "log_prob": fl(lp),
            "advantages": fl(adv),
            "response_mask": ints(mask),
            "response_mask_dtype": dtype_name(mask),
            "rollout_is_weights": fl(isw),
        },
        "outputs": {
            "loss": scalar(loss),
            "loss_dtype": dtype_name(loss),
            "grad_log_prob": fl(grad),
            "metrics": metrics_json(metrics),
        },
    }


def m(metrics, key):
    return float(metrics[key])


BASE_CHECKS = {
    "vanilla": lambda mt: m(mt, "actor/pg_clipfrac") > 0 and m(mt, "actor/pg_clipfrac_lower") > 0,
    "dppo_tv": lambda mt: m(mt, "actor/pg_clipfrac") > 0,
    "dppo_kl": lambda mt: m(mt, "actor/pg_clipfrac") > 0,
    "gspo": lambda mt: 0 < m(mt, "actor/pg_clipfrac") < 1,
    "clip_cov": lambda mt: m(mt, "actor/pg_clipfrac") > 0,
    "geo_mean": lambda mt: m(mt, "actor/pg_clipfrac") + m(mt, "actor/pg_clipfrac_lower") > 0,
    "cispo": lambda mt: m(mt, "actor/pg_clipfrac") > 0,
    "bypass_mode": lambda mt: 0 < m(mt, "rollout_corr/rollout_rs_masked_fraction") < 1,
}


def _policy_grid(add):
    # (a) every loss x every loss_agg_mode x dtype, with ppo_loss's global_batch_info.
    for loss_mode in BASE:
        cfg_kw, pl_kw, adv_kind, note = BASE[loss_mode]
        for agg in AGG_MODES:
            for dk in DTYPES:
                add(
                    f"{loss_mode}/{agg}/{dk}",
                    loss_mode,
                    agg,
                    dk,
                    cfg_kw=cfg_kw,
                    pl_kw=pl_kw,
                    adv_kind=adv_kind,
                    note=note + "; " + MASK_NOTE + "; " + LOGPROB_NOTE + " (rollout_is_weights: 0)",
                    check=BASE_CHECKS.get(loss_mode),
                )


def _policy_scale_factor(add):
    # (b) seq-mean-token-sum-norm with loss_scale_factor 16.
    for loss_mode in BASE:
        cfg_kw, pl_kw, adv_kind, note = BASE[loss_mode]
        for dk in DTYPES:
            add(
                f"{loss_mode}/seq-mean-token-sum-norm/{dk}/loss_scale_factor16",
                loss_mode,
                "seq-mean-token-sum-norm",
                dk,
                cfg_kw=cfg_kw,
                pl_kw=pl_kw,
                adv_kind=adv_kind,
                loss_scale_factor=16,
                note=note + "; loss_scale_factor 16 (divides instead of T=10)",
                check=BASE_CHECKS.get(loss_mode),
            )


def _policy_no_global_batch_info(add):
    # (c) no global_batch_info (config.global_batch_info == {}): agg_loss's standalone defaults.
    for loss_mode in BASE:
        cfg_kw, pl_kw, adv_kind, note = BASE[loss_mode]
        for agg in ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]:
            add(
                f"{loss_mode}/{agg}/float64/no_global_batch_info",
                loss_mode,
                agg,
                "float64",
                cfg_kw=cfg_kw,
                pl_kw=pl_kw,
                adv_kind=adv_kind,
                global_batch_info=False,
                note=note
                + "; global_batch_info empty: token-mean divides by the batch's token count, seq-mean "
                "modes by the number of non-empty rows (7), norm by T=10",
            )


def _policy_is_weights(add):
    # (d) rollout_is_weights passed (positive, zero on masked tokens).
    for loss_mode in BASE:
        cfg_kw, pl_kw, adv_kind, note = BASE[loss_mode]
        extra = "; rollout_is_weights given"
        if loss_mode == "bypass_mode":
            extra += " (bypass_mode ignores them and computes its own)"
        if loss_mode == "geo_mean":
            extra += " (geo_mean turns them into a per-row geometric mean)"
        for dk in DTYPES:
            add(
                f"{loss_mode}/token-mean/{dk}/rollout_is_weights",
                loss_mode,
                "token-mean",
                dk,
                cfg_kw=cfg_kw,
                pl_kw=pl_kw,
                adv_kind=adv_kind,
                use_is_weights=True,
                note=note + extra,
                check=BASE_CHECKS.get(loss_mode),
            )
        if loss_mode in ("vanilla", "geo_mean", "gspo"):
            for dk in DTYPES:
                add(
                    f"{loss_mode}/seq-mean-token-mean/{dk}/rollout_is_weights",
                    loss_mode,
                    "seq-mean-token-mean",
                    dk,
                    cfg_kw=cfg_kw,
                    pl_kw=pl_kw,
                    adv_kind=adv_kind,
                    use_is_weights=True,
                    note=note + extra,
                    check=BASE_CHECKS.get(loss_mode),
                )


def _policy_variants(add):
    # (e) non-default configurations.
    variants = [
        (
            "vanilla",
            "clip_higher",
            {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28},
            {},
            "adv_tok",
            "clip-higher: clip_ratio_low 0.2, clip_ratio_high 0.28",
            lambda mt: m(mt, "actor/pg_clipfrac") > 0 and m(mt, "actor/pg_clipfrac_lower") > 0,
        ),
        (
            "vanilla",
            "clip_ratio_fallback",
            {"clip_ratio": 0.25, "clip_ratio_low": None, "clip_ratio_high": None},
            {},
            "adv_tok",
            "clip_ratio 0.25 with clip_ratio_low/high None (both fall back to clip_ratio)",
            lambda mt: m(mt, "actor/pg_clipfrac") > 0,
        ),
        (
            "vanilla",
            "clip_ratio_c10",
            {"clip_ratio_c": 10.0},
            {},
            "adv_tok",
            "clip_ratio_c 10: dual clip never active",
            lambda mt: m(mt, "actor/pg_clipfrac_lower") == 0,
        ),
        (
            "vanilla",
            "row_advantages",
            {},
            {},
            "adv_row",
            "row-constant advantages",
            lambda mt: m(mt, "actor/pg_clipfrac") > 0,
        ),
        (
            "dppo_tv",
            "clip_ratio_c1.5",
            {"clip_ratio_c": 1.5},
            {},
            "adv_tok",
            "TIS cap 1.5: some valid tokens truncated (pg_clipfrac_lower > 0)",
            lambda mt: m(mt, "actor/pg_clipfrac_lower") > 0 and m(mt, "actor/pg_clipfrac") > 0,
        ),
        (
            "dppo_kl",
            "clip_ratio_c1.5",
            {"clip_ratio_c": 1.5},
            {},
            "adv_tok",
            "TIS cap 1.5: some valid tokens truncated (pg_clipfrac_lower > 0)",
            lambda mt: m(mt, "actor/pg_clipfrac_lower") > 0 and m(mt, "actor/pg_clipfrac") > 0,
        ),
        (
            "dppo_tv",
            "asym_0.1_0.3",
            {"clip_ratio_low": 0.1, "clip_ratio_high": 0.3},
            {},
            "adv_tok",
            "TV thresholds low 0.1 / high 0.3",
            lambda mt: m(mt, "actor/pg_clipfrac") > 0,
        ),
        (
            "dppo_kl",
            "asym_0.02_0.05",
            {"clip_ratio_low": 0.02, "clip_ratio_high": 0.05},
            {},
            "adv_tok",
            "KL thresholds low 0.02 / high 0.05",
            lambda mt: m(mt, "actor/pg_clipfrac") > 0,
        ),
        (
            "gspo",
            "paper_clip",
            {"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4},
            {},
            "adv_row",
            "GSPO paper clip range 3e-4 / 4e-4",
            lambda mt: m(mt, "actor/pg_clipfrac") > 0,
        ),
        (
            "gspo",
            "token_advantages",
            {},
            {},
            "adv_tok",
            "token-varying advantages",
            lambda mt: m(mt, "actor/pg_clipfrac") > 0,
        ),
        (
            "sapo",
            "tau_1.5_3.0",
            {"tau_pos": 1.5, "tau_neg": 3.0},
            {},
            "adv_tok",
            "tau_pos 1.5, tau_neg 3.0",
            None,
        ),
        (
            "clip_cov",
            "default_ratio",
            {},
            {"clip_cov_ratio": 0.0002},
            "adv_tok",
            "clip_cov_ratio 0.0002 -> max(int(0.0002*43),1)=1 token drawn by torch.randperm",
            lambda mt: m(mt, "actor/pg_clipfrac") > 0,
        ),
        (
            "clip_cov",
            "all_candidates",
            {},
            {"clip_cov_ratio": 1.0},
            "adv_tok",
            "clip_cov_ratio 1.0: every candidate is chosen, the result does not depend on torch.randperm",
            lambda mt: m(mt, "actor/pg_clipfrac") > 0,
        ),
        (
            "clip_cov",
            "bounds_0.5_2",
            {},
            {"clip_cov_ratio": 0.1, "clip_cov_lb": 0.5, "clip_cov_ub": 2.0},
            "adv_tok",
            "clip_cov_lb 0.5, clip_cov_ub 2.0",
            lambda mt: m(mt, "actor/pg_clipfrac") > 0,
        ),
        (
            "kl_cov",
            "default_ratio",
            {},
            {"kl_cov_ratio": 0.0002},
            "adv_tok",
            "kl_cov_ratio 0.0002 -> max(1, int(0.0002*43))=1 token penalised",
            None,
        ),
        (
            "kl_cov",
            "coef1",
            {},
            {"kl_cov_ratio": 0.1, "ppo_kl_coef": 1.0},
            "adv_tok",
            "ppo_kl_coef 1.0",
            None,
        ),
        (
            "geo_mean",
            "clip_0.4",
            {"clip_ratio_low": 0.4, "clip_ratio_high": 0.4},
            {},
            "adv_row",
            "GMPO clip 0.4 / 0.4",
            lambda mt: m(mt, "actor/pg_clipfrac") + m(mt, "actor/pg_clipfrac_lower") > 0,
        ),
        (
            "geo_mean",
            "token_advantages",
            {},
            {},
            "adv_tok",
            "token-varying advantages (averaged per row by verl)",
            lambda mt: m(mt, "actor/pg_clipfrac") + m(mt, "actor/pg_clipfrac_lower") > 0,
        ),
        ("dro", "beta0.5", {}, {"dro_beta": 0.5}, "adv_tok", "dro_beta 0.5", None),
        (
            "cispo",
            "clip_higher",
            {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28},
            {},
            "adv_tok",
            "clip_ratio_high 0.28",
            lambda mt: m(mt, "actor/pg_clipfrac") > 0,
        ),
        (
            "cispo",
            "no_lower_clip",
            {"clip_ratio_low": 1.0, "clip_ratio_high": 0.28},
            {},
            "adv_tok",
            "clip_ratio_low 1.0 (lower bound 0), clip_ratio_high 0.28",
            lambda mt: m(mt, "actor/pg_clipfrac") > 0,
        ),
    ]
    for loss_mode, tag, cfg_kw, pl_kw, adv_kind, note, check in variants:
        for dk in DTYPES:
            add(
                f"{loss_mode}/token-mean/{dk}/{tag}",
                loss_mode,
                "token-mean",
                dk,
                cfg_kw=cfg_kw,
                pl_kw=pl_kw,
                adv_kind=adv_kind,
                note=note,
                check=check,
            )


def _policy_bypass(add):
    # (f) bypass_mode: loss_type x rollout_is x threshold x batch_normalize, then rejection sampling.
    for loss_type in ["ppo_clip", "reinforce"]:
        settings = [(None, 2.0, False)]
        for level in ["token", "sequence"]:
            for thr in [2.0, "0.5_5.0"]:
                for bn in [False, True]:
                    settings.append((level, thr, bn))
        for level, thr, bn in settings:
            rc = {
                "loss_type": loss_type,
                "rollout_is": level,
                "rollout_is_threshold": thr,
                "rollout_is_batch_normalize": bn,
                "rollout_rs": None,
                "rollout_rs_threshold": None,
            }
            note = (
                f"bypass {loss_type}: rollout_is {level}, threshold {thr}, batch_normalize {bn}, "
                "no rejection; "
                + (
                    "IS weights only in metrics (ppo_clip does not apply them)"
                    if loss_type == "ppo_clip"
                    else "IS weights multiply -A*log_prob"
                )
            )
            tag = f"{loss_type}/is_{level}/thr_{thr}/bn_{str(bn).lower()}"
            for dk in (
                ["float64", "float32"]
                if (level, thr, bn)
                in [(None, 2.0, False), ("sequence", 2.0, False), ("token", "0.5_5.0", True)]
                else ["float64"]
            ):
                add(
                    f"bypass_mode/token-mean/{dk}/{tag}",
                    "bypass_mode",
                    "token-mean",
                    dk,
                    pl_kw={"rollout_correction": rc},
                    note=note,
                )
    rs_settings = [
        ("token_k1", "0.5_2.0"),
        ("seq_mean_k3", 0.2),
        ("seq_sum_k1,token_k2", "0.3_3.0,0.1"),
    ]
    for loss_type in ["ppo_clip", "reinforce"]:
        for rs, rs_thr in rs_settings:
            rc = {
                "loss_type": loss_type,
                "rollout_is": "token",
                "rollout_is_threshold": 2.0,
                "rollout_is_batch_normalize": False,
                "rollout_rs": rs,
                "rollout_rs_threshold": rs_thr,
            }
            for dk in DTYPES:
                add(
                    f"bypass_mode/token-mean/{dk}/{loss_type}/rs_{rs}/{rs_thr}",
                    "bypass_mode",
                    "token-mean",
                    dk,
                    pl_kw={"rollout_correction": rc},
                    note=f"bypass {loss_type}: token TIS 2.0 and rejection {rs} ({rs_thr}); "
                    "some tokens or rows rejected, some kept",
                    check=lambda mt: 0 < m(mt, "rollout_corr/rollout_rs_masked_fraction") < 1,
                )


def _clip_cov_notes(cases):
    # Notes with the clip_cov candidate counts.
    for c in cases:
        if c["loss_mode"] == "clip_cov":
            cfg = c["config"]
            config = actor_config(
                "clip_cov",
                "token-mean",
                {k: cfg[k] for k in ("clip_ratio", "clip_ratio_low", "clip_ratio_high")},
                {k: cfg["policy_loss"][k] for k in ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub")},
                None,
            )
            adv_kind = "adv_tok"
            n_cand = clip_cov_candidates(POLICY_BATCH, DTYPES[c["dtype"]], adv_kind, config)
            clip_num = max(int(cfg["policy_loss"]["clip_cov_ratio"] * N_TOKENS), 1)
            c["note"] += f" [{n_cand} candidates, {min(clip_num, n_cand)} chosen]"
            assert n_cand > 0
    return cases


def build_policy_cases() -> list:
    registry = list(core_algos.POLICY_LOSS_REGISTRY)
    assert registry == list(BASE), registry
    cases = []
    seed = [1000]

    def add(cid, loss_mode, agg, dtype_key, **kw):
        seed[0] += 1  # torch.manual_seed(case_seed) right before each call (clip_cov's torch.randperm)
        cases.append(run_policy_case(cid, loss_mode, agg, dtype_key, case_seed=seed[0], **kw))

    for section in (
        _policy_grid,
        _policy_scale_factor,
        _policy_no_global_batch_info,
        _policy_is_weights,
        _policy_variants,
        _policy_bypass,
    ):
        section(add)
    return _clip_cov_notes(cases)


# ----------------------------------------------------------------------------------------------
# 2. Advantage estimators
# ----------------------------------------------------------------------------------------------

# N=11 rows x T=10. Groups (uid): p0 rows {0,3,6,10} (spread of scores), p1 rows {1,4,8} (all scores
# equal), p2 rows {2,5,9} (spread; row 9 empty), p3 row {7} (a group of one).
ADV_N = 11
ADV_ROW_LEN = [10, 7, 4, 9, 6, 10, 3, 8, 5, 0, 6]
ADV_HOLES = {0: [3, 4], 3: [5, 6], 4: [2], 7: [4], 10: [1]}
ADV_GROUP = [0, 1, 2, 0, 1, 2, 0, 3, 1, 2, 0]
ADV_MASK = make_mask(ADV_ROW_LEN, ADV_HOLES)
ADV_PROMPT_LEN = 5
ADV_PROMPT_PAD = [0, 2, 1, 0, 3, 0, 1, 2, 0, 4, 1]  # left padding of each prompt
ADV_MASK_NOTE = (
    "11 rows; groups p0 rows 0,3,6,10 (scores spread), p1 rows 1,4,8 (scores all equal), p2 rows 2,5,9 "
    "(spread, row 9 empty), p3 row 7 (single); lengths 10,7,4,9,6,10,3,8,5,0,6 with tool-token zeros in rows "
    "0,3,4,7,10; outcome score at each row's last response position (the empty row's at column -1, as "
    "verl's reward managers index valid_response_length - 1)"
)


def adv_batch(seed: int, binary: bool = False, rows=None) -> dict:
    rng = np.random.default_rng(seed)
    if binary:
        group_scores = {0: [1.0, 0.0, 1.0, 0.0], 1: [1.0, 1.0, 1.0], 2: [0.0, 1.0, 0.0], 3: [1.0]}
    else:
        group_scores = {
            0: list(rng.uniform(-1.0, 2.0, 4)),
            1: [0.75, 0.75, 0.75],
            2: list(rng.uniform(-1.0, 2.0, 3)),
            3: list(rng.uniform(-1.0, 2.0, 1)),
        }
    taken = {g: 0 for g in group_scores}
    scores = np.zeros(ADV_N)
    for i, g in enumerate(ADV_GROUP):
        scores[i] = group_scores[g][taken[g]]
        taken[g] += 1
    tls = np.zeros((ADV_N, T))
    for i, length in enumerate(ADV_ROW_LEN):
        tls[i, length - 1] = scores[i]  # length 0 -> column -1
    p_old = rng.uniform(0.05, 0.95, (ADV_N, T))
    old = np.log(p_old)
    ref = old + rng.uniform(-0.5, 0.5, (ADV_N, T))
    ref = np.minimum(ref, -0.005)
    sum_pi_sq = p_old**2 + rng.uniform(0.0, 1.0, (ADV_N, T)) * (1.0 - p_old) ** 2
    values = rng.uniform(-1.0, 1.0, (ADV_N, T))
    is_w = np.exp(rng.uniform(-0.5, 0.5, (ADV_N, T))) * ADV_MASK
    reward_baselines = rng.uniform(-0.5, 1.0, ADV_N)
    components = {
        "format_reward": rng.choice([0.0, 0.5, 1.0], ADV_N),
        "accuracy_reward": rng.choice([0.0, 1.0], ADV_N),
        "length_reward": rng.uniform(-1.0, 0.0, ADV_N),
    }
    components["accuracy_reward"][[1, 4, 8]] = 1.0  # group p1 equal in every component
    components["format_reward"][[1, 4, 8]] = 0.5
    components["length_reward"][[1, 4, 8]] = -0.25
    prompts = rng.integers(10, 1000, (ADV_N, ADV_PROMPT_LEN))
    attn_prompt = np.ones((ADV_N, ADV_PROMPT_LEN), dtype=np.int64)
    for i, pad in enumerate(ADV_PROMPT_PAD):
        attn_prompt[i, :pad] = 0
        prompts[i, :pad] = 0
    attn_resp = make_mask(ADV_ROW_LEN, {}, T)  # tool tokens are attended to
    out = {
        "token_level_scores": tls,
        "old": old,
        "ref": ref,
        "sum_pi_sq": sum_pi_sq,
        "values": values,
        "is_w": is_w,
        "reward_baselines": reward_baselines,
        "components": components,
        "prompts": prompts,
        "attention_mask": np.concatenate([attn_prompt, attn_resp], axis=1),
        "mask": ADV_MASK,
        "group": np.array(ADV_GROUP),
    }
    if rows is not None:
        for k in list(out):
            if k == "components":
                out[k] = {ck: cv[rows] for ck, cv in out[k].items()}
            else:
                out[k] = out[k][rows]
    return out


def _adv_data(batch, dtype, *, kl, otb, use_values, use_baselines, use_is_weights, gdpo_keys):
    """The DataProto that the trainer hands to compute_advantage."""
    mask = torch.tensor(batch["mask"], dtype=torch.int64)  # response_mask as the trainer has it
    uids = np.array([f"p{g}" for g in batch["group"]], dtype=object)
    tensors = {"response_mask": mask, "token_level_scores": tensor(batch["token_level_scores"], dtype)}
    non_tensors = {"uid": uids}
    if kl is not None or otb:
        tensors["old_log_probs"] = tensor(batch["old"], dtype)
    if kl is not None:
        tensors["ref_log_prob"] = tensor(batch["ref"], dtype)
    if use_values:
        tensors["values"] = tensor(batch["values"], dtype)
    if use_baselines:
        tensors["reward_baselines"] = tensor(batch["reward_baselines"], dtype)
    if otb:
        tensors["sum_pi_squared"] = tensor(batch["sum_pi_sq"], dtype)
    if use_is_weights:
        tensors["rollout_is_weights"] = tensor(batch["is_w"], dtype)
    if gdpo_keys:
        tensors["prompts"] = torch.tensor(batch["prompts"], dtype=torch.int64)
        tensors["attention_mask"] = torch.tensor(batch["attention_mask"], dtype=torch.int64)
        for k in gdpo_keys:
            non_tensors[k] = np.array(batch["components"][k])
    data = DataProto.from_dict(tensors=tensors, non_tensors=non_tensors)
    return data, tensors, mask, uids


def _run_estimator(data, algo, estimator, direct_kwargs):
    """compute_advantage as ray_trainer's fit() calls it, or the estimator itself with direct_kwargs."""
    error = None
    if direct_kwargs is None:
        call = "verl.trainer.ppo.ray_trainer.compute_advantage"
        try:
            data = compute_advantage(
                data,
                adv_estimator=algo.adv_estimator,
                gamma=algo.gamma,
                lam=algo.lam,
                num_repeat=1,
                norm_adv_by_std_in_grpo=algo.get("norm_adv_by_std_in_grpo", True),
                config=algo,
            )
        except Exception as exc:  # recorded for the cases that verl rejects
            error = f"{type(exc).__name__}: {exc}"
    else:
        call = f"verl.trainer.ppo.core_algos.ADV_ESTIMATOR_REGISTRY['{estimator}'] called directly"
        fn = core_algos.get_adv_estimator_fn(estimator)
        kwargs = {
            "token_level_rewards": data.batch["token_level_rewards"],
            "response_mask": data.batch["response_mask"],
            "config": algo,
            "index": data.non_tensor_batch["uid"],
            "sum_pi_squared": data.batch["sum_pi_squared"],
            "old_log_probs": data.batch["old_log_probs"],
            "rollout_is_weights": data.batch.get("rollout_is_weights", None),
            **direct_kwargs,
        }
        advantages, returns = fn(**kwargs)
        data.batch["advantages"] = advantages
        data.batch["returns"] = returns
    return data, call, error


def run_adv_case(
    cid,
    estimator,
    dtype_key,
    *,
    batch,
    algo_kw=None,
    kl=None,
    use_values=False,
    use_baselines=False,
    otb=False,
    use_is_weights=False,
    gdpo_keys=None,
    gdpo_weights=None,
    direct_kwargs=None,
    note="",
    expect_error=None,
):
    dtype = DTYPES[dtype_key]
    algo = AlgoConfig(
        adv_estimator=estimator,
        gdpo_reward_keys=gdpo_keys,
        gdpo_reward_weights=gdpo_weights,
        **(algo_kw or {}),
    )
    n_rows = batch["mask"].shape[0]
    data, tensors, mask, uids = _adv_data(
        batch,
        dtype,
        kl=kl,
        otb=otb,
        use_values=use_values,
        use_baselines=use_baselines,
        use_is_weights=use_is_weights,
        gdpo_keys=gdpo_keys,
    )

    kl_metrics = None
    if kl is not None:  # algorithm.use_kl_in_reward: ray_trainer.apply_kl_penalty
        kl_ctrl = core_algos.FixedKLController(kl_coef=kl["kl_coef"])
        data, kl_metrics = apply_kl_penalty(data, kl_ctrl=kl_ctrl, kl_penalty=kl["kl_penalty"])
    else:
        data.batch["token_level_rewards"] = data.batch["token_level_scores"]
    token_level_rewards = data.batch["token_level_rewards"].clone()

    data, call, error = _run_estimator(data, algo, estimator, direct_kwargs)
    assert (error is None) == (expect_error is None), f"{cid}: {error}"

    inputs = {
        "index": [int(g) for g in batch["group"]],
        "uid": [str(u) for u in uids],
        "response_mask": ints(mask),
        "response_mask_dtype": dtype_name(mask),
        "token_level_scores": fl(tensors["token_level_scores"]),
        "token_level_rewards": fl(token_level_rewards),
        "values": fl(tensors.get("values")),
        "reward_baselines": fl(tensors.get("reward_baselines")),
        "old_log_probs": fl(tensors.get("old_log_probs")),
        "ref_log_prob": fl(tensors.get("ref_log_prob")),
        "sum_pi_squared": fl(tensors.get("sum_pi_squared")),
        "rollout_is_weights": fl(tensors.get("rollout_is_weights")),
        "gdpo": None,
        "kl_in_reward": kl,
        "kwargs": {
            "gamma": algo.gamma,
            "lam": algo.lam,
            "norm_adv_by_std_in_grpo": algo.norm_adv_by_std_in_grpo,
            "gdpo_reward_keys": gdpo_keys,
            "gdpo_reward_weights": gdpo_weights,
            **({k: v for k, v in direct_kwargs.items()} if direct_kwargs else {}),
        },
    }
    if gdpo_keys:
        inputs["gdpo"] = {
            "components": {k: [float(x) for x in batch["components"][k]] for k in gdpo_keys},
            "prompt_length": int(tensors["prompts"].shape[1]),
            "prompts": ints(tensors["prompts"]),
            "attention_mask": ints(tensors["attention_mask"]),
        }
    case = {
        "id": cid,
        "estimator": estimator,
        "dtype": dtype_key,
        "call": call,
        "note": note,
        "inputs": inputs,
    }
    if error is not None:
        case["outputs"] = {"error": error}
    else:
        case["outputs"] = {
            "advantages": fl(data.batch["advantages"]),
            "returns": fl(data.batch["returns"]),
            "advantages_dtype": dtype_name(data.batch["advantages"]),
            "returns_dtype": dtype_name(data.batch["returns"]),
            "kl_metrics": metrics_json(kl_metrics) if kl_metrics else None,
        }
    assert n_rows == len(uids)
    return case


def load_v1_multi_trajectories():
    """verl/trainer/ppo/v1/utils.py's compute_advantage_for_multi_trajectories. The v1 package's
    __init__ needs TransferQueue; utils.py itself only takes a string constant from replay_buffer.py,
    read here from verl's own source."""
    import verl.trainer.ppo as ppo_pkg

    v1_dir = Path(ppo_pkg.__file__).parent / "v1"
    const = None
    for node in ast.parse((v1_dir / "replay_buffer.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "DAPO_FILTERED_REWARD_COUNTS_KEY" for t in node.targets
        ):
            const = ast.literal_eval(node.value)
    assert const is not None
    saved = {
        k: sys.modules.get(k)
        for k in ("verl.trainer.ppo.v1", "verl.trainer.ppo.v1.replay_buffer", "verl.trainer.ppo.v1.utils")
    }
    pkg = types.ModuleType("verl.trainer.ppo.v1")
    pkg.__path__ = [str(v1_dir)]
    rb = types.ModuleType("verl.trainer.ppo.v1.replay_buffer")
    rb.DAPO_FILTERED_REWARD_COUNTS_KEY = const
    sys.modules["verl.trainer.ppo.v1"] = pkg
    sys.modules["verl.trainer.ppo.v1.replay_buffer"] = rb
    try:
        spec = importlib.util.spec_from_file_location("verl.trainer.ppo.v1.utils", v1_dir / "utils.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        return mod.compute_advantage_for_multi_trajectories
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


# Multi-trajectory batch (v1): keys "{uid}_{session}_{turn}"; the last turn of each session is the
# one that enters GRPO, and its advantage is broadcast to the session's other rows.
MT_KEYS = ["a_s0_0", "b_s0_0", "a_s0_1", "a_s1_0", "b_s0_1", "a_s2_0", "b_s1_0", "a_s2_2", "b_s2_0"]
MT_ROW_LEN = [6, 5, 9, 7, 8, 0, 10, 4, 6]
MT_HOLES = {2: [2, 3], 6: [4]}


def run_multi_traj_case(cid, dtype_key, norm, seed=77):
    fn = load_v1_multi_trajectories()
    dtype = DTYPES[dtype_key]
    rng = np.random.default_rng(seed)
    n = len(MT_KEYS)
    mask = torch.tensor(make_mask(MT_ROW_LEN, MT_HOLES), dtype=torch.int64)
    scores = rng.uniform(-1.0, 2.0, n)
    tls = np.zeros((n, T))
    for i, length in enumerate(MT_ROW_LEN):
        tls[i, length - 1] = scores[i]
    uids = np.array([k.rsplit("_", 2)[0] for k in MT_KEYS], dtype=object)
    data = DataProto.from_dict(
        tensors={"response_mask": mask, "token_level_rewards": tensor(tls, dtype)}, non_tensors={"uid": uids}
    )
    algo = AlgoConfig(adv_estimator="grpo", norm_adv_by_std_in_grpo=norm)
    data = fn(
        data,
        batch_keys=list(MT_KEYS),
        adv_estimator=algo.adv_estimator,
        gamma=algo.gamma,
        lam=algo.lam,
        num_repeat=1,
        norm_adv_by_std_in_grpo=algo.get("norm_adv_by_std_in_grpo", True),
        config=algo,
    )
    return {
        "id": cid,
        "estimator": "grpo",
        "dtype": dtype_key,
        "call": "verl.trainer.ppo.v1.utils.compute_advantage_for_multi_trajectories",
        "note": "multi-trajectory GRPO: batch_keys '{uid}_{session}_{turn}'; only each session's last turn "
        "(highest turn index) enters the group statistics; its advantage (at its first response "
        "token) is broadcast to every row of the session; row 5 (a_s2_0) is empty",
        "inputs": {
            "batch_keys": list(MT_KEYS),
            "uid": [str(u) for u in uids],
            "response_mask": ints(mask),
            "response_mask_dtype": dtype_name(mask),
            "token_level_rewards": fl(tensor(tls, dtype)),
            "kwargs": {"norm_adv_by_std_in_grpo": norm, "gamma": algo.gamma, "lam": algo.lam},
        },
        "outputs": {
            "advantages": fl(data.batch["advantages"]),
            "returns": fl(data.batch["returns"]),
            "advantages_dtype": dtype_name(data.batch["advantages"]),
            "returns_dtype": dtype_name(data.batch["returns"]),
        },
    }


def build_advantage_cases() -> list:
    cases = []
    main = adv_batch(seed=4321)
    binary = adv_batch(seed=4321, binary=True)
    no_single = [i for i, g in enumerate(ADV_GROUP) if g != 3]
    main_ns = adv_batch(seed=4321, rows=no_single)
    binary_ns = adv_batch(seed=4321, binary=True, rows=no_single)
    KL = {"kl_coef": 0.05, "kl_penalty": "kl"}
    KL3 = {"kl_coef": 0.1, "kl_penalty": "low_var_kl"}
    kl_note = (
        "; rewards = scores - kl_coef * kl_penalty(old_log_probs, ref_log_prob) * response_mask "
        "(ray_trainer.apply_kl_penalty, FixedKLController)"
    )

    def add(cid, est, note, batch=main, both=True, **kw):
        for dk in DTYPES if both else ["float64"]:
            cases.append(run_adv_case(f"{est}/{dk}/{cid}", est, dk, batch=batch, note=note, **kw))

    registry = list(core_algos.ADV_ESTIMATOR_REGISTRY)
    base_note = ADV_MASK_NOTE

    add(
        "gamma1_lam1",
        "gae",
        "GAE gamma 1, lam 1, values per token; whitened over the batch; " + base_note,
        algo_kw={"gamma": 1.0, "lam": 1.0},
        use_values=True,
    )
    add(
        "gamma0.99_lam0.95",
        "gae",
        "GAE gamma 0.99, lam 0.95; " + base_note,
        algo_kw={"gamma": 0.99, "lam": 0.95},
        use_values=True,
    )
    add(
        "gamma0.99_lam0.95_kl",
        "gae",
        "GAE gamma 0.99, lam 0.95 with KL penalty in the reward" + kl_note,
        algo_kw={"gamma": 0.99, "lam": 0.95},
        use_values=True,
        kl=KL,
    )

    add("norm_std", "grpo", "GRPO (r - mean) / (std + 1e-6); " + base_note)
    add(
        "no_norm_std",
        "grpo",
        "GRPO without std (Dr.GRPO); " + base_note,
        algo_kw={"norm_adv_by_std_in_grpo": False},
    )
    add("norm_std_kl", "grpo", "GRPO with KL penalty in the reward (scores are row sums)" + kl_note, kl=KL)
    add(
        "no_norm_std_k3",
        "grpo",
        "GRPO without std, low_var_kl penalty in the reward" + kl_note,
        algo_kw={"norm_adv_by_std_in_grpo": False},
        kl=KL3,
    )
    add("binary_norm_std", "grpo", "GRPO on 0/1 scores", batch=binary)

    add(
        "norm_std",
        "grpo_vectorized",
        "vectorized GRPO (group stats in float32 by verl.utils.group_mean_std); " + base_note,
    )
    add(
        "no_norm_std_config",
        "grpo_vectorized",
        "algorithm.norm_adv_by_std_in_grpo False: compute_advantage does "
        "not pass it to this estimator, which keeps its default True",
        algo_kw={"norm_adv_by_std_in_grpo": False},
    )
    add("norm_std_kl", "grpo_vectorized", "vectorized GRPO with KL penalty in the reward" + kl_note, kl=KL)

    add(
        "two_keys",
        "gdpo",
        "GDPO, gdpo_reward_keys [format_reward, accuracy_reward], no weights: each component "
        "placed at attention_mask-derived last response position, GRPO-normalized per component, "
        "summed, then whitened over the batch; token_level_rewards unused",
        gdpo_keys=["format_reward", "accuracy_reward"],
    )
    add(
        "three_keys_weights",
        "gdpo",
        "GDPO, three components with gdpo_reward_weights [1.0, 0.5, 2.0]",
        gdpo_keys=["format_reward", "accuracy_reward", "length_reward"],
        gdpo_weights=[1.0, 0.5, 2.0],
    )

    add(
        "norm_std",
        "grpo_passk",
        "Pass@k GRPO: only each group's best row gets (max - second max) / (std + 1e-6); "
        "no single-row group (it needs >= 2 rows)",
        batch=main_ns,
    )
    add(
        "no_norm_std",
        "grpo_passk",
        "Pass@k without std (read from config.norm_adv_by_std_in_grpo)",
        batch=main_ns,
        algo_kw={"norm_adv_by_std_in_grpo": False},
    )
    add(
        "binary_ties",
        "grpo_passk",
        "Pass@k on 0/1 scores: ties between max and second max give 0",
        batch=binary_ns,
    )
    add(
        "single_row_group_error",
        "grpo_passk",
        "a group of one row: verl raises",
        both=False,
        expect_error="ValueError",
    )

    for est, what in [
        ("rloo", "RLOO leave-one-out baseline (a single-row group keeps its raw score)"),
        ("rloo_vectorized", "vectorized RLOO (a single-row group gets 0)"),
        ("opo", "OPO length-weighted group baseline"),
        ("gpg", "GPG: alpha = N / count_nonzero(scores) times (r - group mean), f_norm 1"),
        ("reinforce_plus_plus_baseline", "REINFORCE++ with group-mean baseline, whitened over the batch"),
    ]:
        add("outcome", est, what + "; " + base_note)
        add("kl", est, what + " with KL penalty in the reward" + kl_note, kl=KL)

    add(
        "gamma1",
        "reinforce_plus_plus",
        "REINFORCE++ discounted returns (gamma 1, tool tokens carry the return "
        "through), whitened; " + base_note,
        algo_kw={"gamma": 1.0},
    )
    add("gamma0.5", "reinforce_plus_plus", "REINFORCE++ gamma 0.5", algo_kw={"gamma": 0.5})
    add(
        "gamma1_kl",
        "reinforce_plus_plus",
        "REINFORCE++ gamma 1 with KL penalty in the reward" + kl_note,
        algo_kw={"gamma": 1.0},
        kl=KL,
    )
    add(
        "gamma0.5_k3",
        "reinforce_plus_plus",
        "REINFORCE++ gamma 0.5 with low_var_kl penalty" + kl_note,
        algo_kw={"gamma": 0.5},
        kl=KL3,
    )

    add(
        "baselines",
        "remax",
        "ReMax: reward-to-go minus reward_baselines (per row) on response tokens; " + base_note,
        use_baselines=True,
    )
    add("baselines_kl", "remax", "ReMax with KL penalty in the reward" + kl_note, use_baselines=True, kl=KL)

    for est in ["optimal_token_baseline", "tir_optimal_token_baseline"]:
        add(
            "no_is/zero_tail",
            est,
            "optimal token baseline, sum_pi_squared between pi_t^2 and 1, no IS weights, "
            "handle_zero_tail True (compute_advantage does not pass it: the default); " + base_note,
            otb=True,
        )
        add(
            "is/zero_tail",
            est,
            "optimal token baseline with rollout_is_weights (W scaled by w^2), handle_zero_tail True",
            otb=True,
            use_is_weights=True,
        )
        add(
            "no_is/no_zero_tail",
            est,
            "handle_zero_tail False (passed directly; the trainer keeps the default)",
            otb=True,
            direct_kwargs={"handle_zero_tail": False},
        )
        add(
            "is/no_zero_tail",
            est,
            "rollout_is_weights, handle_zero_tail False (passed directly)",
            otb=True,
            use_is_weights=True,
            direct_kwargs={"handle_zero_tail": False},
        )
        add(
            "no_is/zero_tail_kl",
            est,
            "optimal token baseline with KL penalty in the reward" + kl_note,
            otb=True,
            kl=KL,
        )

    for dk in DTYPES:
        for norm in [True, False]:
            cases.append(
                run_multi_traj_case(f"grpo/{dk}/multi_trajectories/norm_{str(norm).lower()}", dk, norm)
            )

    covered = {c["estimator"] for c in cases}
    assert covered == set(registry), set(registry) - covered
    return cases


# ----------------------------------------------------------------------------------------------
# 3. Rollout correction
# ----------------------------------------------------------------------------------------------

RC_BATCH = make_logprob_batch(seed=5678)


def run_rc_case(cid, dtype_key, kwargs, note, check=None):
    dtype = DTYPES[dtype_key]
    rollout = tensor(RC_BATCH["old"], dtype)  # pi_rollout
    train = tensor(RC_BATCH["new"], dtype)  # pi_train (old_log_prob)
    mask = torch.tensor(MASK, dtype=torch.int64)
    proto, new_mask, metrics = rch.compute_rollout_correction_and_rejection_mask(
        old_log_prob=train, rollout_log_prob=rollout, response_mask=mask, **kwargs
    )
    weights = proto.batch["rollout_is_weights"] if proto is not None else None
    if check is not None:
        assert check(weights, new_mask, metrics), f"{cid}: not exercised ({metrics})"
    return {
        "id": cid,
        "function": "compute_rollout_correction_and_rejection_mask",
        "dtype": dtype_key,
        "note": note,
        "inputs": {
            "old_log_prob": fl(train),
            "rollout_log_prob": fl(rollout),
            "response_mask": ints(mask),
            "response_mask_dtype": dtype_name(mask),
            "kwargs": kwargs,
        },
        "outputs": {
            "rollout_is_weights": fl(weights),
            "rollout_is_weights_dtype": dtype_name(weights) if weights is not None else None,
            "response_mask": ints(new_mask),
            "response_mask_dtype": dtype_name(new_mask),
            "metrics": metrics_json(metrics),
        },
    }


RC_NOTE = MASK_NOTE + "; " + LOGPROB_NOTE.replace("log_prob - old_log_prob", "log(pi_train/pi_rollout)")


def _rc_rejects(w, new_mask, metrics):
    return 0 < metrics["rollout_corr/rollout_rs_masked_fraction"] < 1


def _rc_is_cases() -> list:
    cases = []
    base_note = RC_NOTE
    is_settings = [(None, 2.0, False)]
    for level in ["token", "sequence"]:
        for thr in [2.0, "0.5_5.0"]:
            for bn in [False, True]:
                is_settings.append((level, thr, bn))

    def is_check(level, thr):
        if level is None:
            return lambda w, nm, mt: w is None
        if isinstance(thr, str):  # IcePop: some weights zeroed, some kept
            return lambda w, nm, mt: mt["rollout_corr/rollout_is_oob_ratio"] > 0 and (w > 0).any()
        return lambda w, nm, mt: mt["rollout_corr/rollout_is_ratio_fraction_high"] > 0

    for dk in DTYPES:
        for level, thr, bn in is_settings:
            kw = {
                "rollout_is": level,
                "rollout_is_threshold": thr,
                "rollout_is_batch_normalize": bn,
                "rollout_rs": None,
                "rollout_rs_threshold": None,
            }
            what = (
                "no IS weights (metrics only)"
                if level is None
                else (
                    f"{level}-level IS, "
                    + ("IcePop (zero outside [0.5, 5.0])" if isinstance(thr, str) else "TIS (clamp at 2.0)")
                    + (", batch-normalized to mean 1" if bn else "")
                )
            )
            cases.append(
                run_rc_case(
                    f"is_{level}/thr_{thr}/bn_{str(bn).lower()}/{dk}",
                    dk,
                    kw,
                    what + "; " + base_note,
                    is_check(level, thr),
                )
            )

    return cases


def _rc_rs_cases() -> list:
    cases = []
    base_note = RC_NOTE
    rs_single = [
        ("token_k1", "0.5_2.0"),
        ("token_k1", 1.5),
        ("token_k1", "0.8_1.5"),
        ("token_k2", 0.1),
        ("token_k3", 0.1),
        ("seq_sum_k1", "0.3_3.0"),
        ("seq_sum_k1", 3.0),
        ("seq_sum_k2", 1.1),
        ("seq_sum_k3", 1.6),
        ("seq_mean_k1", "0.8_1.25"),
        ("seq_mean_k1", 1.15),
        ("seq_mean_k2", 0.17),
        ("seq_mean_k3", 0.2),
        ("seq_max_k2", 0.75),
        ("seq_max_k3", 1.2),
    ]
    rs_combo = [("token_k1,seq_mean_k3", "0.5_2.0,0.2"), ("seq_max_k2,seq_sum_k3", 1.2)]
    rejects = _rc_rejects
    assert {o for o, _ in rs_single} == rch.SUPPORTED_ROLLOUT_RS_OPTIONS
    for dk in DTYPES:
        for rs, thr in rs_single + rs_combo:
            kw = {
                "rollout_is": None,
                "rollout_is_threshold": 2.0,
                "rollout_is_batch_normalize": False,
                "rollout_rs": rs,
                "rollout_rs_threshold": thr,
            }
            note = f"rejection {rs} threshold {thr!r}; some tokens or rows rejected, some kept"
            if rs.endswith("k1") and not isinstance(thr, str):
                note += f" (single float: lower bound 1/{thr})"
            if rs == "token_k1" and thr == "0.8_1.5":
                note += " (asymmetric bounds: verl compares -log r with [log 0.8, log 1.5])"
            if "," in rs:
                note += "; combined options (AND)" + (", one shared threshold" if "," not in str(thr) else "")
            cases.append(run_rc_case(f"rs_{rs}/thr_{thr}/{dk}", dk, kw, note + "; " + base_note, rejects))
        for level, rs, thr in [("token", "token_k1", "0.5_2.0"), ("sequence", "seq_mean_k3", 0.2)]:
            kw = {
                "rollout_is": level,
                "rollout_is_threshold": 2.0,
                "rollout_is_batch_normalize": False,
                "rollout_rs": rs,
                "rollout_rs_threshold": thr,
            }
            cases.append(
                run_rc_case(
                    f"is_{level}+rs_{rs}/{dk}",
                    dk,
                    kw,
                    f"{level} TIS 2.0 together with rejection {rs} {thr!r} (weights are not "
                    "zeroed by the rejection; the mask is)",
                    rejects,
                )
            )

    return cases


def _rc_offpolicy_cases() -> list:
    cases = []
    # compute_offpolicy_metrics alone.
    for dk in DTYPES:
        dtype = DTYPES[dk]
        for tag, rollout_arr, mask_arr, note in [
            (
                "batch",
                RC_BATCH["old"],
                MASK,
                "off-policy metrics of the shared batch (empty row included in the per-row means)",
            ),
            ("no_rollout", None, MASK, "rollout_log_prob None: training perplexity only"),
            ("no_empty_row", RC_BATCH["old"], make_mask([10, 7, 4, 9, 3, 6, 10, 2]), "no empty row"),
        ]:
            train = tensor(RC_BATCH["new"], dtype)
            rollout = tensor(rollout_arr, dtype) if rollout_arr is not None else None
            mask = torch.tensor(mask_arr, dtype=torch.int64)
            metrics = rch.compute_offpolicy_metrics(
                old_log_prob=train, rollout_log_prob=rollout, response_mask=mask
            )
            cases.append(
                {
                    "id": f"offpolicy_metrics/{tag}/{dk}",
                    "function": "compute_offpolicy_metrics",
                    "dtype": dk,
                    "note": note,
                    "inputs": {
                        "old_log_prob": fl(train),
                        "rollout_log_prob": fl(rollout),
                        "response_mask": ints(mask),
                        "response_mask_dtype": dtype_name(mask),
                        "kwargs": {},
                    },
                    "outputs": {"metrics": metrics_json(metrics)},
                }
            )
    return cases


def build_rollout_correction_cases() -> list:
    return _rc_is_cases() + _rc_rs_cases() + _rc_offpolicy_cases()


# ----------------------------------------------------------------------------------------------
# 4. kl_penalty and agg_loss
# ----------------------------------------------------------------------------------------------


def build_kl_agg_cases() -> list:
    cases = []
    rng = np.random.default_rng(9012)
    logprob = np.log(rng.uniform(0.05, 0.95, (N, T)))
    ref = logprob + rng.uniform(-0.8, 0.8, (N, T))
    ref = np.minimum(ref, -0.005)
    # large differences: low_var_kl's clamps (kl to [-20, 20], value to <= 10) act here
    ref[0, 0], logprob[0, 0] = -30.0, -2.0
    ref[1, 1], logprob[1, 1] = -1.0, -26.0
    ref[2, 2], logprob[2, 2] = -5.0, -1.0
    ref[3, 3], logprob[3, 3] = -0.5, -4.5
    names = ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"]
    for dk, dtype in DTYPES.items():
        for name in names + [n + "+" for n in names] + ["full"]:
            lp = tensor(logprob, dtype).requires_grad_(True)
            rf = tensor(ref, dtype)
            case = {
                "id": f"kl_penalty/{name}/{dk}",
                "function": "kl_penalty",
                "kl_penalty": name,
                "dtype": dk,
                "note": "logprob vs ref_logprob, no mask; four tokens with |difference| 4 to 28 "
                "(low_var_kl clamps); gradient of value.sum() with respect to logprob",
                "inputs": {"logprob": fl(lp), "ref_logprob": fl(rf)},
            }
            try:
                val = core_algos.kl_penalty(lp, rf, kl_penalty=name)
            except NotImplementedError as exc:
                case["outputs"] = {"error": f"NotImplementedError: {exc}"}
                cases.append(case)
                continue
            val.sum().backward()
            case["outputs"] = {"value": fl(val), "value_dtype": dtype_name(val), "grad_logprob": fl(lp.grad)}
            cases.append(case)

    loss_mat = rng.uniform(-2.0, 2.0, (N, T))
    settings = [
        ("defaults", {}),
        (
            "global_dp1",
            {"dp_size": 1, "batch_num_tokens": N_TOKENS, "global_batch_size": N, "loss_scale_factor": None},
        ),
        (
            "global_dp2",
            {
                "dp_size": 2,
                "batch_num_tokens": 2 * N_TOKENS + 5,
                "global_batch_size": 2 * N,
                "loss_scale_factor": None,
            },
        ),
    ]
    for dk, dtype in DTYPES.items():
        for mask_kind in ["bool", "float"]:
            for agg in AGG_MODES:
                extra = (
                    [
                        ("lsf16", {"loss_scale_factor": 16}),
                        (
                            "global_dp2_lsf16",
                            {
                                "dp_size": 2,
                                "batch_num_tokens": 2 * N_TOKENS + 5,
                                "global_batch_size": 2 * N,
                                "loss_scale_factor": 16,
                            },
                        ),
                    ]
                    if agg == "seq-mean-token-sum-norm"
                    else []
                )
                for tag, kw in settings + extra:
                    if mask_kind == "float" and tag != "defaults":
                        continue
                    lm = tensor(loss_mat, dtype).requires_grad_(True)
                    mask = torch.tensor(MASK).bool() if mask_kind == "bool" else tensor(MASK, dtype)
                    loss = core_algos.agg_loss(loss_mat=lm, loss_mask=mask, loss_agg_mode=agg, **kw)
                    loss.backward()
                    cases.append(
                        {
                            "id": f"agg_loss/{agg}/{dk}/{tag}/mask_{mask_kind}",
                            "function": "agg_loss",
                            "loss_agg_mode": agg,
                            "dtype": dk,
                            "note": MASK_NOTE + "; masked entries of loss_mat are nonzero",
                            "inputs": {
                                "loss_mat": fl(lm),
                                "loss_mask": ints(mask),
                                "loss_mask_dtype": dtype_name(mask),
                                "kwargs": kw,
                            },
                            "outputs": {
                                "loss": scalar(loss),
                                "loss_dtype": dtype_name(loss),
                                "grad_loss_mat": fl(lm.grad),
                            },
                        }
                    )
        for agg in ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]:
            lm = tensor(loss_mat, dtype)
            mask = torch.tensor(MASK).bool()
            kw = {"dp_size": 2}
            try:
                core_algos.agg_loss(loss_mat=lm, loss_mask=mask, loss_agg_mode=agg, **kw)
                raise AssertionError("expected ValueError")
            except ValueError as exc:
                err = f"ValueError: {exc}"
            cases.append(
                {
                    "id": f"agg_loss/{agg}/{dk}/dp2_missing_global/mask_bool",
                    "function": "agg_loss",
                    "loss_agg_mode": agg,
                    "dtype": dk,
                    "note": "dp_size 2 without the global count: verl raises",
                    "inputs": {
                        "loss_mat": fl(lm),
                        "loss_mask": ints(mask),
                        "loss_mask_dtype": "bool",
                        "kwargs": kw,
                    },
                    "outputs": {"error": err},
                }
            )
    return cases


# ----------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="tests/engine/verl_reference", help="output folder")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, build in [
        ("policy_losses.json", build_policy_cases),
        ("advantage_estimators.json", build_advantage_cases),
        ("rollout_correction.json", build_rollout_correction_cases),
        ("kl_and_agg.json", build_kl_agg_cases),
    ]:
        cases = build()
        ids = [c["id"] for c in cases]
        assert len(ids) == len(set(ids)), [i for i in ids if ids.count(i) > 1]
        write_json(out / name, cases)
        print(f"{out / name}: {len(cases)} cases, {(out / name).stat().st_size} bytes")


if __name__ == "__main__":
    main()
