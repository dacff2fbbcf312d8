"""Low-precision gradient communication for DDP, and FSDP2 sharding with a precision policy.

DDP communication hooks (`register_grad_comm_hook`) decide how each gradient bucket is averaged
across ranks:

- ``fp32``: upcast the bucket to fp32, all-reduce (sum) and divide, cast back. For fp32 params
  this is DDP's default; for bf16 params it keeps the reduction exact to fp32.
- ``bf16``: cast to bf16 and all-reduce in bf16 (NCCL sums in bf16): half the bytes.
- ``fp8``: one shared scale per bucket from a MAX all-reduce of the ranks' amaxes, taken after
  dividing the gradient by the world size; fp8 (e4m3 or e5m2) payloads. Collectives cannot sum
  fp8, so the bucket is reduced reduce-scatter style: an all-to-all sends chunk r of every rank's
  payload (as uint8) to rank r, which sums the W chunks in fp32 on receipt, re-quantizes its
  reduced chunk to fp8 with a scale of its own, and one all-gather returns every reduced chunk,
  its scale behind it, to every rank. Each rank sends about 2(W-1)/W bytes per element, a
  quarter of fp32. The elementwise work between the collectives is four passes of
  `grad_comm_fp8` (amax, encode, reduce on receipt, decode into the bucket), compiled on CUDA.

Bytes are counted per rank as the standard ring / pairwise algorithms send them:
all-reduce 2(W-1)/W * bytes, all-to-all and all-gather (W-1)/W * total bytes.

FSDP2 (`apply_fsdp`) calls torch.distributed.fsdp.fully_shard on every repeated block of the
model (blocks.find_repeated_blocks: the children of the outermost ModuleList/ModuleDict of >= 2
same-class blocks, e.g. `layers` of minifloat's Llama or of a `transformers` Llama, Mistral or
Qwen2), then on the root, with a MixedPrecisionPolicy (gradients reduce-scattered in fp32 by
default). A model with no repeated blocks is an error unless the blocks are named explicitly.
"""

import functools
import math
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from minifloat import grad_comm_fp8 as fp8c
from minifloat.blocks import find_repeated_blocks
from minifloat.fsdp_quantized import enable_quantized_all_gather
from minifloat.linear import QuantLinear
from minifloat.sqnr import sqnr_db

__all__ = [
    "GRAD_COMM_KINDS",
    "GradCommReport",
    "GradCommState",
    "apply_fsdp",
    "fsdp_reduce_dtype",
    "grad_comm_hook",
    "measure_grad_comm",
    "reduce_mean",
    "register_grad_comm_hook",
]

GRAD_COMM_KINDS = ("fp32", "bf16", "fp8")
# One tensor per rank gathered into one flat output: `all_gather_single` from torch 2.13 on
# (which deprecates the older name), `all_gather_into_tensor` before.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(kw_only=True)
class GradCommState:
    """State of one registered hook: its configuration and running byte counters (per rank)."""

    kind: str
    fp8_format: str = "e4m3"
    group: dist.ProcessGroup | None = None
    calls: int = 0
    elements: int = 0
    bytes_sent: float = 0.0
    bytes_sent_fp32: float = 0.0
    _streams: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        _check(self.kind, self.fp8_format)

    def side_stream(self, device: torch.device) -> "torch.cuda.Stream":
        """This hook's CUDA stream for the fp8 path on `device` (created on first use)."""
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def count(self, numel: int, sent: float) -> None:
        world = dist.get_world_size(self.group)
        self.calls += 1
        self.elements += numel
        self.bytes_sent += sent
        self.bytes_sent_fp32 += _allreduce_bytes(numel * 4, world)


@dataclass(frozen=True, kw_only=True)
class GradCommReport:
    """How one reduction compares with the fp32 all-reduce of the same gradients.

    bytes_sent / bytes_sent_fp32: bytes each rank sends; sqnr_db: 20 log10(|ref| / |out - ref|);
    max_abs_error and rel_error (|out - ref| / |ref|) against the fp32 mean.
    """

    kind: str
    world_size: int
    numel: int
    bytes_sent: float
    bytes_sent_fp32: float
    sqnr_db: float
    max_abs_error: float
    rel_error: float

    @property
    def compression(self) -> float:
        """bytes_sent_fp32 / bytes_sent; NaN where neither sends a byte (one rank)."""
        if self.bytes_sent == 0:
            return float("inf") if self.bytes_sent_fp32 else float("nan")
        return self.bytes_sent_fp32 / self.bytes_sent


