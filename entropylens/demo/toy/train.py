"""The toy GRPO-family loop, recorded by entropylens. Reads top to bottom like nanoGPT's train.py.

Per step: prompts x G samples at temperature T -> rewards -> group-normalised advantages ->
one no-grad pass of the old policy (log-probs and full-vocabulary entropy) -> ``updates``
mini-batch policy updates with ``policy_loss`` (any method, ERC, entropy bonus, dual-clip, a beta1
schedule), each recorded with exact logit-gradient norms (policy_update: closed form from the
sensitivity pass), the global grad norm before clipping and the lr; then the step's sequences (with each
response's text) and reward. The vocabulary's texts (task.TOKEN_NAMES) go into run.json.
"""

from __future__ import annotations

import contextlib
import copy
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ... import Recorder
from ...integrations.torch import entropy_bonus_effect, old_policy_pass, policy_update
from . import task
from .config import ToyConfig
from .model import build_model, response_logits, sample
from .sampler import sampler_logits, sampler_logprobs, tis_weight

if TYPE_CHECKING:
    from ...integrations.loss_hook import LossHook
    from ...rl.forking import AdaptiveEntropyCoef

_WARM_CACHE: dict[tuple, dict] = {}


@dataclass
class RunResult:
    run: str
    path: Path
    rewards: list[float]
    entropies: list[float]
    seconds: float
    pid: int = field(default_factory=os.getpid)  # the process that trained it
    threads: int = 0  # torch intra-op threads it trained with


@contextlib.contextmanager
def torch_threads(n: int = 1):
    """Run the block with ``n`` intra-op threads, then restore. A toy model is far too small to
    gain from more than one thread, and extra threads spin against other processes on a busy
    machine (the demo parallelises over runs in worker processes instead)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def warm_key(cfg: ToyConfig) -> tuple:
    """What the warm start depends on: runs with equal keys start from the same weights."""
    return (cfg.seed, cfg.hidden, cfg.layers, cfg.heads, cfg.sft_steps, cfg.sft_lr)


def warm_start(cfg: ToyConfig, on_progress: Callable[[int, int], None] | None = None):
    """Model after ``sft_steps`` of supervised training on noisy targets. Deterministic per
    :func:`warm_key`; cached in-process so several runs share the same start (the demo computes it
    once and hands the weights to its worker processes through :func:`set_warm_state`).
    ``on_progress(done, total)`` is called every few supervised steps."""
    key = warm_key(cfg)
    model = build_model(cfg.hidden, cfg.layers, cfg.heads, seed=cfg.seed)
    if key in _WARM_CACHE:
        model.load_state_dict(_WARM_CACHE[key])
        return model
    gen = torch.Generator().manual_seed(10_000 + cfg.seed)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.sft_lr)
    p_len = task.PROMPT_LEN + 2
    every = max(1, cfg.sft_steps // 20)
    for i in range(cfg.sft_steps):
        if on_progress and i % every == 0:
            on_progress(i, cfg.sft_steps)
        prompts = task.make_prompts(64, gen)
        y = task.noisy_targets(prompts, gen)  # [64, T]
        logits = response_logits(model, torch.cat([prompts, y], dim=1), p_len)  # [64, T, V]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, task.VOCAB), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    _WARM_CACHE[key] = copy.deepcopy(model.state_dict())
    if on_progress:
        on_progress(cfg.sft_steps, cfg.sft_steps)
    return model


def warm_state(cfg: ToyConfig, on_progress: Callable[[int, int], None] | None = None) -> dict:
    """The warm-start weights of ``cfg`` (computed once per :func:`warm_key`)."""
    warm_start(cfg, on_progress)
    return _WARM_CACHE[warm_key(cfg)]


def set_warm_state(cfg: ToyConfig, state: dict) -> None:
    """Seed this process's warm-start cache with weights computed elsewhere (a demo worker)."""
    _WARM_CACHE[warm_key(cfg)] = state


def group_advantages(rewards: torch.Tensor, group: int) -> torch.Tensor:
    """GRPO: A = (r - mean_group) / (std_group + 1e-6); a group with one reward value gets A = 0."""
    r = rewards.view(-1, group)
    a = (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + 1e-6)
    return a.reshape(-1)


