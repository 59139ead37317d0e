"""The public loss: `FusedLinearGRPOLoss` and `fused_linear_grpo_loss`.

It equals, in plain torch (with logits materialized, which this never does):

    z = softcap(logit_scale * (hidden @ weight.T + bias)) / temperature
    logp = log_softmax(z).gather(-1, completion_ids);  entropy = -(softmax(z) * log_softmax(z)).sum(-1)
    loss = <TRL 1.16.0 GRPOTrainer._compute_loss>(logp, entropy, completion_mask, advantages, ...)

and returns TRL's metrics, the per-token logp and entropy, and the entropy mask.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from . import distributed, fused, objectives, quantile, streaming, tiling, validation
from .config import SETTING_NAMES, GRPOLossConfig

SCHEDULES = ("auto", "speed", "memory")


@dataclass
class GRPOLossOutput:
    loss: torch.Tensor  # 0-d, float32 (float64 for float64 inputs), differentiable
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    per_token_logps: torch.Tensor | None = None  # [B,T], detached, 0 where masked
    entropy: torch.Tensor | None = None  # [B,T], detached, 0 where masked
    entropy_mask: torch.Tensor | None = None  # [B,T] bool, None when top_entropy_quantile == 1


TILE_KNOBS = ("token_tile", "tail_tile", "vocab_tile", "stats_rows", "speed_tile", "speed_group")
ACCUMULATING_SPEED_TILE = 1024  # GPU speed tile when dW is summed over groups (see default_tiles)


def default_tiles(device: torch.device) -> dict[str, int]:
    """Tile sizes: large GEMMs on a GPU, cache-sized ones on a CPU. Active tokens go in tiles of `token_tile`
    rows, the rest in tiles of `tail_tile` (`speed_tile` and `tail_tile` in the speed schedule).
    Memory schedule: the stats pass holds [stats_rows, V] float32 logits; the gradient pass [token_tile,
    vocab_tile] logits, and writes each vocab_tile slice of dW once per token tile (one big token tile: once).
    Speed schedule: a [speed_tile, V] float32 GEMM output, plus either the 16-bit logits gradients of all tiles
    for one dW GEMM (16-bit GEMMs, when they take no more than a float32 [V, H]), or a float32 [V, H] dW sum
    and the gradients of `speed_group` tokens, added to it by one GEMM per group. In the second case the GPU
    speed tile defaults to ACCUMULATING_SPEED_TILE: half the logits tile buys a 4096-token group in the same
    memory (4 * 1024 + 2 * 4096 bytes per vocabulary entry, as 6 * 2048), halving the passes over the sum."""
    if device.type == "cuda":
        return {"token_tile": 8192, "tail_tile": 128, "vocab_tile": 8192, "stats_rows": 1024, "speed_tile": 2048,
                "speed_group": 4096}  # fmt: skip
    # CPU: one dW GEMM per tile measured faster than groups of 1024 or 4096 tokens (their gradients leave the cache)
    return {"token_tile": 256, "tail_tile": 32, "vocab_tile": 4096, "stats_rows": 256, "speed_tile": 256,
            "speed_group": 256}  # fmt: skip


class FusedLinearGRPOLoss:
    """GRPO-family loss from hidden states and the lm_head, without materializing [tokens, vocab] logits.

    Settings (TRL's names and defaults, see `GRPOLossConfig`) are validated once, here. `compiled=True` runs the
    tile functions under torch.compile; `compiled=False` runs the same functions eagerly. `schedule`: "memory"
    (stats forward, recompute in backward), "speed" (gradients on the forward's logits; not with
    top_entropy_quantile < 1, whose threshold needs every entropy first) or "auto". `validate=False` skips the
    checks that read values back to the host. Tile sizes default by device; `logits_budget_bytes` bounds the
    speed schedule's per-tile logits, beyond which "auto" picks memory.
    """

    def __init__(
        self,
        *,
        compiled: bool = True,
        schedule: str = "auto",
        validate: bool = True,
        token_tile: int | None = None,
        tail_tile: int | None = None,
        vocab_tile: int | None = None,
        stats_rows: int | None = None,
        speed_tile: int | None = None,
        speed_group: int | None = None,
        logits_budget_bytes: int = 4 << 30,
        process_group=None,
        vocab_parallel_group=None,
        **settings,
    ):
        unknown = set(settings) - set(SETTING_NAMES)
        if unknown:
            raise TypeError(f"unknown setting(s): {sorted(unknown)}; settings are {SETTING_NAMES}")
        self.config = GRPOLossConfig(**settings)
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        if schedule == "speed" and vocab_parallel_group is not None:
            raise ValueError("schedule='speed' does not support a vocabulary-parallel lm_head; use 'memory' or 'auto'")
        if schedule == "speed" and self.config.uses_entropy_mask:
            raise ValueError(
                "schedule='speed' cannot be used with top_entropy_quantile < 1: the entropy threshold needs every "
                "token's entropy before any gradient can be formed; use schedule='memory' (or 'auto')"
            )
        knobs = dict(
            zip(TILE_KNOBS, (token_tile, tail_tile, vocab_tile, stats_rows, speed_tile, speed_group), strict=True)
        )
        for name, v in knobs.items():
            if v is not None and (not isinstance(v, int) or v <= 0):
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        self.schedule = schedule
        self.validate = validate
        self.tile_overrides = {k: v for k, v in knobs.items() if v is not None}
        self.logits_budget_bytes = logits_budget_bytes
        # Vocabulary-parallel ranks hold the same tokens: their batch reductions stay local unless a
        # data-parallel group is given.
        if process_group is None and vocab_parallel_group is not None:
            process_group = distributed.LOCAL
        self.process_group = process_group
        self.vocab_group = distributed.LOCAL if vocab_parallel_group is None else vocab_parallel_group
        self.kernels = fused.Kernels(compiled)

    # ------------------------------------------------------------------ entry point
    def __call__(self, hidden, weight, completion_ids, completion_mask, advantages, **inputs) -> GRPOLossOutput:
        """Inputs as in SEMANTICS.md (see `_call` for the keywords). Under autocast, the lm_head GEMMs run in the
        autocast dtype (as TRL's fused head does): fp32 master weights still get 16-bit GEMMs, and their
        gradients come back in fp32 through the cast."""
        device_type = hidden.device.type if isinstance(hidden, torch.Tensor) else "cpu"
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            cast = lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
            hidden, weight = cast(hidden), cast(weight)
            for k in ("bias", "ref_hidden", "ref_weight", "ref_bias"):
                inputs[k] = cast(inputs.get(k))
        with torch.autocast(device_type, enabled=False):
            return self._call(hidden, weight, completion_ids, completion_mask, advantages, **inputs)

    def _call(
        self,
        hidden,
        weight,
        completion_ids,
        completion_mask,
        advantages,
        *,
        bias=None,
        old_per_token_logps=None,
        ref_per_token_logps=None,
        ref_hidden=None,
        ref_weight=None,
        ref_bias=None,
        importance_sampling_ratio=None,
        sampling_per_token_logps=None,
        num_items_in_batch=None,
        num_processes=None,
        gradient_accumulation_steps=1,
        steps_per_generation=None,
        entropy_coef=None,
        vocab_start=0,
    ) -> GRPOLossOutput:
        cfg = self.config
        per_token = {
            "old_per_token_logps": old_per_token_logps,
            "ref_per_token_logps": ref_per_token_logps,
            "sampling_per_token_logps": sampling_per_token_logps,
        }
        validation.check_shapes(
            hidden,
            weight,
            completion_ids,
            completion_mask,
            advantages,
            bias,
            per_token,
            importance_sampling_ratio,
            ref_hidden,
            ref_weight,
        )
        if cfg.beta != 0.0 and ref_per_token_logps is None and ref_hidden is None and ref_weight is None:
            raise ValueError("beta != 0 needs ref_per_token_logps, or ref_hidden / ref_weight to compute them")
        if gradient_accumulation_steps <= 0 or (steps_per_generation is not None and steps_per_generation <= 0):
            raise ValueError("gradient_accumulation_steps and steps_per_generation must be positive")
        weight, bias = distributed.full_tensor(weight), distributed.full_tensor(bias)
        if ref_weight is not None:
            ref_weight, ref_bias = distributed.full_tensor(ref_weight), distributed.full_tensor(ref_bias)
        if self.validate:
            vocab = weight.shape[0]
            if self.vocab_group is not distributed.LOCAL:
                vocab = int(distributed.all_sum(torch.tensor(vocab, device=weight.device), self.vocab_group))
            validation.check_values(
                completion_ids, completion_mask, advantages, vocab, per_token, importance_sampling_ratio
            )

        if cfg.beta != 0.0 and ref_per_token_logps is None:
            ref_per_token_logps = self._reference_logps(
                hidden if ref_hidden is None else ref_hidden,
                weight if ref_weight is None else ref_weight,
                bias if ref_weight is None else ref_bias,
                completion_ids,
                completion_mask,
                vocab_start,
            )
        dtype = streaming.stat_dtype(hidden)
        # Made when first needed: after the plan's wait on the GPU, the first GEMM is queued before these small
        # kernels, so the GPU does not idle while the host launches them.
        batch = functools.cache(lambda: objectives.make_batch(
            completion_mask,
            advantages,
            dtype,
            old=old_per_token_logps,
            ref=ref_per_token_logps,
            is_ratio=importance_sampling_ratio,
            sampling=sampling_per_token_logps,
        ))  # fmt: skip
        gas = gradient_accumulation_steps
        run = dict(
            gas=gas,
            spg=gas if steps_per_generation is None else steps_per_generation,
            num_items=num_items_in_batch,
            num_processes=distributed.world_size(self.process_group) if num_processes is None else num_processes,
            entropy_coef=cfg.entropy_coef if entropy_coef is None else entropy_coef,
        )
        tiles = self._tiles(hidden.device)
        plan = self._speed_plan(completion_mask, tiles, hidden, weight)
        if plan is not None:
            return self._speed(hidden, weight, bias, completion_ids, batch, plan, run, tiles["speed_group"])
        plan = tiling.plan_tokens(completion_mask, tiles["token_tile"], tiles["tail_tile"])
        return self._memory(hidden, weight, bias, completion_ids, batch, plan, run, tiles["vocab_tile"],
                            tiles["stats_rows"], vocab_start)  # fmt: skip

    # ------------------------------------------------------------------ pieces
    def _tiles(self, device) -> dict[str, int]:
        return {**default_tiles(device), **self.tile_overrides}

    def _speed_plan(self, mask, tiles, hidden, weight):
        """The speed schedule's tile plan, or None where the memory schedule runs."""
        if self.schedule == "memory" or self.config.uses_entropy_mask or self.vocab_group is not distributed.LOCAL:
            return None
        tile, tail, group = tiles["speed_tile"], tiles["tail_tile"], tiles["speed_group"]
        # Whether dW will be summed over groups; decided on B*T (no wait on the GPU to count active tokens).
        single_gemm = fused.buffers_weight_gradient(hidden.dtype, mask.numel(), weight.shape[1])
        accumulates = weight.requires_grad and not single_gemm
        if accumulates and hidden.is_cuda and "speed_tile" not in self.tile_overrides:
            tile = ACCUMULATING_SPEED_TILE
        if self.schedule == "auto":
            vocab = weight.shape[0]
            if not weight.requires_grad:
                kept = 2 * tile * vocab  # one tile's 16-bit logits gradient
            elif single_gemm:
                kept = 2 * mask.numel() * vocab  # every token's
            else:
                kept = 2 * max(tile, group) * vocab + 4 * weight.numel()  # a group's, and the float32 dW sum
            if 4 * tile * vocab + kept > self.logits_budget_bytes:  # plus a tile's float32 GEMM output
                return None
        if not self.config.couples_sequence:
            return tiling.plan_tokens(mask, tile, tail)
        plan = tiling.plan_whole_rows(mask, tile)
        if plan is None and self.schedule == "speed":
            raise ValueError(
                f"schedule='speed' with a sequence-level objective needs whole rows in a token tile; a row has more "
                f"than speed_tile={tile} active tokens: raise speed_tile or use schedule='memory'"
            )
        return plan

    def _slots(self, hidden, ids, plan, vocab_start=0):
        """Hidden rows and target ids in slot order; targets relative to this rank's first vocabulary row."""
        x = tiling.to_slots(hidden.reshape(-1, hidden.shape[-1]), plan, fill=None)
        targets = tiling.to_slots(ids.reshape(-1).long(), plan, fill=0) - vocab_start
        return x, targets

    def _reference_logps(self, hidden, weight, bias, ids, mask, vocab_start):
        tiles = self._tiles(hidden.device)
        plan = tiling.plan_tokens(mask, tiles["token_tile"], tiles["tail_tile"])
        stats_rows = tiles["stats_rows"]
        head = fused.head_values(self.config, streaming.stat_dtype(hidden), hidden.device)
        with torch.no_grad():
            x, targets = self._slots(hidden.detach(), ids, plan, vocab_start)
            logp, _, _ = fused.statistics_pass(
                self.kernels,
                x,
                weight.detach(),
                None if bias is None else bias.detach(),
                targets,
                head,
                self.config.final_logit_softcapping is not None,
                plan.tiles,
                stats_rows,
                self.vocab_group,
            )
            return tiling.from_slots(logp, plan, mask.numel()).view(mask.shape)

    def _finish(self, logp, entropy, batch, entropy_mask, norms, run):
        """Loss value and metrics from the whole batch's per-token statistics."""
        cfg = self.config
        loss, policy = objectives.loss_of_rows(logp, entropy, batch, cfg, norms, entropy_mask, run["entropy_coef"])
        bonus_on = not (isinstance(run["entropy_coef"], float) and run["entropy_coef"] == 0.0)
        metrics = objectives.metrics(
            logp, entropy, batch, cfg, entropy_mask, policy, bonus_on, run["gas"], self.process_group
        )
        return loss, metrics

    def _normalizers(self, batch, entropy_mask, run):
        return objectives.make_normalizers(
            batch,
            self.config,
            entropy_mask,
            num_items=run["num_items"],
            num_processes=run["num_processes"],
            gas=run["gas"],
            spg=run["spg"],
            group=self.process_group,
        )

    def _memory(self, hidden, weight, bias, ids, make_batch, plan, run, vocab_tile, stats_rows, vocab_start):
        cfg = self.config
        head = fused.head_values(cfg, streaming.stat_dtype(hidden), hidden.device)
        x, targets = self._slots(hidden, ids, plan, vocab_start)
        softcap = cfg.final_logit_softcapping is not None
        logp_s, entropy_s = fused.StreamedStatistics.apply(
            x, weight, bias, targets, head, self.kernels, softcap, plan.tiles, vocab_tile, stats_rows, self.vocab_group
        )
        batch = make_batch()
        mask = batch.mask
        logp = tiling.from_slots(logp_s, plan, mask.numel()).view(mask.shape)
        entropy = tiling.from_slots(entropy_s, plan, mask.numel()).view(mask.shape)
        entropy_mask = None
        if cfg.uses_entropy_mask:
            entropy_mask = quantile.high_entropy_mask(
                entropy, mask, cfg.top_entropy_quantile, self.process_group, active=plan.active
            )
        em = None if entropy_mask is None else entropy_mask.to(mask.dtype)
        norms = self._normalizers(batch, em, run)
        loss, metrics = self._finish(logp, entropy, batch, em, norms, run)
        return GRPOLossOutput(loss, metrics, logp.detach(), entropy.detach(), entropy_mask)

    def _speed(self, hidden, weight, bias, ids, make_batch, plan, run, group):
        cfg = self.config
        B, T = ids.shape
        dtype = streaming.stat_dtype(hidden)
        head = fused.head_values(cfg, dtype, hidden.device)
        # The normalizers are made at the first tile's gradient, so their small kernels are queued behind the
        # first GEMM instead of delaying it.
        normalizers = functools.cache(lambda: self._normalizers(make_batch(), None, run))
        # Slot -> flat [B*T] position, padding slots sent to a scratch entry at B*T: no boolean indexing, so the
        # tile loop never waits on the host.
        dest = torch.where(plan.valid, plan.source, B * T)
        logp_flat = torch.zeros(B * T + 1, dtype=dtype, device=hidden.device)
        entropy_flat = torch.zeros_like(logp_flat)

        def gradient_of_tile(s, n, logp_slots, entropy_slots):
            """d loss / d (logp, entropy) for the tokens of slots s..s+n, from the objective on [B,T]. Exact:
            with the normalizers fixed up front, a token's gradient depends only on its own row's values."""
            logp_flat.index_copy_(0, dest[s : s + n], logp_slots[s : s + n])
            entropy_flat.index_copy_(0, dest[s : s + n], entropy_slots[s : s + n])
            lp = logp_flat[: B * T].detach().clone().requires_grad_()
            h = entropy_flat[: B * T].detach().clone().requires_grad_()
            loss, _ = objectives.loss_of_rows(
                lp.view(B, T), h.view(B, T), make_batch(), cfg, normalizers(), None, run["entropy_coef"]
            )
            g_lp, g_h = torch.autograd.grad(loss, (lp, h), allow_unused=True, materialize_grads=True)
            src, valid = plan.source[s : s + n], plan.valid[s : s + n]
            return torch.where(valid, g_lp[src], 0.0), torch.where(valid, g_h[src], 0.0)

        x, targets = self._slots(hidden.detach(), ids, plan)
        need_w, need_b = weight.requires_grad, bias is not None and bias.requires_grad
        dx_s, dw, db = fused.speed_pass(
            self.kernels, x, weight.detach(), None if bias is None else bias.detach(), targets, head,
            cfg.final_logit_softcapping is not None, plan.tiles, gradient_of_tile, need_w, need_b, group,
        )  # fmt: skip
        d_hidden = None
        if hidden.requires_grad and plan.identity:
            d_hidden = dx_s.view(hidden.shape)
        elif hidden.requires_grad:
            d_hidden = torch.zeros(B * T + 1, hidden.shape[-1], dtype=hidden.dtype, device=hidden.device)
            d_hidden.index_copy_(0, dest, dx_s)  # padding slots land in the scratch row
            d_hidden = d_hidden[: B * T].view(hidden.shape)
        logp, entropy = logp_flat[: B * T].view(B, T), entropy_flat[: B * T].view(B, T)
        value, metrics = self._finish(logp, entropy, make_batch(), None, normalizers(), run)
        loss = fused.PrecomputedGradients.apply(
            value, hidden, weight, bias, d_hidden,
            dw.to(weight.dtype) if need_w else None,
            db.to(bias.dtype) if need_b else None,
        )  # fmt: skip
        return GRPOLossOutput(loss, metrics, logp, entropy, None)


CONSTRUCTOR_KNOBS = (*TILE_KNOBS, "logits_budget_bytes", "process_group")


def fused_linear_grpo_loss(
    hidden,
    weight,
    completion_ids,
    completion_mask,
    advantages,
    *,
    compiled=True,
    schedule="auto",
    validate=True,
    **kwargs,
) -> GRPOLossOutput:
    """Functional form: settings, tuning knobs and call inputs as keywords. Builds the loss on every call
    (the compiled tiles are shared across calls by torch.compile's cache, keyed on shapes)."""
    built = {k: kwargs.pop(k) for k in list(kwargs) if k in SETTING_NAMES or k in CONSTRUCTOR_KNOBS}
    loss_fn = FusedLinearGRPOLoss(compiled=compiled, schedule=schedule, validate=validate, **built)
    return loss_fn(hidden, weight, completion_ids, completion_mask, advantages, **kwargs)
