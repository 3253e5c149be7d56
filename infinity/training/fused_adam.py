"""Adam and AdamW over state kept in fewer bytes, in one pass per element (``fused_adam.c``).

With ``optimizer_state_dtype`` int8 or bf16, or bf16 masters, each element of an update goes
through a chain of torch operations: the two moments decoded, the master and the gradient
widened to fp32, torch's fused Adam, the master rounded back, the moments encoded. Each link
reads and writes the whole group, about ten passes over memory per element; on two cores that
chain took 50 of an 8 B full fine-tune's 58 s optimizer step, with the disk idle for much of it.

The kernel does the same arithmetic in one pass over blocks of 2048 elements that stay in the
first-level cache: torch's fused CPU Adam on the fp32 values (its formula and its order of
operations, the bias corrections in double as torch computes them), the codecs of
:mod:`~infinity.training.state_codecs` and the stochastic rounding of
:mod:`~infinity.training.master_rounding`, with the same noise tables and offsets. Its results
are those of the chain, bit for bit, except where torch's kernel rounds differently in the last
elements of a tensor (its scalar tail, which the compiler may or may not fuse): there an fp32
value can differ in its last bit (``tests/test_fused_adam.py`` checks both).

It applies to ``torch.optim.Adam`` and ``AdamW`` with torch's fused kernel (the store picks it
for default options, :func:`~infinity.training.optimizer._construct_like`), without amsgrad:
anything else runs as torch operations. The kernel is compiled on first use with the host's C
compiler (``$CC``, else ``cc``) for this CPU and kept under ``$XDG_CACHE_HOME/infinity``
(``~/.cache``); without a compiler, or with ``INFINITY_FUSED_KERNELS=0`` in the environment,
updates run as torch operations, with the same results and slower.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from infinity.training.state_codecs import CHUNK, INT8_BLOCK

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("fused_adam.c")
_FLAGS = (
    "-O3",
    "-march=native",
    "-ffp-contract=off",
    "-fno-math-errno",
    "-std=c11",
    "-fPIC",
    "-shared",
)
#: elements a kernel call converts per block (the int8 codec's: a call's range starts on one);
#: the noise of compressed state runs in chunks of NOISE_CHUNK (both fixed in fused_adam.c too)
BLOCK = INT8_BLOCK
NOISE_CHUNK = CHUNK
#: a shard smaller than this many blocks per thread is updated on the calling thread alone
_BLOCKS_PER_THREAD = 16
STATE_KINDS = {"fp32": 0, "bf16": 1, "int8": 2}
#: torch's kernel computes a tensor's last ``numel % 8`` elements in scalar code, which rounds
#: one product differently (its vector loops, and the compiler's 8-wide epilogue after its
#: 16-wide AVX-512 loop, fuse the other): measured against torch's x86 wheels
_TORCH_SCALAR_AFTER = 8


class _Args(ctypes.Structure):
    """``update_args`` of fused_adam.c, field for field."""

    _fields_ = [
        ("param", ctypes.c_void_p),
        ("grad", ctypes.c_void_p),
        ("state", ctypes.c_void_p * 2),
        ("scales", ctypes.c_void_p * 2),
        ("param_noise", ctypes.c_void_p),
        ("state_noise", ctypes.c_void_p),
        ("state_offsets", ctypes.c_void_p * 2),
        ("param_offset", ctypes.c_int64),
        ("begin", ctypes.c_int64),
        ("end", ctypes.c_int64),
        ("tail_start", ctypes.c_int64),
        ("param_bf16", ctypes.c_int32),
        ("grad_bf16", ctypes.c_int32),
        ("state_kind", ctypes.c_int32),
        ("maximize", ctypes.c_int32),
        ("decoupled", ctypes.c_int32),
        ("grad_factor", ctypes.c_float),
        ("lerp_weight", ctypes.c_float),
        ("beta2", ctypes.c_float),
        ("sq_coeff", ctypes.c_float),
        ("bc2_sqrt", ctypes.c_float),
        ("eps", ctypes.c_float),
        ("neg_step_size", ctypes.c_float),
        ("decay_mul", ctypes.c_float),
        ("decay", ctypes.c_float),
    ]


@dataclass(frozen=True)
class AdamSettings:
    """One param group's Adam settings, as torch's fused kernel takes them."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    maximize: bool
    decoupled: bool

    @staticmethod
    def of(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> AdamSettings | None:
        """``group``'s settings where the kernel computes what torch's fused Adam would; None
        where it does not apply (another optimizer, another kernel chosen, amsgrad)."""
        if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
            return None
        if not group.get("fused") or group.get("amsgrad") or group.get("capturable"):
            return None
        if group.get("differentiable"):
            return None
        beta1, beta2 = (float(b) for b in group["betas"])
        decoupled = bool(
            group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW))
        )
        return AdamSettings(
            lr=float(group["lr"]),
            beta1=beta1,
            beta2=beta2,
            eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]),
            maximize=bool(group.get("maximize", False)),
            decoupled=decoupled,
        )