class ToyTrainer:
    """The RL phase as an object: one :meth:`rl_step` per rollout step (benchmarks alternate recorders)."""

    def __init__(self, cfg: ToyConfig):
        cfg.validate()
        self.cfg = cfg
        torch.manual_seed(cfg.seed)
        self.model = warm_start(cfg)
        self.model.train()
        self.opt = torch.optim.Adam(self.model.parameters(), lr=cfg.lr)
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.loss_kw: dict[str, Any] = dict(
            method=cfg.method,
            eps_low=cfg.eps_low,
            eps_high=cfg.eps_high,
            beta2=cfg.beta2,
            dual_clip=cfg.dual_clip,
            erc=cfg.erc,
            agg=cfg.agg,
            entropy_coef=cfg.entropy_coef,
            tau=cfg.tau,
            **dict(cfg.loss_options),
        )  # the method's further policy_loss kwargs
        if cfg.top_entropy_quantile < 1.0:  # the 80/20 forking rule (policy_update's option)
            self.loss_kw["top_entropy_quantile"] = cfg.top_entropy_quantile
        if cfg.method == "clip_cov":  # Clip-Cov's random selection: its own run-seeded generator
            self.loss_kw["generator"] = torch.Generator().manual_seed(20_000 + cfg.seed)
        self.entropy_ctrl: AdaptiveEntropyCoef | None = None  # the adaptive entropy coefficient: one for the run
        if cfg.entropy_target is not None:
            from ...rl.forking import AdaptiveEntropyCoef

            self.entropy_ctrl = AdaptiveEntropyCoef(
                cfg.entropy_target,
                coef=cfg.entropy_coef,
                delta=cfg.entropy_coef_delta,
                coef_min=cfg.entropy_coef_min,
                coef_max=cfg.entropy_coef_max,
            )
            self.loss_kw["entropy_coef"] = self.entropy_ctrl
        self.loss_hook: LossHook | None = None  # updates recorded through it (benchmarks)

    def state(self) -> tuple:
        """A copy of what a step reads and changes: the weights, the optimizer's state and the sampling
        generator (:meth:`load_state` puts it back: the next step is then the same, bit for bit)."""
        ctrl = self.entropy_ctrl.state_dict() if self.entropy_ctrl is not None else None
        cov = self.loss_kw["generator"].get_state() if "generator" in self.loss_kw else None
        return (
            {k: v.clone() for k, v in self.model.state_dict().items()},
            copy.deepcopy(self.opt.state_dict()),
            self.gen.get_state(),
            ctrl,
            cov,
        )

    def load_state(self, state: tuple) -> None:
        weights, opt, gen, ctrl, cov = state
        if ctrl is not None:
            assert self.entropy_ctrl is not None  # a state with a controller's came from a trainer with one
            self.entropy_ctrl.load_state_dict(ctrl)
        if cov is not None:
            self.loss_kw["generator"].set_state(cov)
        with torch.no_grad():
            for k, v in self.model.state_dict().items():
                v.copy_(weights[k])
        self.opt.load_state_dict(copy.deepcopy(opt))
        self.gen.set_state(gen)

    def _probed_update(self, rec, step, u, idx, seqs, resp, mask, adv, old_lp, old_h, beta1) -> None:
        """Update u of a probe step through Recorder.probe (the same real update, measured)."""
        fn = _probe_update_fn(self, rec, step, u, idx, seqs, resp, mask, adv, old_lp, old_h, beta1)
        rec.probe(step, self.model, self.opt, fn, None, update=u, max_grad_norm=self.cfg.grad_clip)

    def _hooked_update(self, step, u, logits, tokens, mask, adv, old_lp, old_h, idx, beta1):
        """One update recorded through ``self.loss_hook`` (integrations.loss_hook) beside ``policy_loss``,
        as a trainer with its own loss would attach: the benchmarks' hook-on mode."""
        from ...rl.losses import policy_loss
        from ...rl.stats import logprobs_and_entropy

        lp, h = logprobs_and_entropy(logits, tokens, temperature=self.cfg.temperature)  # [mb, T] each
        assert self.loss_hook is not None  # rl_step calls this only with a hook
        self.loss_hook.watch(
            step,
            u,
            logprobs=lp,
            old_logprobs=old_lp,
            advantages=adv,
            mask=mask,
            entropy=h,
            old_entropy=old_h,
            logits=logits,
            tokens=tokens,
            seq_ids=idx,
            group_ids=idx // self.cfg.group,
        )
        return policy_loss(lp, old_lp, adv, mask, entropy=h, old_entropy=old_h, beta1=beta1, **self.loss_kw)

    def rl_step(self, step: int, rec: Recorder | None) -> tuple[float, float]:
        """Rollout, advantages, old-policy pass, ``updates`` recorded policy updates. -> (reward, entropy)."""
        cfg, model, gen = self.cfg, self.model, self.gen
        p_len = task.PROMPT_LEN + 2
        n = cfg.prompts * cfg.group
        mb = n // cfg.minibatches
        # 1. rollout: prompts x G samples at temperature T, verifiable rewards
        prompts = task.make_prompts(cfg.prompts, gen).repeat_interleave(cfg.group, dim=0)  # [n, P]
        model.eval()
        transform = (lambda z: sampler_logits(z, cfg.mismatch)) if cfg.mismatch else None  # the sampler's logits
        resp = sample(model, prompts, task.RESPONSE_LEN, gen, cfg.temperature, transform)  # [n, T]
        rewards = task.reward(prompts, resp)  # [n]
        adv = group_advantages(rewards, cfg.group)  # [n]
        seqs = torch.cat([prompts, resp], dim=1)  # [n, P + T]
        mask = torch.ones_like(resp, dtype=torch.bool)  # fixed-length responses
        # 2. the old policy: log-probs and full-vocabulary entropies, no grad
        with torch.no_grad():
            z = response_logits(model, seqs, p_len)  # [n, T, V]
            old_lp, old_h = old_policy_pass(z, resp, temperature=cfg.temperature)  # [n, T] each
            # the sampler's log-probs of the sampled tokens (a mismatched sampler only) [n, T]
            samp_lp = sampler_logprobs(z, resp, cfg.mismatch, cfg.temperature) if cfg.mismatch else None
            del z
        model.train()
        # 3. mini-batch policy updates: `epochs` passes, each over a fresh permutation
        beta1 = cfg.beta1_at(step)
        order = [torch.randperm(n, generator=gen) for _ in range(cfg.epochs)]
        for u in range(cfg.updates):
            k = u % cfg.minibatches
            idx = order[u // cfg.minibatches][k * mb : (k + 1) * mb]
            if rec and cfg.probe_every and step % cfg.probe_every == 0 and u == 0:
                self._probed_update(rec, step, u, idx, seqs, resp, mask, adv, old_lp, old_h, beta1)
                continue
            logits = response_logits(model, seqs[idx], p_len)  # [mb, T, V]
            extra: dict[str, Any] = {}  # policy_update's sampler kwargs
            if samp_lp is not None:
                if rec:  # recorded beside the trainer's (tokens.sampler_logprob); nothing to record without one
                    extra["sampler_logprobs"] = samp_lp[idx]
                if cfg.tis:
                    extra["is_weight"] = tis_weight(old_lp[idx], samp_lp[idx], cfg.tis)
            if rec and self.loss_hook is not None:  # benchmarks: the loss hook beside policy_loss instead
                out = self._hooked_update(
                    step, u, logits, resp[idx], mask[idx], adv[idx], old_lp[idx], old_h[idx], idx, beta1
                )
            else:
                out = policy_update(
                    rec,
                    step,
                    u,
                    logits,
                    resp[idx],
                    mask[idx],
                    adv[idx],
                    old_lp[idx],
                    old_entropy=old_h[idx],
                    temperature=cfg.temperature,
                    seq_ids=idx,
                    group_ids=idx // cfg.group,
                    beta1=beta1,
                    **self.loss_kw,
                    **extra,
                )
            self.opt.zero_grad(set_to_none=True)
            out.loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            self.opt.step()
            if self.entropy_ctrl is not None:  # the optimizer step's boundary: the coefficient moves
                self.entropy_ctrl.step()
            if rec:
                rec.record_step(step, update=u, grad_norm=gnorm, lr=cfg.lr)  # beta1: from the loss (ce_gppo)
        # 4. the step's sequences and scalars
        r_mean, h_mean = float(rewards.mean()), float(old_h.mean())
        if rec:
            rec.record_sequences(
                step,
                seq_ids=torch.arange(n),
                rewards=rewards,
                advantages=adv,
                lengths=mask.sum(dim=1),
                group_ids=torch.arange(n) // cfg.group,
                texts=[task.decode(r) for r in resp.tolist()],
            )  # each response's text
            rec.record_step(step, accuracy=float((rewards == 1).float().mean()), policy_entropy=h_mean)
        return r_mean, h_mean


def _probe_update_fn(trainer, rec, step, u, idx, seqs, resp, mask, adv, old_lp, old_h, beta1):
    """loss_fn for Recorder.probe: the update's loss with the entropy graph; records the update while
    grad is enabled (its logit_grad_norm stays null: the probe's own backward passes would fire a hook)."""
    from ...rl.losses import policy_loss
    from ...rl.probe import ProbeForward
    from ...rl.stats import logprobs_and_entropy

    cfg, p_len = trainer.cfg, task.PROMPT_LEN + 2
    cov_gen = trainer.loss_kw.get("generator")  # Clip-Cov's draw: the same selection in every probe pass
    cov_state = cov_gen.get_state() if cov_gen is not None else None

    def loss_fn(model, _batch):
        if cov_gen is not None:
            cov_gen.set_state(cov_state)
        logits = response_logits(model, seqs[idx], p_len)  # [mb, T, V]
        lp, h, s = logprobs_and_entropy(
            logits, resp[idx], temperature=cfg.temperature, entropy_grad=True, sensitivity=True
        )
        out = policy_loss(
            lp, old_lp[idx], adv[idx], mask[idx], entropy=h, old_entropy=old_h[idx], beta1=beta1, **trainer.loss_kw
        )
        if torch.is_grad_enabled():
            if trainer.loss_kw.get("entropy_coef"):  # the bonus's own term of entropy_effect (policy_update's)
                bonus = entropy_bonus_effect(out.loss, h, logits, mask[idx], temperature=cfg.temperature)
                if bonus is not None:
                    out.columns["entropy_effect_bonus"] = bonus
            rec.record_update(
                step,
                u,
                mask=mask[idx],
                advantages=adv[idx],
                logprobs=lp,
                old_logprobs=old_lp[idx],
                entropy=h,
                old_entropy=old_h[idx],
                tokens=resp[idx],
                seq_ids=idx,
                group_ids=idx // cfg.group,
                loss=out,
                entropy_sensitivity=s,
                temperature=cfg.temperature,
            )
        return ProbeForward(out.loss, lp, h, mask[idx], out.columns)

    return loss_fn


def train(
    cfg: ToyConfig,
    out_dir: str | Path,
    *,
    run: str | None = None,
    on_step: Callable[[int, float, float], None] | None = None,
    record: bool = True,
    overwrite: bool = False,
    fsync: bool = True,
) -> RunResult:
    """Train the toy policy with ``cfg`` and record the run under ``out_dir/<run>`` (an existing run of
    that id is refused unless ``overwrite``; ``fsync``: the Recorder's, see :class:`Recorder`)."""
    cfg.validate()
    run = run or f"{cfg.name or cfg.method}-s{cfg.seed}"
    t0 = time.perf_counter()
    trainer = ToyTrainer(cfg)
    # `method` names the training recipe (e.g. erc_dapo); the loss itself is in run.json's `loss`
    config = {
        **cfg.to_dict(),
        "method": cfg.name or cfg.method,
        "loss_method": cfg.method,
        "model": "toy-qwen2",
        "task": "shifted-lookup",
    }
    rewards_hist, ent_hist = [], []
    rec = (
        Recorder(
            out_dir,
            run=run,
            config=config,
            tau=cfg.tau,
            sample=cfg.sample,
            overwrite=overwrite,
            fsync=fsync,
            tokenizer=list(task.TOKEN_NAMES),
        )
        if record
        else None
    )  # token texts: run.json
    try:
        for step in range(cfg.steps):
            r_mean, h_mean = trainer.rl_step(step, rec)
            if rec:
                rec.end_step(step)  # written now: a kill during the next step loses none of it
            rewards_hist.append(r_mean)
            ent_hist.append(h_mean)
            if on_step:
                on_step(step, r_mean, h_mean)
    except BaseException:
        if rec:
            rec.close(status="failed", _raise=False)
        raise
    if rec:
        rec.close()
    return RunResult(
        run, Path(out_dir) / run, rewards_hist, ent_hist, time.perf_counter() - t0, threads=torch.get_num_threads()
    )