def _allreduce_bytes(nbytes: float, world: int) -> float:
    return 2.0 * (world - 1) / world * nbytes


def _check(kind: str, fp8_format: str) -> None:
    if kind not in GRAD_COMM_KINDS:
        raise ValueError(f"unknown grad_comm kind {kind!r}; choose one of {GRAD_COMM_KINDS}")
    if fp8_format not in fp8c.FP8_DTYPES:
        raise ValueError(
            f"unknown fp8_format {fp8_format!r}; choose one of {list(fp8c.FP8_DTYPES)}"
        )


# ---- the three reductions (flat tensor in, mean across ranks out) ---------------------------


def _mean_fp32(flat: torch.Tensor, group) -> tuple[torch.Future, float]:  # noqa: ANN001
    world = dist.get_world_size(group)
    hp = flat.float() / world
    fut = dist.all_reduce(hp, group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0]), _allreduce_bytes(hp.numel() * 4, world)


def _mean_bf16(flat: torch.Tensor, group) -> tuple[torch.Future, float]:  # noqa: ANN001
    world = dist.get_world_size(group)
    low = (flat.float() / world).to(torch.bfloat16)
    fut = dist.all_reduce(low, group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0].float()), _allreduce_bytes(low.numel() * 2, world)


def _mean_fp8(
    flat: torch.Tensor,
    group,  # noqa: ANN001
    fp8_format: str,
    out: torch.Tensor | None = None,
) -> tuple[torch.Future, float]:
    """The fp8 mean (module docstring): collectives here, elementwise passes in grad_comm_fp8.

    out: a 1-D tensor shaped like `flat` to receive the mean (the DDP bucket itself; any float
    dtype); None for a new fp32 tensor.
    """
    # The collectives are issued here, in the caller's thread, never from a future callback:
    # callbacks run on communication threads in no fixed order, and ranks would then disagree
    # on the order of collectives (a deadlock with several buckets).
    world = dist.get_world_size(group)
    numel = flat.numel()
    chunk = math.ceil(numel / world)

    run = functools.partial(fp8c.kernel, like=flat)  # compiled twins on CUDA, else as is
    # Pre-divide by the world size, so the shared scale bounds every rank's share of the sum.
    amax = run(fp8c.bucket_amax)(flat, world)
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    payload = run(fp8c.encode)(flat, amax, world, fp8_format, chunk * world)
    received = torch.empty_like(payload)
    dist.all_to_all_single(received, payload, group=group)
    # Accumulate in fp32 on receipt (chunk `rank` of every rank's payload), re-quantize with a
    # scale of the chunk's own, and send the chunk with its scale's 4 bytes behind it.
    send = payload.new_empty(chunk + fp8c.SCALE_BYTES)
    chunk_scale = run(fp8c.reduce_chunks_into)(send, received.view(world, chunk), amax, fp8_format)
    send[chunk:].copy_(chunk_scale.view(torch.uint8))
    gathered = send.new_empty(world * (chunk + fp8c.SCALE_BYTES))
    _all_gather_flat(gathered, send, group=group)
    gathered = gathered.view(world, chunk + fp8c.SCALE_BYTES)
    # Every rank, the owner of a chunk included, uses the dequantized fp8 chunk, so all
    # replicas receive identical gradients. A fresh copy, not `contiguous()`: with one rank the
    # slice counts as contiguous, at a byte offset and row stride no float32 view takes.
    scales = gathered[:, chunk:].clone(memory_format=torch.contiguous_format).view(torch.float32)
    if out is None:
        out = torch.empty(numel, dtype=torch.float32, device=flat.device)
    run(fp8c.decode_into)(out, gathered, scales, fp8_format)
    sent = (
        _allreduce_bytes(4, world)  # the amax
        + (world - 1) * chunk  # all-to-all of fp8 payloads
        + (world - 1) * (chunk + fp8c.SCALE_BYTES)  # all-gather of reduced chunks and scales
    )
    return _completed(out), sent


def _completed(value: torch.Tensor) -> torch.Future:
    # On CUDA the future records an event on the current stream, and waiting on it makes the
    # waiter's stream wait for that event (so results from a side stream are safe to read).
    devices = [value.device] if value.device.type == "cuda" else None
    fut = torch.futures.Future(devices=devices)
    fut.set_result(value)
    return fut


