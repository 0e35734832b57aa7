"""
Quantized collectives
=====================

An allreduce that sends fewer bytes than the tensor holds, for links where
bandwidth is what a step waits for (DiLoCo's pseudo-gradients across data
centres). Pure torch on the CPU: no Triton, no CUDA kernels.

Two wire formats:

* ``"int8"`` (what ``should_quantize=True`` means): each tensor, flattened, is
  cut into blocks of :data:`BLOCK` elements; each block is sent as one fp32
  scale (its largest magnitude over 127) and one int8 per element, rounded
  to nearest: ``n + 4 * ceil(n / 256)`` bytes for ``n`` elements, about
  1.02 bytes per element instead of 4.
* ``"bf16"``: every element rounded to bfloat16 (2 bytes, 8 significant bits).

The reduction itself never runs on the quantized values: every rank
all-gathers every rank's encoded tensor and sums the decoded values in fp32,
in rank order. All ranks therefore compute bit-identical results, and each
input is rounded exactly once, which bounds the error per element of a sum
over ``W`` ranks (``x_r`` the input of rank ``r``, ``m_r`` the largest
magnitude in that element's block on rank ``r``):

* int8: ``|result - sum_r x_r| <= sum_r m_r / 254`` (plus fp32 rounding);
* bf16: ``|result - sum_r x_r| <= 2**-8 * sum_r |x_r|`` (plus fp32 rounding).

An average divides both sides by ``W``. The all-gather moves ``W - 1``
encoded copies into each rank, against about ``2 (W - 1) / W`` fp32 copies
for a ring allreduce: int8 sends less for up to about 8 ranks, bf16 for up
to about 4. Over a handful of replica groups on a slow link (DiLoCo's
setting) that is a 4x (int8) or 2x (bf16) saving.

A block holding a NaN or an infinity decodes to NaN throughout: the damage
stays visible instead of being rounded away.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "BLOCK",
    "MODES",
    "QuantizedWork",
    "allreduce_quantized",
    "check_allreduce",
    "decode",
    "dequantize_int8",
    "encode",
    "quantization_mode",
    "quantize_int8",
    "start_allreduce",
]

# Elements per int8 block: one 4-byte scale per block costs 1.6 % on the wire.
BLOCK = 256
INT8_MAX = 127
MODES = ("int8", "bf16")
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def quantization_mode(should_quantize: object) -> str | None:
    """The wire format a ``should_quantize`` argument asks for.

    ``False``/``None`` mean none, ``True`` means ``"int8"``; ``"int8"`` and
    ``"bf16"`` name theirs.

    Raises:
        ValueError: any other value.
    """
    if should_quantize is None or should_quantize is False:
        return None
    if should_quantize is True:
        return "int8"
    if isinstance(should_quantize, str) and should_quantize in MODES:
        return should_quantize
    raise ValueError(
        f"should_quantize={should_quantize!r}: give False, True (int8) or one of {MODES}"
    )


def quantize_int8(flat: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 1-D float tensor into int8 blocks with one fp32 scale each.

    The tensor is padded with zeros to a whole number of blocks. A block of
    zeros has scale 0 (and decodes to zeros); a block with a non-finite
    value gets a NaN scale (and decodes to NaN).

    Args:
        flat: the values (any float dtype; read as fp32).
        block: elements per block.

    Returns:
        ``(q, scales)``: int8 of shape ``(blocks, block)`` and fp32 of shape
        ``(blocks,)``.

    Raises:
        ValueError: ``flat`` is not 1-D, or ``block < 1``.
    """
    if flat.dim() != 1:
        raise ValueError(f"quantize_int8 takes a 1-D tensor, got shape {tuple(flat.shape)}")
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    x = flat.detach().to(torch.float32)
    rows = -(-x.numel() // block)
    padded = torch.zeros(rows * block, dtype=torch.float32)
    padded[: x.numel()] = x
    padded = padded.view(rows, block)
    finite = torch.isfinite(padded)
    absmax = padded.abs().amax(dim=1)
    scales = absmax / INT8_MAX
    scales[~finite.all(dim=1)] = float("nan")
    safe = torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(1)
    q = torch.where(finite, torch.round(padded / safe), torch.zeros_like(padded))
    return q.clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, numel: int) -> torch.Tensor:
    """Decode what :func:`quantize_int8` produced into ``numel`` fp32 values."""
    values = q.to(torch.float32) * scales.unsqueeze(1)
    return values.reshape(-1)[:numel]


