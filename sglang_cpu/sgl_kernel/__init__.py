"""The names SGLang's CPU path imports from `sgl_kernel`, for a machine without a GPU.

SGLang 0.5.23 imports eight names from its kernel package at module import time on the CPU path.
Their callers are speculative decoding and the KV-cache move of hierarchical caching, never plain
decoding, and the CPU build of the kernels is not on PyPI (the `sglang-kernel` wheel needs CUDA:
`libcuda.so.1`). `make sglang` puts this directory on `.venv-sglang`'s path only where no GPU is
present; with a GPU the real `sglang-kernel` is installed and this module is never seen.

Each name raises if it is ever called, so a code path that needs a real kernel fails loudly.
"""

from __future__ import annotations

NAMES = (
    "copy_all_layer_kv_cache_cpu",
    "assign_req_to_token_pool_cpu",
    "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
)


def _absent(name: str):
    def kernel(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} was called, but this is asyncrl's CPU stand-in for SGLang's kernel package "
            "(sglang_cpu/sgl_kernel): the CPU kernels are not on PyPI. The feature that called it "
            "(speculative decoding, hierarchical KV cache) needs a GPU machine with sglang-kernel installed.")

    kernel.__name__ = kernel.__qualname__ = name
    return kernel


globals().update({name: _absent(name) for name in NAMES})
__all__ = list(NAMES)
