"""Which software ran out of memory: the OOM family of a line, and whether a host-RAM line is
certain.

Apart from the figure readers (`oom`) because the scanner asks this of every line it reads,
most of which report nothing: each family's patterns run only when a literal word they cannot
match without is in the line (`in`, at C speed). The patterns run in linear time on any text.

Two families report a device short of memory without any figure: an inference engine that
found no room for its KV cache (vLLM, SGLang), and cuBLAS/cuDNN failing to create a handle
(`*_STATUS_NOT_INITIALIZED`, weak evidence: a broken install reads the same).
"""

from __future__ import annotations

import re

from daemon.evidence.records import OomFamily

# A size in a trigger: only its shape matters there (the figure is read later, exactly).
_LOOSE_SIZE = r"[0-9][0-9.]{0,40} ?(?:bytes|[KMGTPE]iB)"

_TORCH_OOM = re.compile(
    r"(?:CUDA|HIP|XPU) out of memory\."
    r"|(?<!java\.lang\.)OutOfMemoryError"  # java.lang.OutOfMemoryError is the JVM's heap
    r"|MPS backend out of memory"
    r"|Allocation on device [0-9]{1,4} would exceed allowed memory"  # cudaMallocAsync
    # the message with its first words lost: from the request on (real/oom/035), the old
    # parenthetical alone (036), or the 2.1+ capacity sentence
    r"|Tried to allocate (?:more than 1EB|" + _LOOSE_SIZE + r" \(GPU )"
    r"|\(GPU [0-9]{1,4}; " + _LOOSE_SIZE + r" total capac"
    r"|GPU [0-9]{1,4} has a total capac(?:ity|ty) of [0-9]",
    re.IGNORECASE,
)

_XLA = re.compile(r"RESOURCE_EXHAUSTED|Resource exhausted|OOM when allocating tensor", re.I)

_XLA_MEMORY = re.compile(r"memory|allocat", re.IGNORECASE)

# TensorFlow raises ResourceExhaustedError for its BFC allocator's OOM (real/oom/043).
_XLA_CERTAIN = re.compile(r"ResourceExhaustedError")

# The status ends the line: its message ("Out of memory while trying to allocate N bytes")
# was wrapped onto the next one (real/oom/070: `Resource exhausted: Out ` / `of memory ...`).
XLA_WRAPPED = re.compile(r"(?:RESOURCE_EXHAUSTED|Resource exhausted): ?[^\n]{0,24}\Z", re.I)

_NCCL = re.compile(r"NCCL WARN Cuda failure (?:\d+ )?'out of memory'")

_CUBLAS = re.compile(r"CUBLAS_STATUS_ALLOC_FAILED")

_CUDNN = re.compile(r"CUDNN_STATUS_(?:ALLOC_FAILED|NOT_ENOUGH_WORKSPACE)", re.IGNORECASE)

_CUDA_RUNTIME = re.compile(
    r"CUDA error: out of memory|CUDA_ERROR_OUT_OF_MEMORY|cudaErrorMemoryAllocation"
    r"|cuda runtime error \(2\) : out of memory"
    r"|CUDA Exception: out of memory"  # Haskell accelerate-cuda (real/oom/099)
    r"|error == cudaSuccess\. 2 vs 0\b"  # Caffe2's enforce; CUDA error 2 is out of memory (060)
    r"|hipErrorOutOfMemory|HIP_ERROR_OutOfMemory"  # the HIP runtime, TF on ROCm (063)
)

# An inference engine sizing its KV cache at start, in the GPU memory left after the weights:
# vLLM's V0 worker (vllm/worker/worker.py `raise_if_cache_size_invalid`: no blocks at all, or
# fewer than one request of max_model_len), its V1 core (vllm/v1/core/kv_cache_utils.py
# `check_enough_kv_cache_memory`), and SGLang's token pool (model_runner.py, later
# pool_configurator.py: `max_total_num_tokens <= 0`). Real posts: real/oom/155-159.
_KV_CACHE = re.compile(
    r"No available memory for the cache blocks"
    r"|is larger than the maximum number of tokens that can be stored in KV cache"
    r"|KV cache is needed, which is larger than the available KV cache memory"
    r"|Not enough memory\. Please try to increase --mem-fraction-static"
)

# cublasCreate / cudnnCreate return NOT_INITIALIZED when they cannot get the device resources a
# handle needs (PyTorch `CUDA error: CUBLAS_STATUS_NOT_INITIALIZED when calling
# `cublasCreate(handle)``, `cuDNN error: CUDNN_STATUS_NOT_INITIALIZED`, TF's `could not create
# cudnn handle: ...`; real/oom/177, 180, 181): in practice most often a device out of memory,
# but a CUDA/cuDNN install that does not fit the card reads the same.
_LIBRARY_HANDLE = re.compile(r"CU(?:BLAS|DNN)_STATUS_NOT_INITIALIZED")

# ONNX Runtime's BFC arena (onnxruntime/core/framework/bfc_arena.cc, real/oom/094)
_ONNX = re.compile(r"Failed to allocate memory for requested buffer of size [0-9]")