def reduce_mean(
    flat: torch.Tensor,
    kind: str,
    *,
    group: dist.ProcessGroup | None = None,
    fp8_format: str = "e4m3",
) -> tuple[torch.Future, float]:
    """Start averaging `flat` across ranks in the precision `kind`.

    Returns (future of an fp32 tensor shaped like `flat`, bytes this rank sends).
    """
    _check(kind, fp8_format)
    if not isinstance(flat, torch.Tensor) or not flat.is_floating_point():
        kind_of = flat.dtype if isinstance(flat, torch.Tensor) else type(flat).__name__
        raise TypeError(f"reduce_mean takes a real floating-point tensor, got {kind_of}")
    flat = flat.reshape(-1)
    if flat.numel() == 0:  # nothing to average: no collective (every rank sees the same size)
        return _completed(torch.empty(0, dtype=torch.float32, device=flat.device)), 0.0
    if kind == "fp32":
        return _mean_fp32(flat, group)
    if kind == "bf16":
        return _mean_bf16(flat, group)
    return _mean_fp8(flat, group, fp8_format)


# ---- DDP hooks -------------------------------------------------------------------------------


# Annotations must be the real classes: DDP validates the hook's signature at registration.
def grad_comm_hook(
    state: GradCommState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average the bucket in `state.kind` and write it back in place.

    The fp8 path decodes the mean straight into the bucket. On CUDA it runs on a side stream,
    so its collectives (which the fp8 scheme needs in sequence) do not hold up the rest of the
    backward pass on the compute stream.
    """
    buffer = bucket.buffer()
    if state.kind == "fp8":
        return _fp8_hook(state, buffer)
    fut, sent = reduce_mean(buffer, state.kind, group=state.group)
    state.count(buffer.numel(), sent)

    def write_back(f: torch.Future) -> torch.Tensor:
        buffer.copy_(f.value().view_as(buffer))
        return buffer

    return fut.then(write_back)


def _fp8_hook(state: GradCommState, buffer: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """The fp8 mean of `buffer` written into it (on the hook's side stream on CUDA)."""
    flat = buffer.view(-1)
    if not buffer.is_cuda:
        _, sent = _mean_fp8(flat, state.group, state.fp8_format, out=flat)
        state.count(buffer.numel(), sent)
        return _completed(buffer)
    stream = state.side_stream(buffer.device)
    stream.wait_stream(torch.cuda.current_stream(buffer.device))
    with torch.cuda.stream(stream):
        _, sent = _mean_fp8(flat, state.group, state.fp8_format, out=flat)
        state.count(buffer.numel(), sent)
        return _completed(buffer)


def register_grad_comm_hook(
    ddp_model: nn.parallel.DistributedDataParallel,
    kind: str,
    *,
    fp8_format: str = "e4m3",
    group: dist.ProcessGroup | None = None,
) -> GradCommState:
    """Register the `kind` ("fp32" | "bf16" | "fp8") gradient hook on a DDP model.

    Returns the hook's state, whose counters report bytes sent per rank.
    """
    _check(kind, fp8_format)
    if not callable(getattr(ddp_model, "register_comm_hook", None)):
        raise TypeError(
            f"register_grad_comm_hook needs a DistributedDataParallel model, got "
            f"{type(ddp_model).__name__} (wrap it in DDP first)"
        )
    state = GradCommState(kind=kind, fp8_format=fp8_format, group=group)
    ddp_model.register_comm_hook(state, grad_comm_hook)
    return state


def measure_grad_comm(
    grad: torch.Tensor,
    kind: str,
    *,
    fp8_format: str = "e4m3",
    group: dist.ProcessGroup | None = None,
) -> GradCommReport:
    """Average `grad` across ranks with `kind` and with an fp32 all-reduce; report bytes sent
    and the error of the former against the latter (collective: call on every rank)."""
    world = dist.get_world_size(group)
    ref_fut, ref_sent = reduce_mean(grad, "fp32", group=group)
    fut, sent = reduce_mean(grad, kind, group=group, fp8_format=fp8_format)
    ref = ref_fut.wait().double()
    out = fut.wait().double()
    err = (out - ref).norm()
    ref_norm = ref.norm()
    return GradCommReport(
        kind=kind,
        world_size=world,
        numel=grad.numel(),
        bytes_sent=sent,
        bytes_sent_fp32=ref_sent,
        sqnr_db=sqnr_db(ref, out),
        max_abs_error=(out - ref).abs().max().item() if out.numel() else 0.0,
        rel_error=(err / ref_norm).item() if ref_norm > 0 else err.item(),
    )


# ---- FSDP2 -----------------------------------------------------------------------------------


def fsdp_reduce_dtype(kind: str) -> torch.dtype:
    """FSDP2 reduce-scatter dtype for a --grad-comm kind (FSDP2 has no fp8 reduce-scatter)."""
    if kind == "fp8":
        raise ValueError(
            "fp8 gradient communication is available with DDP only: FSDP2's reduce-scatter "
            "takes a dtype, not a hook; use --grad-comm fp32 or bf16 with --parallel fsdp"
        )
    _check(kind, "e4m3")
    return torch.float32 if kind == "fp32" else torch.bfloat16


def _check_fsdp_arguments(
    model: object, reduce_dtype: object, param_dtype: object, blocks: list | None
) -> None:
    """apply_fsdp's arguments, checked before anything is sharded: "bf16" for a dtype failed
    at the first forward or backward, 13 frames deep, and a block outside the model was
    sharded silently while the model's own blocks were not."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"apply_fsdp takes an nn.Module, got {type(model).__name__}")
    for name, dtype in (("reduce_dtype", reduce_dtype), ("param_dtype", param_dtype)):
        if dtype is None and name == "param_dtype":
            continue
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(
                f"{name} must be a floating torch.dtype (e.g. torch.bfloat16), got {dtype!r}"
            )
    if blocks is not None:
        inside = {id(m) for m in model.modules()}
        for i, block in enumerate(blocks):
            if not isinstance(block, nn.Module) or id(block) not in inside:
                raise ValueError(
                    f"blocks[{i}] ({type(block).__name__}) is not a submodule of the model"
                )


def apply_fsdp(
    model: nn.Module,
    *,
    reduce_dtype: torch.dtype = torch.float32,
    param_dtype: torch.dtype | None = None,
    mesh=None,  # noqa: ANN001 - a torch.distributed DeviceMesh; None = all ranks
    reshard_after_forward: bool = True,
    blocks: Iterable[nn.Module] | None = None,
    quantized_all_gather: bool = False,
) -> nn.Module:
    """Shard `model` with FSDP2: fully_shard each repeated block, then the root.

    blocks: the modules to shard one by one before the root; None finds them
    (blocks.find_repeated_blocks, which raises NoRepeatedBlocksError, a ValueError, when the
    model has none); pass `()` to shard the root alone.
    reshard_after_forward applies to the blocks; the root is not resharded after forward unless
    it is sharded alone (`blocks=()`).
    MixedPrecisionPolicy(param_dtype, reduce_dtype): param_dtype=None computes with the stored
    dtype (use bf16 autocast for mixed precision), reduce_dtype=fp32 reduce-scatters gradients
    in fp32 (the AMP rule). Works on converted models: QuantLinear is an nn.Linear subclass and
    its extra buffers stay replicated. Returns the same (now sharded) module.

    quantized_all_gather=True all-gathers QuantLinear weights already quantized (FP8 1 byte,
    packed E2M1 0.5 byte a parameter, plus scales; `minifloat.fsdp_quantized`, docs/distributed.md).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    blocks = None if blocks is None else list(blocks)  # a generator is read once
    _check_fsdp_arguments(model, reduce_dtype, param_dtype, blocks)
    blocks = find_repeated_blocks(model) if blocks is None else blocks
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    kwargs = {"mesh": mesh, "mp_policy": policy, "reshard_after_forward": reshard_after_forward}
    if quantized_all_gather:
        world = mesh.size() if mesh is not None else dist.get_world_size()
        if enable_quantized_all_gather(model, world_size=world) == 0 and not any(
            isinstance(m, QuantLinear) for m in model.modules()
        ):
            warnings.warn(
                "apply_fsdp(quantized_all_gather=True): the model has no QuantLinear layer, so "
                "nothing is gathered quantized (convert it first)",
                UserWarning,
                stacklevel=2,
            )
    for block in blocks:
        fully_shard(block, **kwargs)
    # The root keeps its own parameters (embedding, final norm, head) gathered from forward to
    # backward, as fully_shard does for a root by default: backward needs them again at once,
    # and a head applied after the forward (train/head_loss.py) reads the gathered weight.
    # Alone (no blocks) the root is the whole model: the caller's setting holds.
    fully_shard(model, **{**kwargs, "reshard_after_forward": reshard_after_forward and not blocks})
    return model