def _wire_bytes(numel: int, mode: str) -> int:
    if mode == "bf16":
        return 2 * numel
    return 4 * -(-numel // BLOCK) + numel


def encode(flat: torch.Tensor, mode: str) -> torch.Tensor:
    """Encode a 1-D float tensor into the bytes one rank sends (uint8).

    Raises:
        ValueError: unknown ``mode``, or ``flat`` is not 1-D.
    """
    if mode == "bf16":
        if flat.dim() != 1:
            raise ValueError(f"encode takes a 1-D tensor, got shape {tuple(flat.shape)}")
        return flat.detach().to(torch.bfloat16).contiguous().view(torch.uint8)
    if mode != "int8":
        raise ValueError(f"unknown quantization mode {mode!r}; give one of {MODES}")
    q, scales = quantize_int8(flat)
    # The last block's padding is not sent.
    values = q.view(torch.uint8).reshape(-1)[: flat.numel()]
    return torch.cat([scales.view(torch.uint8), values])


def decode(wire: torch.Tensor, numel: int, mode: str) -> torch.Tensor:
    """Decode one rank's bytes (see :func:`encode`) into ``numel`` fp32 values.

    Raises:
        ValueError: unknown ``mode``, or ``wire`` has the wrong length.
    """
    if wire.numel() != _wire_bytes(numel, mode):
        raise ValueError(
            f"{wire.numel()} bytes do not encode {numel} elements as {mode} "
            f"({_wire_bytes(numel, mode)} expected)"
        )
    if mode == "bf16":
        # A rank's bytes inside a gathered buffer may sit at any offset; a
        # copy is aligned for the wider dtype.
        return wire.clone().view(torch.bfloat16).to(torch.float32)
    if mode != "int8":
        raise ValueError(f"unknown quantization mode {mode!r}; give one of {MODES}")
    rows = -(-numel // BLOCK)
    scales = wire[: 4 * rows].clone().view(torch.float32)
    q = torch.zeros(rows * BLOCK, dtype=torch.int8)
    q[:numel] = wire[4 * rows :].view(torch.int8)
    return dequantize_int8(q.view(rows, BLOCK), scales, numel)


class QuantizedWork(dist._Work):
    """The work of one :func:`allreduce_quantized`: done once the tensors hold the result.

    Args:
        future: completes with the tensors once they are written, or fails
            with the collective's error.
    """

    def __init__(self, future: torch.futures.Future[Any]) -> None:
        super().__init__()
        self._future = future

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Wait for the result; raises the collective's error if it failed."""
        self._future.wait()
        return True

    def is_completed(self) -> bool:
        """Whether the result is written (or the collective failed)."""
        return bool(self._future.done())

    def get_future(self) -> torch.futures.Future[Any]:
        """A future of the tensors, complete once they hold the result."""
        return self._future


def _reduce_op(opts: Any) -> Any:
    return opts.reduceOp if isinstance(opts, dist.AllreduceOptions) else opts


def allreduce_quantized(
    tensors: Sequence[torch.Tensor],
    opts: Any,
    process_group: Any,
    sync_stream: Any = None,
    *,
    mode: str = "int8",
) -> QuantizedWork:
    """Sum or average ``tensors`` over ``process_group`` in place, sending them quantized.

    torchft's signature (``torchft.collectives.allreduce_quantized``); see
    the module docstring for the format and the error bound. The tensors
    are encoded now; the all-gather runs in the background, and the decoded
    result is written into ``tensors`` before the returned work completes.

    Args:
        tensors: fp32, fp16 or bf16 tensors, on the CPU.
        opts: ``ReduceOp.SUM``/``AVG`` or ``AllreduceOptions`` holding one.
        process_group: any ProcessGroup with ``all_gather_single``
            (``_allgather_base``).
        sync_stream: accepted for torchft compatibility (CPU: unused).
        mode: ``"int8"`` or ``"bf16"``.

    Returns:
        A :class:`QuantizedWork`.

    Raises:
        NotImplementedError: a reduce op other than SUM or AVG.
        ValueError: unknown ``mode``, or a tensor of another dtype.
    """
    op = _reduce_op(opts)
    if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        raise NotImplementedError(
            f"ReduceOp {op} is not supported for quantized allreduce, "
            "only AVG and SUM are supported"
        )
    if mode not in MODES:
        raise ValueError(f"unknown quantization mode {mode!r}; give one of {MODES}")
    for t in tensors:
        if t.dtype not in _FLOATS:
            raise ValueError(
                f"quantized allreduce takes fp32, fp16 or bf16 tensors, got {t.dtype}; "
                "reduce it without quantization"
            )
    targets = list(tensors)
    sizes = [t.numel() for t in targets]
    # Each tensor is encoded on its own: a block never mixes two tensors,
    # so a large tensor cannot drown a small one's values.
    parts = [encode(t.detach().reshape(-1).to(torch.float32), mode) for t in targets]
    wire = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)
    lengths = [p.numel() for p in parts]
    world = process_group.size()
    gathered = torch.empty(world * wire.numel(), dtype=torch.uint8)
    work = process_group.all_gather_single(gathered, wire)
    divide = op == dist.ReduceOp.AVG

    def finish(fut: torch.futures.Future[Any]) -> list[torch.Tensor]:
        fut.value()  # the all-gather's error, if any, fails this future
        chunks = gathered.view(world, -1)
        with torch.no_grad():
            offset = 0
            for t, n, length in zip(targets, sizes, lengths, strict=True):
                total = torch.zeros(n, dtype=torch.float32)
                for r in range(world):  # rank order: every rank sums identically
                    total += decode(chunks[r, offset : offset + length], n, mode)
                if divide:
                    total /= world
                t.copy_(total.view_as(t))
                offset += length
        return targets

    return QuantizedWork(work.get_future().then(finish))


def check_allreduce(tensor: torch.Tensor, reduce_op: Any, should_quantize: object) -> str | None:
    """Check a Manager allreduce's arguments before anything is sent.

    Returns:
        The wire format (see :func:`quantization_mode`), or None.

    Raises:
        ValueError: ``AVG`` of a tensor that is not floating point, a
            ``should_quantize`` that names no format, or quantizing a tensor
            that is not fp32, fp16 or bf16.
    """
    if reduce_op == dist.ReduceOp.AVG and not tensor.is_floating_point():
        raise ValueError(
            f"ReduceOp.AVG needs a floating-point tensor, got {tensor.dtype}; "
            "use ReduceOp.SUM and divide"
        )
    mode = quantization_mode(should_quantize)
    if mode is not None and tensor.dtype not in _FLOATS:
        raise ValueError(
            f"should_quantize needs an fp32, fp16 or bf16 tensor, got {tensor.dtype}; "
            "pass should_quantize=False"
        )
    return mode


def start_allreduce(pg: Any, tensor: torch.Tensor, op: Any, mode: str | None) -> Any:
    """Start one allreduce of ``tensor`` on ``pg``: quantized when ``mode`` says so.

    Quantization applies to SUM and AVG only; other ops (MAX, MIN, ...)
    always run at full precision, where rounding would change the answer.
    """
    if mode is not None and op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        return allreduce_quantized([tensor], op, pg, mode=mode)
    return pg.allreduce([tensor], op)
