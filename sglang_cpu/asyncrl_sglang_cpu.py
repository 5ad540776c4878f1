"""An SGLang plugin for a machine without a GPU: the host buffers SGLang pins, allocated unpinned.

SGLang 0.5.23 allocates the host copy of what its state capturers record (the routed experts of
`--enable-return-routed-experts`, which routing replay reads: `asyncrl.engines.sglang_routes`) with
`sglang.srt.mem_cache.pool_host.common.ALLOC_MEMORY_FUNCS[device]`. Its default for every device
but npu, musa and xpu pins the buffer with `cudaHostRegister` through `torch.cuda.cudart()`, which
raises without a CUDA driver ("Found no NVIDIA driver on your system", from
`state_capturer/base.py:68` via `pool_host/common.py:147`), so the CPU backend cannot start with
the capture on. Pinning means nothing for a CPU engine: this plugin gives the `cpu` device a plain
allocation. SGLang loads it in each of its processes (`sglang.srt.plugins.load_plugins`, the
`sglang.srt.plugins` entry point of `asyncrl_sglang_cpu-0.dist-info` beside this file), found
because `make sglang` puts `sglang_cpu/` on the path only where no GPU is present.
"""

from __future__ import annotations

NAME = "asyncrl_cpu_host_buffers"  # the entry point's name (`asyncrl.engines.sglang_launch` looks for it)


def unpinned(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
    """`ALLOC_MEMORY_FUNCS`' signature: the allocator's buffer as it is (no host registration)."""
    return allocator.allocate(dims, dtype=dtype, device=device)


def register() -> None:
    from sglang.srt.mem_cache.pool_host import common

    common.ALLOC_MEMORY_FUNCS.setdefault("cpu", unpinned)
