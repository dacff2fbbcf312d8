"""AdamW with low-precision moment storage and optional master-less bf16 weights.

The update is torch.optim.AdamW's (decoupled weight decay, bias correction) computed in fp32
with foreach ops; only the storage between steps changes. With fp32 states and fp32 params the
arithmetic is the same sequence of operations as torch's, so the results agree bit for bit.
Buckets with low-precision moments on CUDA go (by default) through one compiled function per
parameter that decodes, updates and re-encodes in one pass (optim/fused.py); its eager form is
bit-identical on CPU to the foreach sequence with per-tensor decode/encode (the unfused path).

Per parameter the optimizer state holds:
  step                 float32 scalar tensor (as torch.optim.AdamW)
  exp_avg, exp_avg_sq  payloads in the configured StateFormat (+ exp_avg_scale/exp_avg_sq_scale
                       for block-scaled formats, + *_format names so checkpoints self-describe)
  master               fp32 copy of a low-precision parameter (master_weights="fp32" only)
Tensors with fewer than `small_numel` elements and 1-D parameters keep fp32 moments: they are
cheap, and norms/biases are the most sensitive to state error.

With FSDP2 the parameters are DTensors; the update is elementwise, so it runs on the local
shard and the state is local to the rank.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch

from minifloat.optim.codecs import (
    StateFormat,
    check_block_size,
    get_state_format,
    stochastic_round_bf16,
)
from minifloat.optim.fused import (
    adamw_scalars,
    check_fused_kernel,
    draw_step_noise,
    select_update,
)
from minifloat.optim.state_loading import (
    check_group_options,
    check_saved_state,
    check_structure,
    local_tensor,
)

__all__ = ["AdamW"]

_MOMENTS = ("exp_avg", "exp_avg_sq")
MASTER_MODES = ("fp32", "none")  # presets.py checks configurations against it too
_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # "none": the first two
_SEED_MIN, _SEED_END = -(2**63), 2**64  # what torch.Generator.manual_seed accepts


def _check_group(group: dict[str, Any], master_weights: str) -> None:
    """ValueError/TypeError naming the first bad hyperparameter or parameter of a group."""
    for name in ("lr", "eps", "weight_decay"):
        value = group[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a Python float, got {type(value).__name__}")
        if not (math.isfinite(value) and value >= 0.0):
            raise ValueError(f"{name} must be finite and >= 0, got {value}")
    if group["eps"] == 0.0:  # a gradient entry of exactly 0 would make its update 0/0 = NaN
        raise ValueError(f"eps must be finite and > 0, got {group['eps']}")
    betas = group["betas"]
    if (
        not isinstance(betas, (tuple, list))
        or len(betas) != 2
        or not all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas)
    ):
        raise ValueError(f"betas must be two floats in [0, 1), got {betas!r}")
    allowed = _PARAM_DTYPES if master_weights == "fp32" else _PARAM_DTYPES[:2]
    for p in group["params"]:
        if p.dtype not in allowed:
            names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
            raise ValueError(
                f"master_weights={master_weights!r} supports {names} params, got {p.dtype}"
                + (" (its fp32 master would drop precision)" if p.dtype == torch.float64 else "")
            )


def _check_unique(group: dict[str, Any]) -> None:
    """ValueError for a parameter listed twice in a group: torch only warns, and the step would
    update it twice."""
    seen: set[int] = set()
    for i, p in enumerate(group["params"]):
        if id(p) in seen:
            raise ValueError(f"parameter {i} of a param group appears in it twice")
        seen.add(id(p))


def _check_options(block_size: object, small_numel: object, seed: object, fused: object) -> None:
    """The constructor's keyword options, checked at construction: a str or float would
    otherwise fail only in `step` (after state was created), and fused="yes" would count as
    True."""
    check_block_size(block_size)
    if isinstance(small_numel, bool) or not isinstance(small_numel, int):
        raise TypeError(
            f"small_numel must be an int >= 0, got {type(small_numel).__name__}: {small_numel!r}"
        )
    if small_numel < 0:
        raise ValueError(f"small_numel must be an int >= 0, got {small_numel}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}: {seed!r}")
    if not _SEED_MIN <= seed < _SEED_END:
        raise ValueError(
            f"seed must lie in [-2**63, 2**64) (torch.Generator.manual_seed's range), got {seed}"
        )
    if fused is not None and not isinstance(fused, bool):
        raise TypeError(f"fused must be True, False or None, got {fused!r}")


class AdamW(torch.optim.Optimizer):
    """AdamW whose moments are stored in fp32 / bf16 / fp16 / fp8 formats.

    exp_avg_dtype, exp_avg_sq_dtype: state format names (see codecs.STATE_FORMATS: "fp32",
    "bf16", "fp16", "fp8", "fp8-sr", "fp8-sqrt", "fp8-sqrt-sr").
    master_weights: "fp32" keeps an fp32 master copy of bf16/fp16 params (fp32 params are their
    own master); "none" updates params in place, rounding bf16 params stochastically with a
    generator seeded by `seed` (deterministic, saved in the state dict).
    block_size: elements per fp32 scale for block-scaled formats, at most 2**16
    (codecs.MAX_BLOCK_SIZE: moments are padded to whole blocks).
    small_numel: tensors with fewer elements (and 1-D ones) keep fp32 moments.
    fused: update parameters with low-precision moments through one function per parameter
    (optim/fused.py: decode, update and re-encode in one pass, compiled on CUDA) instead of
    decoding a bucket, updating it with foreach ops and encoding each tensor. Both give the
    same bits on CPU. None (default): fused on CUDA; on CPU the unfused path, which runs eager
    there and is ~3x faster than the eager fused function (its exact FMA costs float64 passes).
    fp32-moment buckets always take the foreach path (torch.optim.AdamW's).
    fused_kernel: "auto" (default) runs the fused update on CUDA as one hand-written Triton
    kernel per parameter where it covers the formats (block-scaled, round to nearest: the
    fp8-fp16 and lean presets; optim/fused_triton.py), else as the compiled function;
    "inductor" always uses the compiled function. Both give the same bits.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.1,
        *,
        exp_avg_dtype: str = "fp32",
        exp_avg_sq_dtype: str = "fp32",
        master_weights: str = "fp32",
        block_size: int = 128,
        small_numel: int = 4096,
        seed: int = 0,
        fused: bool | None = None,
        fused_kernel: str = "auto",
    ) -> None:
        if master_weights not in MASTER_MODES:
            raise ValueError(
                f"master_weights must be one of {MASTER_MODES}, got {master_weights!r}"
            )
        check_fused_kernel(fused_kernel)
        get_state_format(exp_avg_sq_dtype)
        if get_state_format(exp_avg_dtype).sqrt_domain:
            raise ValueError("sqrt-domain formats need values >= 0: use them for exp_avg_sq only")
        _check_options(block_size, small_numel, seed, fused)
        # set before super().__init__, whose add_param_group checks each group against them
        self.master_weights = master_weights
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.exp_avg_dtype = exp_avg_dtype
        self.exp_avg_sq_dtype = exp_avg_sq_dtype
        self.block_size = block_size
        self.small_numel = small_numel
        self.seed = seed
        self.fused = fused
        self.fused_kernel = fused_kernel
        self._generators: dict[str, torch.Generator] = {}

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's, after checking the group's hyperparameters and parameter dtypes, so that a
        bad value fails here with its name rather than in `step` with half the state advanced
        (a NaN lr would otherwise turn every parameter NaN without an error)."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            _check_group(group, self.master_weights)
            _check_unique(group)  # here only: steps change hyperparameters, never the params
        except (TypeError, ValueError):
            self.param_groups.pop()
            raise

    # ---- configuration per parameter -------------------------------------------------------

    def _formats_for(self, p: torch.Tensor) -> tuple[StateFormat, StateFormat]:
        if p.dim() <= 1 or p.numel() < self.small_numel:
            fp32 = get_state_format("fp32")
            return fp32, fp32
        return get_state_format(self.exp_avg_dtype), get_state_format(self.exp_avg_sq_dtype)

    def _needs_master(self, p: torch.Tensor) -> bool:
        return self.master_weights == "fp32" and p.dtype != torch.float32

    def _generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        if key not in self._generators:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.seed)
            self._generators[key] = gen
        return self._generators[key]

    def _init_state(self, p: torch.Tensor) -> dict[str, Any]:
        local = local_tensor(p)
        state: dict[str, Any] = {"step": torch.tensor(0.0)}
        for key, fmt in zip(_MOMENTS, self._formats_for(p), strict=True):
            self._store(state, key, fmt, torch.zeros_like(local, dtype=torch.float32))
        if self._needs_master(p):
            state["master"] = local.detach().float().clone()
        return state

    def _store(self, state: dict, key: str, fmt: StateFormat, value: torch.Tensor) -> None:
        gen = self._generator(value.device) if fmt.stochastic else None
        payload, scale = fmt.encode(value, block_size=self.block_size, generator=gen)
        state[key] = payload
        state[f"{key}_format"] = fmt.name
        if scale is None:
            state.pop(f"{key}_scale", None)
        else:
            state[f"{key}_scale"] = scale

    def _load_moment(self, state: dict, key: str, shape: torch.Size) -> torch.Tensor:
        """fp32 view of a moment: the stored tensor itself for fp32 (updated in place)."""
        fmt = get_state_format(state.get(f"{key}_format", "fp32"))
        if fmt.name == "fp32":
            return state[key]
        return fmt.decode(
            state[key], state.get(f"{key}_scale"), shape, floor_underflow=key == "exp_avg_sq"
        )

    # ---- the step ----------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 - signature fixed by torch.optim.Optimizer
        """One AdamW step over all parameters that have gradients."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:  # all checked before any state changes
            _check_group(group, self.master_weights)  # (a scheduler or .to() may change them)
        for group in self.param_groups:
            buckets: dict[tuple, list[torch.Tensor]] = defaultdict(list)
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("minifloat AdamW does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state.update(self._init_state(p))
                state["step"] += 1
                key = (
                    local_tensor(p).device,
                    p.dtype,
                    state["exp_avg_format"],
                    state["exp_avg_sq_format"],
                    "master" in state,
                    float(state["step"]),
                )
                buckets[key].append(p)
            for key, params in buckets.items():
                fused = self.fused if self.fused is not None else key[0].type == "cuda"
                if fused and (key[2], key[3]) != ("fp32", "fp32"):
                    self._update_fused(group, params, step=key[-1])
                else:
                    self._update_bucket(group, params, step=key[-1])
        return loss

    def _update_fused(self, group: dict, params: list[torch.Tensor], *, step: float) -> None:
        """Each parameter through `adamw_update` (on CUDA its Triton kernel or compiled twin);
        see optim/fused.py."""
        local0 = local_tensor(params[0])
        scalars = adamw_scalars(
            lr=group["lr"],
            betas=group["betas"],
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            step=step,
            device=local0.device,
        )
        for p in params:
            state = self.state[p]
            local = local_tensor(p)
            formats = (
                get_state_format(state["exp_avg_format"]),
                get_state_format(state["exp_avg_sq_format"]),
            )
            master = state.get("master")
            weight_noise = master is None and p.dtype == torch.bfloat16
            # The generator is created on first use only, as the unfused path does (it is saved).
            random = weight_noise or any(f.stochastic for f in formats)
            noise = draw_step_noise(
                local.numel(),
                local.shape,
                local.device,
                self._generator(local.device) if random else None,
                formats=formats,
                weight_noise=weight_noise,
                block_size=self.block_size,
            )
            grad = local_tensor(p.grad)
            update = select_update(
                local, grad, master, formats, kernel=self.fused_kernel, block_size=self.block_size
            )
            m, v = update(
                local,
                grad,
                master,
                (state["exp_avg"], state.get("exp_avg_scale")),
                (state["exp_avg_sq"], state.get("exp_avg_sq_scale")),
                scalars,
                noise,
                formats=formats,
                block_size=self.block_size,
            )
            for key, (payload, scale) in (("exp_avg", m), ("exp_avg_sq", v)):
                state[key] = payload
                if scale is not None:
                    state[f"{key}_scale"] = scale

    def _update_bucket(self, group: dict, params: list[torch.Tensor], *, step: float) -> None:
        beta1, beta2 = group["betas"]
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        states = [self.state[p] for p in params]
        locals_ = [local_tensor(p) for p in params]
        shapes = [t.shape for t in locals_]
        grads = [local_tensor(p.grad).float() for p in params]
        pairs = list(zip(states, shapes, strict=True))
        exp_avgs = [self._load_moment(s, "exp_avg", sh) for s, sh in pairs]
        exp_avg_sqs = [self._load_moment(s, "exp_avg_sq", sh) for s, sh in pairs]
        if "master" in states[0]:
            weights = [s["master"] for s in states]
        elif params[0].dtype == torch.float32:
            weights = locals_
        else:
            weights = [t.float() for t in locals_]

        # Same operation sequence as torch.optim.AdamW (foreach path).
        torch._foreach_mul_(weights, 1.0 - lr * wd)
        torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1.0 - beta2)
        bias_correction1 = 1.0 - beta1**step
        bias_correction2_sqrt = math.sqrt(1.0 - beta2**step)
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denom, bias_correction2_sqrt)
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(weights, exp_avgs, denom, -lr / bias_correction1)

        self._write_back(params, states, locals_, weights, exp_avgs, exp_avg_sqs)

    def _write_back(self, params, states, locals_, weights, exp_avgs, exp_avg_sqs) -> None:  # noqa: ANN001
        for p, state, local, w, m, v in zip(
            params, states, locals_, weights, exp_avgs, exp_avg_sqs, strict=True
        ):
            for key, value in (("exp_avg", m), ("exp_avg_sq", v)):
                fmt = get_state_format(state[f"{key}_format"])
                if fmt.name != "fp32":
                    self._store(state, key, fmt, value)
            if w is local:
                continue
            if "master" in state or p.dtype != torch.bfloat16:
                local.copy_(w)
            else:
                local.copy_(stochastic_round_bf16(w, generator=self._generator(w.device)))

    # ---- checkpoints -------------------------------------------------------------------------

    def generator_states(self) -> dict[str, torch.Tensor]:
        """States of the stochastic-rounding generators, by device: part of the trajectory."""
        return {dev: gen.get_state() for dev, gen in self._generators.items()}

    def set_generator_states(self, states: dict[str, torch.Tensor]) -> None:
        """Restore what :meth:`generator_states` returned."""
        for dev, gen_state in states.items():
            self._generator(torch.device(dev)).set_state(gen_state)

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state dict plus the stochastic-rounding generator states."""
        sd = super().state_dict()
        self._portable_dtensor_states(sd)
        # each param's shape, checked on load: a block-scaled moment of another tensor of the
        # same block count would otherwise load silently
        shapes = {}
        for group, saved_group in zip(self.param_groups, sd["param_groups"], strict=True):
            shapes.update(
                {
                    pid: list(p.shape)
                    for pid, p in zip(saved_group["params"], group["params"], strict=True)
                }
            )
        sd["minifloat"] = {"generators": self.generator_states(), "shapes": shapes}
        return sd

    def _portable_dtensor_states(self, sd: dict[str, Any]) -> None:
        """For DTensor (FSDP2) params, save moments and master as fp32 DTensors shaped and
        placed like the param, so torch.distributed.checkpoint can gather a full state dict
        and re-shard it for any world size (block-scaled payloads are rank-local)."""
        index = {}
        for group, saved_group in zip(self.param_groups, sd["param_groups"], strict=True):
            index.update(zip(saved_group["params"], group["params"], strict=True))
        for pid, state in sd["state"].items():
            p = index[pid]
            if not hasattr(p, "device_mesh"):
                continue
            from torch.distributed.tensor import DTensor

            portable = {"step": state["step"]}
            for key in (*_MOMENTS, "master"):
                if key not in state:
                    continue
                local = (
                    self._load_moment(state, key, local_tensor(p).shape)
                    if key != "master"
                    else (state[key])
                )
                portable[key] = DTensor.from_local(
                    local.float().clone(),
                    p.device_mesh,
                    p.placements,
                    run_check=False,
                    shape=p.shape,
                    stride=p.stride(),
                )
            sd["state"][pid] = portable

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict saved by this class (any state formats) or by torch.optim.AdamW.

        Moments are decoded from the format they were saved in and re-encoded in this
        optimizer's formats, so checkpoints move freely between state dtypes. (torch's own
        loader would cast every floating state to the parameter dtype, which corrupts scaled
        payloads and fp32 masters of bf16 params.)

        Everything is checked and converted before anything changes: a state dict that does
        not fit (other parameters, another optimizer, maximize or amsgrad on) raises ValueError
        and leaves this optimizer as it was.
        """
        check_structure(state_dict)
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups) or any(
            len(s["params"]) != len(g["params"])
            for s, g in zip(saved_groups, self.param_groups, strict=True)
        ):
            raise ValueError("state dict does not match this optimizer's parameter groups")
        groups: list[dict[str, Any]] = []
        id_map: dict[Any, torch.Tensor] = {}
        for i, (saved, group) in enumerate(zip(saved_groups, self.param_groups, strict=True)):
            check_group_options(saved, i)
            groups.append({**group, **{k: v for k, v in saved.items() if k != "params"}})
            _check_group(groups[-1], self.master_weights)
            id_map.update(zip(saved["params"], group["params"], strict=True))
        shapes = state_dict.get("minifloat", {}).get("shapes", {})
        state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
        generators = self.generator_states()  # stochastic encodes below draw from them
        try:
            with torch.no_grad():
                for pid, saved_state in state_dict["state"].items():
                    if pid not in id_map:
                        raise ValueError(f"the state dict has a state for param {pid}, in no group")
                    p = id_map[pid]
                    check_saved_state(pid, saved_state, p, local_tensor(p).numel(), shapes.get(pid))
                    state[p] = self._convert_state(p, saved_state)
        except BaseException:
            self._generators = {}
            self.set_generator_states(generators)
            raise
        for group, loaded in zip(self.param_groups, groups, strict=True):
            group.update(loaded)
        self.state = state
        self.set_generator_states(state_dict.get("minifloat", {}).get("generators", {}))

    def _convert_state(self, p: torch.Tensor, saved: dict[str, Any]) -> dict[str, Any]:
        local = local_tensor(p)
        state: dict[str, Any] = {
            "step": torch.as_tensor(saved["step"], dtype=torch.float32).detach().clone().cpu()
        }
        for key, fmt in zip(_MOMENTS, self._formats_for(p), strict=True):
            src = get_state_format(saved.get(f"{key}_format", "fp32"))
            scale = saved.get(f"{key}_scale")
            value = src.decode(
                local_tensor(saved[key]).to(local.device),
                None if scale is None else scale.to(local.device),
                local.shape,
            )
            self._store(state, key, fmt, value.float().clone())
        if self._needs_master(p):
            master = saved.get("master")
            master = local if master is None else local_tensor(master).to(local.device)
            state["master"] = master.detach().float().clone()
        return state