_HOST_RAM = re.compile(
    r"Detected \d+ oom[-_]kill event"
    r"|oom[-_]kill event"
    r"|: tasks? [\d\-,]+: Out Of Memory"
    r"|Out of memory: Kill(?:ed)? process \d+"
    r"|Memory cgroup out of memory"
    r"|DataLoader worker \(pids?(?:\(s\))? [\d, ]+\) is killed by signal: Killed"
    r"|\bKilled process \d+ \("
    r"|[Ee]xceeded (?:job|step) memory limit"
    r"|exceeded memory limit \(\d+ > \d+\), being killed"
    # host-RAM signs that do not name the OOM killer: a SIGKILL, a failed host allocation
    r"|(?P<weak>"
    # a line of its own (not \s*, which would run across lines); markdown may bold it (107)
    r"^[^\S\n]*(?:\*\*)?Killed(?:\*\*)?[^\S\n]*$"
    r"|line \d+:\s+\d+ Killed\b"
    r"|: tasks? [\d\-,]+: Killed\b"
    r"|exitcode\s*:\s*-9\b"
    r"|failed \(exitcode: -9\)"
    r"|Signal 9 \(SIGKILL\) received"
    r"|DefaultCPUAllocator: can't allocate memory"  # c10's CPU allocator (084, 085)
    r"|not enough memory: you tried to allocate"  # TH's CPU allocator, PyTorch <= 0.4 (106)
    r"|std::bad_alloc"  # C++ operator new (086)
    # ENOMEM (errno 12, strerror "Cannot allocate memory") as Python's OSError prints it (a
    # DataLoader's fork) and as the JVM's os::commit_memory does, with the JVM's own sentence
    # (real/oom/195: a 128 MB container)
    r"|\[Errno 12\] Cannot allocate memory"
    r"|Cannot allocate memory'? \(errno=12\)"
    r"|insufficient memory for the Java Runtime Environment"
    r")",
    re.MULTILINE,
)

TRIGGERS = (
    _HOST_RAM,
    _NCCL,
    _CUBLAS,
    _CUDNN,
    _TORCH_OOM,
    _XLA,
    _XLA_CERTAIN,
    _CUDA_RUNTIME,
    _ONNX,
    _KV_CACHE,
    _LIBRARY_HANDLE,
)

# Literal words each family's patterns cannot match without (a pattern's every alternative
# holds one): `in` finds them at C speed, so the patterns run only on the few lines that may
# match. A scan asks every line it reads, most of which report nothing.
_HOST_RAM_WORDS = (
    "oom-kill",
    "oom_kill",
    "Out Of Memory",
    "cgroup out of memory",  # not "out of memory" alone: every GPU message holds that
    "Out of memory",
    "illed",
    "xceeded",
    "exitcode",
    "SIGKILL",
    "CPUAllocator",
    "not enough memory",
    "bad_alloc",
    "Errno 12",
    "errno=12",
    "Java Runtime",
)

_TORCH_WORDS = ("emory", "EMORY", "llocate", "LLOCATE", "apac", "APAC")  # any case: see _TORCH_OOM

_XLA_WORDS = ("xhausted", "XHAUSTED", "OOM when", "oom when")

_KV_CACHE_WORDS = ("cache blocks", "KV cache", "mem-fraction-static")

_LIBRARY_HANDLE_WORDS = ("NOT_INITIALIZED",)

# Families whose report carries no device figure: the host's RAM, an engine's KV-cache sizing,
# a library's failed handle.
NO_DEVICE_FIGURES = frozenset({OomFamily.HOST_RAM, OomFamily.KV_CACHE, OomFamily.LIBRARY_HANDLE})


def _has_any(text: str, words: tuple[str, ...]) -> bool:
    # a plain loop: `any()` over a generator costs more than the substring tests themselves
    for word in words:  # noqa: SIM110
        if word in text:
            return True
    return False


def detect_family(text: str) -> OomFamily | None:
    """Which OOM family a line belongs to, or None if it reports no out-of-memory."""
    if _has_any(text, _HOST_RAM_WORDS) and _HOST_RAM.search(text):
        return OomFamily.HOST_RAM
    if _NCCL.search(text):
        return OomFamily.NCCL
    if _CUBLAS.search(text):
        return OomFamily.CUBLAS
    if _CUDNN.search(text):
        return OomFamily.CUDNN
    if _has_any(text, _TORCH_WORDS) and _TORCH_OOM.search(text):
        return OomFamily.TORCH_ALLOCATOR
    if _has_any(text, _XLA_WORDS) and (_XLA_CERTAIN.search(text) or _xla_status(text)):
        return OomFamily.XLA
    if _CUDA_RUNTIME.search(text):
        return OomFamily.CUDA_RUNTIME
    if _ONNX.search(text):
        return OomFamily.ONNX_RUNTIME
    # last: a text that holds a device OOM message too is that message's family
    if _has_any(text, _KV_CACHE_WORDS) and _KV_CACHE.search(text):
        return OomFamily.KV_CACHE
    if _has_any(text, _LIBRARY_HANDLE_WORDS) and _LIBRARY_HANDLE.search(text):
        return OomFamily.LIBRARY_HANDLE
    return None


def _xla_status(text: str) -> bool:
    if _XLA.search(text) is None:
        return False
    return _XLA_MEMORY.search(text) is not None or XLA_WRAPPED.search(text) is not None


def host_ram_is_certain(text: str) -> bool:
    """True when a host-RAM line names the OOM killer; False for a bare SIGKILL or a failed
    host allocation."""
    return any(match.group("weak") is None for match in _HOST_RAM.finditer(text))