@dataclass
class KernelShard:
    """One shard's tensors for an update, all flat and contiguous on the host."""

    master: torch.Tensor  # bf16 (rounded stochastically) or fp32
    grad: torch.Tensor  # bf16 or fp32
    grad_factor: float
    #: exp_avg's and exp_avg_sq's stored values: fp32, bf16, or int8's codes (uint8)
    states: tuple[torch.Tensor, torch.Tensor]
    #: int8: each state's scales (fp32, one per block)
    scales: tuple[torch.Tensor, torch.Tensor] | None
    #: the masters' noise (a permutation of [0, 65536)) and this update's offset into it
    master_noise: tuple[torch.Tensor, int] | None
    #: the codec's noise table and, per state, the offsets of its noise chunks
    state_noise: tuple[torch.Tensor, tuple[Sequence[int], Sequence[int]]] | None


class FusedAdam:
    """Runs the kernel over shards on the host's threads (torch's intra-op count)."""

    def __init__(self, library: ctypes.CDLL, state_kind: str) -> None:
        self._function = library.infinity_fused_adam
        self._kind = STATE_KINDS[state_kind]
        self._threads = max(1, torch.get_num_threads())

    def update(self, shard: KernelShard, settings: AdamSettings, step: float) -> None:
        """Updates ``shard`` in place as torch's fused Adam at ``step`` (counted from 1) would,
        then rounds and encodes its master and state as the chain of torch operations does."""
        self._check(shard)
        numel = shard.master.numel()
        base = self._base_args(shard, settings, step)
        offsets = []
        if shard.state_noise is not None:
            offsets = [torch.tensor(list(o), dtype=torch.int64) for o in shard.state_noise[1]]
            for which, array in enumerate(offsets):
                base.state_offsets[which] = array.data_ptr()
        blocks = -(-numel // BLOCK)
        parts = min(self._threads, max(1, blocks // _BLOCKS_PER_THREAD))
        per_part = -(-blocks // parts) * BLOCK
        calls = []
        for begin in range(0, numel, per_part):
            args = _Args.from_buffer_copy(base)
            args.begin, args.end = begin, min(numel, begin + per_part)
            calls.append(args)
        if len(calls) == 1:
            self._function(ctypes.byref(calls[0]))
        else:
            pool = _executor(len(calls))
            for future in [pool.submit(self._function, ctypes.byref(a)) for a in calls]:
                future.result()
        del offsets  # kept alive until the calls are done

    def _check(self, shard: KernelShard) -> None:
        """The kernel trusts its pointers: every tensor's layout is checked here first."""
        numel = shard.master.numel()
        state_dtype = {0: torch.float32, 1: torch.bfloat16, 2: torch.uint8}[self._kind]
        expected: list[tuple[torch.Tensor, torch.dtype | None, int]] = [
            (shard.master, None, numel),
            (shard.grad, None, numel),
        ]
        expected += [(state, state_dtype, numel) for state in shard.states]
        if self._kind == STATE_KINDS["int8"]:
            if shard.scales is None or shard.state_noise is None:
                raise ValueError("int8 state needs its scales and its noise")
            expected += [(scales, torch.float32, -(-numel // BLOCK)) for scales in shard.scales]
        for tensor, dtype, count in expected:
            if not tensor.is_contiguous() or tensor.numel() != count or tensor.device.type != "cpu":
                raise ValueError(f"a {tuple(tensor.shape)} tensor where {count} host elements")
            if dtype is not None and tensor.dtype != dtype:
                raise ValueError(f"{tensor.dtype} state where {dtype}")
        if shard.state_noise is not None:
            table, offsets = shard.state_noise
            chunks = -(-numel // NOISE_CHUNK)
            for chunk_offsets in offsets:
                if len(chunk_offsets) < chunks or any(
                    o < 0 or o + min(numel, NOISE_CHUNK) > table.numel() for o in chunk_offsets
                ):
                    raise ValueError("the noise offsets run past the noise table")
        elif self._kind != STATE_KINDS["fp32"]:
            raise ValueError("compressed state needs its noise")
        if shard.master.dtype == torch.bfloat16 and (
            shard.master_noise is None or shard.master_noise[0].numel() != 1 << 16
        ):
            raise ValueError("bf16 masters need the 65536 values of their noise")

    def _base_args(self, shard: KernelShard, settings: AdamSettings, step: float) -> _Args:
        args = _Args()
        numel = shard.master.numel()
        args.tail_start = numel - numel % _TORCH_SCALAR_AFTER
        args.param = shard.master.data_ptr()
        args.param_bf16 = _bf16(shard.master)
        args.grad = shard.grad.data_ptr()
        args.grad_bf16 = _bf16(shard.grad)
        args.grad_factor = shard.grad_factor
        for which, state in enumerate(shard.states):
            args.state[which] = state.data_ptr()
        args.state_kind = self._kind
        if shard.scales is not None:
            for which, scales in enumerate(shard.scales):
                args.scales[which] = scales.data_ptr()
        if shard.master_noise is not None:
            args.param_noise = shard.master_noise[0].data_ptr()
            args.param_offset = shard.master_noise[1]
        if shard.state_noise is not None:
            args.state_noise = shard.state_noise[0].data_ptr()
        # torch's fused Adam: the bias corrections in double, each constant then as fp32
        bias_correction1 = 1 - settings.beta1**step
        bias_correction2 = 1 - settings.beta2**step
        args.lerp_weight = 1 - settings.beta1
        args.beta2 = settings.beta2
        args.sq_coeff = 1 - settings.beta2
        args.bc2_sqrt = bias_correction2**0.5
        args.eps = settings.eps
        args.neg_step_size = -(settings.lr / bias_correction1)
        args.decay = settings.weight_decay
        args.decay_mul = 1 - settings.lr * settings.weight_decay
        args.maximize = int(settings.maximize)
        args.decoupled = int(settings.decoupled)
        return args


_lock = threading.Lock()
_pools: dict[int, ThreadPoolExecutor] = {}


def _executor(threads: int) -> ThreadPoolExecutor:
    """The process's threads for kernel calls (one pool per count, shared by every optimizer:
    the calls release the GIL)."""
    with _lock:
        pool = _pools.get(threads)
        if pool is None:
            pool = _pools[threads] = ThreadPoolExecutor(threads, thread_name_prefix="infinity-adam")
        return pool


def _bf16(tensor: torch.Tensor) -> int:
    if tensor.dtype == torch.bfloat16:
        return 1
    assert tensor.dtype == torch.float32, tensor.dtype
    return 0


# -- building the kernel --------------------------------------------------------------------------
_loaded: dict[str, ctypes.CDLL | None] = {}


def library() -> ctypes.CDLL | None:
    """The compiled kernel (built on first use, then loaded from the cache), or None where it
    cannot be built here or ``INFINITY_FUSED_KERNELS=0`` turns it off (the caller then updates
    with torch operations)."""
    if os.environ.get("INFINITY_FUSED_KERNELS", "1") == "0":
        return None
    with _lock:
        if "adam" not in _loaded:
            _loaded["adam"] = _load()
        return _loaded["adam"]


def _load() -> ctypes.CDLL | None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.info(
            "no C compiler found ($CC, cc, gcc): the optimizer's host updates run as torch "
            "operations (the same results, slower); install one for the fused kernel"
        )
        return None
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(
        b"\0".join([source, " ".join(_FLAGS).encode(), compiler.encode(), _cpu_identity()])
    ).hexdigest()[:16]
    target = _cache_dir() / f"fused_adam-{key}.so"
    if not target.exists():
        try:
            _compile(compiler, target)
        except (OSError, subprocess.SubprocessError) as exc:
            log.warning(
                "could not build the fused optimizer kernel (%s): host updates run as torch "
                "operations (the same results, slower)",
                exc,
            )
            return None
    try:
        library = ctypes.CDLL(str(target))
    except OSError as exc:
        log.warning("could not load the fused optimizer kernel %s (%s)", target.name, exc)
        return None
    library.infinity_fused_adam.argtypes = [ctypes.c_void_p]
    library.infinity_fused_adam.restype = None
    return library


def _compile(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Several processes (ranks) may build at once: each writes its own file, the last rename wins.
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    command = [compiler, *_FLAGS, str(_SOURCE), "-o", str(partial), "-lm"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise subprocess.SubprocessError(f"{compiler} failed: {done.stderr.strip()[-500:]}")
    os.replace(partial, target)
    log.info("built the fused optimizer kernel %s", target.name)


def _cache_dir() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "infinity"
    try:
        root.mkdir(parents=True, exist_ok=True)
        if os.access(root, os.W_OK):
            return root / "kernels"
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / f"infinity-kernels-{os.getuid()}"


def _cpu_identity() -> bytes:
    """What -march=native depends on: the CPU's model and flags (a cache shared by machines
    keeps one build per kind of CPU)."""
    identity = platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(("model name", "flags", "Features")):
                    identity += line
                if line.strip() == "":
                    break  # the first processor's
    except OSError:
        pass
    return identity.encode()
