"""Every reach into another library's private surface, with one version table (:data:`PRIVATE_SURFACES`).

Each surface names the package whose internals it uses and the versions it was checked against (None: any version,
guarded by a feature test instead). Where a surface cannot be used, the caller takes its public fallback and
:func:`fallback_reason` logs why, once per surface and reason.

Surfaces: FlashInfer's decode-wrapper fields (fast re-planning, :mod:`attnbackends.ops.flashinfer.fast_plan`),
FlashInfer's JIT module generators (ahead-of-time builds, :mod:`attnbackends.flashinfer.warmup`), Triton's
compiled-kernel launcher (used by :mod:`attnbackends.ops.launch`), aten's memory-efficient attention with its
log-sum-exp (:func:`efficient_attention_with_lse`), Triton's scratch allocator
(:func:`ensure_triton_scratch_allocator`), FlashInfer MLA's planned page ids (contained in place by
:mod:`attnbackends.mla.backends` for device-only block tables) and flash-attn 4's ``flash_attn.cute``
(:func:`flash_attn_cute_available`, its private forward :func:`flash_attn_cute_private_forward`). Availability of the
optional packages themselves is decided here too (:func:`flashinfer_installed`, :func:`import_flashinfer`).
"""

from __future__ import annotations

import importlib.metadata
import logging
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, Optional

import torch
import triton
from triton import knobs

from . import platform as _platform

__all__ = [
    "PRIVATE_SURFACES",
    "PrivateSurface",
    "cuda_sleep",
    "descriptor_encoder",
    "direct_launch_unsupported_reason",
    "efficient_attention_with_lse",
    "ensure_triton_scratch_allocator",
    "fallback_reason",
    "flash_attn_cute_available",
    "flash_attn_cute_private_forward",
    "flashinfer_installed",
    "flashinfer_jit_generators",
    "gluon_available",
    "import_flashinfer",
    "launch_hooks_set",
    "package_version",
    "raw_descriptor_launch",
    "raw_stream_getters",
    "surface_unsupported_reason",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrivateSurface:
    """A private API of ``package`` that this library uses: what it is and the versions it was checked against."""

    package: str
    what: str
    tested_versions: Optional[frozenset[str]] = None  # None: any version (a feature test guards it)


#: The version table: one entry per private surface.
PRIVATE_SURFACES: dict[str, PrivateSurface] = {
    "flashinfer_decode_replan": PrivateSurface(
        "flashinfer-python", "BatchDecodeWithPagedKVCacheWrapper's private fields, re-planned without plan()",
        frozenset({"0.6.13"})),
    "flashinfer_jit": PrivateSurface(
        "flashinfer-python", "flashinfer.jit module generators (gen_batch_decode_module, gen_batch_prefill_module, "
        "gen_cascade_module) and flashinfer.utils.determine_attention_backend (their signatures are checked by "
        "calling them: a mismatch is a logged fallback)"),
    "triton_compiled_launch": PrivateSurface(
        "triton", "launching the CompiledKernel that a JIT launch returns through its own launcher "
        "(compiled.run(grid, stream, compiled.function, compiled.packed_metadata, hooks, *args))",
        frozenset({"3.6.0"})),
    "aten_efficient_attention": PrivateSurface(
        "torch", "torch.ops.aten._scaled_dot_product_efficient_attention (SDPA's kernel, returning the LSE)"),
    "triton_scratch_allocator": PrivateSurface(
        "triton", "triton.runtime._allocation._allocator (the context's scratch allocator, read to leave an "
        "allocator the application set in place)"),
    "flashinfer_mla_kv_indices": PrivateSurface(
        "flashinfer-python", "BatchMLAPagedAttentionWrapper.plan() keeping (outside CUDA-graph mode) the device "
        "kv_indices tensor it is given, so page ids contained in place after plan() are the ones run() reads "
        "(checked by tests/mla/test_mla_page_containment.py::test_flashinfer_mla_cuda_table_without_host_copy)",
        frozenset({"0.6.13"})),
    "torch_cuda_sleep": PrivateSurface(
        "torch", "torch.cuda._sleep (a kernel spinning for a number of GPU clock cycles, used to put the host "
        "ahead of the GPU in checks)"),
    "flash_attn_cute": PrivateSurface(
        "flash-attn-4", "flash_attn.cute, shipped inside a namespace package flash_attn"),
    "flash_attn_cute_private_forward": PrivateSurface(
        "flash-attn-4", "flash_attn.cute.interface._flash_attn_fwd(..., out=) writing into the caller's output",
        frozenset({"4.0.0b36"})),
    # the launch machinery of ops/launch.py (DescriptorLauncher) and the Gluon kernels
    "triton_descriptor_launch": PrivateSurface(
        "triton", "a compiled kernel's C launcher behind the wrapper that encodes its host TMA descriptors on every "
        "launch (the wrapper's closure variable 'launcher' and 'tensordesc_indices', and "
        "triton.backends.nvidia.driver.make_tensordesc_arg, which encodes one descriptor)",
        frozenset({"3.6.0"})),
    "triton_gluon": PrivateSurface(
        "triton", "triton.experimental.gluon and its Hopper language (an experimental package: checked by importing "
        "it)"),
}


@lru_cache(maxsize=None)
def package_version(distribution: str) -> Optional[str]:
    """The installed version of a distribution (e.g. "flashinfer-python"), or None when it is not installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def surface_unsupported_reason(surface: str, version: Optional[str] = None) -> Optional[str]:
    """Why ``surface`` (a key of :data:`PRIVATE_SURFACES`) cannot be used with ``version`` (default: the installed
    one), or None when it can."""
    entry = PRIVATE_SURFACES[surface]
    version = version if version is not None else package_version(entry.package)
    if entry.tested_versions is None:
        return None
    if version is None:
        return f"{entry.package} is not installed"
    if version.split("+")[0] not in entry.tested_versions:
        return (f"{entry.what}: {entry.package} {version} is not one of the tested versions "
                f"{sorted(entry.tested_versions)}")
    return None


_LOGGED: set[tuple[str, str]] = set()


def fallback_reason(surface: str, reason: str) -> str:
    """Log, once per ``surface`` and ``reason``, that the public fallback is used instead; returns ``reason``."""
    if (surface, reason) not in _LOGGED:
        _LOGGED.add((surface, reason))
        logger.info("%s: using the public fallback (%s)", surface, reason)
    return reason


# ------------------------------------------------------------------------------------------- Triton's launcher
@lru_cache(maxsize=None)
def direct_launch_unsupported_reason() -> Optional[str]:
    """Why a compiled Triton kernel cannot be launched through its own C launcher here, or None."""
    return surface_unsupported_reason("triton_compiled_launch")


def raw_stream_getters() -> tuple[Optional[Callable[[int], int]], Optional[Callable[[], int]]]:
    """(torch's raw current-stream getter by device index, its current-device getter), or (None, None) where torch
    has no CUDA bindings."""
    try:
        from torch._C import _cuda_getCurrentRawStream, _cuda_getDevice
    except ImportError:  # pragma: no cover - torch without CUDA bindings
        return None, None
    return _cuda_getCurrentRawStream, _cuda_getDevice


def launch_hooks_set() -> bool:
    """Whether a Triton launch hook is installed (Triton 3.6 keeps them in HookChain objects, older ones use None)."""
    runtime = knobs.runtime
    for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


# --------------------------------------------------------------------------------- Triton's scratch allocator
def _torch_scratch(size: int, alignment: int, stream: Optional[int]) -> torch.Tensor:
    """Scratch for kernels that make tensor descriptors on the device, from torch's caching allocator."""
    return torch.empty(size, dtype=torch.int8, device="cuda" if torch.cuda.is_available() else "cpu")


def ensure_triton_scratch_allocator() -> None:
    """Give Triton a scratch allocator (torch's caching allocator) for kernels that make TMA descriptors on the
    device, unless this context already has one (an application's own is left in place)."""
    try:
        from triton.runtime import _allocation
        current = _allocation._allocator.get()
        unset = isinstance(current, _allocation.NullAllocator)
    except (ImportError, AttributeError) as exc:
        fallback_reason("triton_scratch_allocator", f"cannot read Triton's allocator ({exc}); setting ours")
        unset = True
    if unset:
        triton.set_allocator(_torch_scratch)


# ------------------------------------------------------------------------------------------------- FlashInfer JIT
def flashinfer_jit_generators() -> Optional[dict[str, Callable[..., Any]]]:
    """FlashInfer's JIT module generators for ahead-of-time builds, or None (reason logged) where this flashinfer's
    are not the checked ones: keys gen_batch_decode_module, gen_batch_prefill_module, gen_cascade_module,
    determine_attention_backend."""
    reason = surface_unsupported_reason("flashinfer_jit")
    if reason is None:
        try:
            from flashinfer.jit import gen_batch_decode_module, gen_batch_prefill_module
            from flashinfer.jit.cascade import gen_cascade_module
            from flashinfer.utils import determine_attention_backend
        except ImportError as exc:
            reason = f"importing them failed: {exc}"
        else:
            return dict(gen_batch_decode_module=gen_batch_decode_module,
                        gen_batch_prefill_module=gen_batch_prefill_module, gen_cascade_module=gen_cascade_module,
                        determine_attention_backend=determine_attention_backend)
    fallback_reason("flashinfer_jit", reason)
    return None


# ------------------------------------------------------------------------------------------------------- aten
def efficient_attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                                 scale: float) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """SDPA's memory-efficient kernel with its log-sum-exp, or None (reason logged) where aten lacks it.

    q : [H, Q, D]; k : [H, K, D]; v : [H, K, Dv]. Returns (out [H, Q, Dv], lse [H, Q] float32, natural log).
    """
    op = getattr(torch.ops.aten, "_scaled_dot_product_efficient_attention", None)
    if op is None:
        fallback_reason("aten_efficient_attention", f"torch {torch.__version__} has no such op")
        return None
    out, lse = op(q[None], k[None], v[None], None, True, 0.0, causal, scale=scale)[:2]
    return out[0], lse[0, :, : q.shape[1]]


def cuda_sleep(cycles: int) -> None:
    """Queue on the current CUDA stream a kernel that spins for ``cycles`` GPU clock cycles, so that the host runs
    ahead of the GPU. Raises RuntimeError where torch lacks the kernel."""
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is None:
        raise RuntimeError(f"torch {torch.__version__} has no torch.cuda._sleep (surface torch_cuda_sleep)")
    sleep(int(cycles))


# -------------------------------------------------------------------------------------------------- flash-attn
def flash_attn_cute_available() -> bool:
    """Whether flash-attn 4's ``flash_attn.cute`` is installed. Its wheel ships ``flash_attn`` as a namespace
    package (no ``flash_attn/__init__.py``), so the test is on the ``cute`` subpackage, which must be a real module."""
    return _platform.package_available("flash_attn.cute")


def flash_attn_cute_private_forward(version: str) -> Optional[Callable[..., Any]]:
    """flash-attn 4's private ``_flash_attn_fwd`` (takes ``out=``: no output copy) where ``version`` is a tested one;
    None (reason logged once) elsewhere, where the caller uses the public ``flash_attn_varlen_func`` plus a copy."""
    reason = surface_unsupported_reason("flash_attn_cute_private_forward", version)
    if reason is not None:
        fallback_reason("flash_attn_cute_private_forward", reason)
        return None
    from flash_attn.cute.interface import _flash_attn_fwd

    return _flash_attn_fwd


# -------------------------------------------------------------------------------------------------- flashinfer
def flashinfer_installed() -> bool:
    """Whether the flashinfer package is installed (without importing it; a bare namespace directory is not)."""
    return _platform.package_available("flashinfer")


def import_flashinfer() -> Any:
    """The flashinfer module, or an ImportError that says how to get it."""
    try:
        if not flashinfer_installed():
            raise ImportError("no flashinfer package (a namespace directory at most)")
        import flashinfer
    except ImportError as exc:
        raise ImportError(
            "the flashinfer backend needs the flashinfer package (pip install 'attnbackends[flashinfer]'); "
            f"importing it failed: {exc}"
        ) from exc
    return flashinfer


# ------------------------------------------------------------------------------ transformers' continuous batching
# Everything :mod:`attnbackends.integrations.transformers` needs from transformers beyond its public
# ``AttentionInterface`` / ``AttentionMaskInterface`` registries. transformers' continuous batching (``generate_batch``)
# accepts only "paged|eager", "sdpa" and flash implementations, writes and gathers every layer's keys and values
# itself (``PagedAttentionCache.update``) and hands attention functions no cache and no block table outside its
# flash-only decode path; the hooks below close those three gaps for the implementations the integration owns and
# leave every other implementation on transformers' own code.
PRIVATE_SURFACES.update({
    "transformers_cb_allowlist": PrivateSurface(
        "transformers", "ContinuousBatchingManager.switch_to_cb_friendly_attn (its allow-list of attention "
        "implementations, wrapped to keep ours)", frozenset({"5.24.0"})),
    "transformers_cb_cache_update": PrivateSurface(
        "transformers", "PagedAttentionCache.update (wrapped: for our implementation it only resolves the layer's "
        "kwargs and hands the layer's cache view on, the backend writes the new tokens) and the full-attention "
        "allocator's cache tensor layout [block][layer][K|V][page_size, kv_heads, head_dim]",
        frozenset({"5.24.0"})),
    "transformers_cb_layer_grouping": PrivateSurface(
        "transformers", "generation.continuous_batching.cache.group_layers_by_attn_type (wrapped: our implementation "
        "keeps every layer, sliding ones included, in the position-addressed full-attention allocator; the "
        "backends apply the window)", frozenset({"5.24.0"})),
})

#: The kwargs key under which the cache hook hands an attention call its :class:`TransformersLayerCache`.
TRANSFORMERS_LAYER_CACHE_KWARG = "attnbackends_layer_cache"


@dataclass(frozen=True)
class TransformersLayerCache:
    """One layer's view of transformers' paged cache, as the cache hook hands it to the attention function.

    Attributes
    ----------
    kv_cache : [num_pages, 2, page_size, num_kv_heads, head_dim] in the cache dtype, contiguous: a view of
        transformers' cache tensor (no copy) whose page ``b * pages_per_block`` is this layer's part of block b.
    rows_per_block : token rows of one transformers block (every layer's K and V pages): a cache index ``i`` of
        ``read_index`` / ``write_index`` is block ``i // rows_per_block``, offset ``i % rows_per_block``.
    page_size : tokens per page (transformers' ``page_size``).
    pages_per_block : layers sharing a block (L): block b is page ``b * L`` of every layer's view.
    group : the allocator's position in ``read_index`` / ``write_index`` (always 0: one allocator).
    max_num_tokens : the most query tokens one step holds (transformers' ``max_batch_tokens``).
    owner : the ``PagedAttentionCache`` (the integration keys its per-cache state by it).
    """

    kv_cache: torch.Tensor
    rows_per_block: int
    page_size: int
    pages_per_block: int
    group: int
    max_num_tokens: int
    owner: Any


def transformers_cb_hooks_reason() -> Optional[str]:
    """Why the continuous-batching hooks cannot be installed (transformers missing or lacking a hooked name), or
    None when they can; an untested version with every name present is logged and used."""
    try:
        from transformers.generation.continuous_batching import cache as cb_cache
        from transformers.generation.continuous_batching import continuous_api, initialization
    except ImportError as exc:
        return f"transformers' continuous batching is not importable ({exc})"
    missing = [name for mod, name in ((cb_cache, "group_layers_by_attn_type"), (initialization,
               "group_layers_by_attn_type"), (cb_cache.PagedAttentionCache, "update"),
               (continuous_api.ContinuousBatchingManager, "switch_to_cb_friendly_attn"))
               if not hasattr(mod, name)]
    if missing:
        return (f"transformers {package_version('transformers')} lacks {', '.join(missing)} "
                f"(tested: {sorted(PRIVATE_SURFACES['transformers_cb_cache_update'].tested_versions)})")
    for surface in ("transformers_cb_allowlist", "transformers_cb_cache_update", "transformers_cb_layer_grouping"):
        reason = surface_unsupported_reason(surface)
        if reason is not None and (surface, reason) not in _LOGGED:
            _LOGGED.add((surface, reason))
            logger.warning("%s; trying it (the hooked names exist)", reason)
    return None


_TRANSFORMERS_OWNED: set[str] = set()


def _owned(config: Any) -> bool:
    return getattr(config, "_attn_implementation", None) in _TRANSFORMERS_OWNED


def _layer_cache(cache: Any, layer_idx: int) -> TransformersLayerCache:
    """One layer's view of the full-attention allocator's cache tensor (memoised on the cache).

    transformers keeps a block's pages layer after layer, each as K rows then V rows: block b, layer i starts at row
    (b * L + i) * 2 * page_size of the [rows, kv_heads, head_dim] tensor. Read from layer i's first row on, the
    tensor is a contiguous [num_pages, 2, page_size, kv_heads, head_dim] cache in the library's layout whose page
    b * L is block b of layer i (the pages between are the other layers'), so every layer shares one block table
    (entries b * L) and one slot mapping. All layers' views get the same page count, (num_blocks - 1) * L + 1.
    """
    views = cache.__dict__.setdefault("_attnbackends_layer_views", {})
    view = views.get(layer_idx)
    if view is not None:
        return view
    allocator = cache.layer_to_allocator[layer_idx]
    if allocator.layer_type != "full_attention" or not getattr(allocator, "supports_block_table", False):
        raise NotImplementedError(f"layer {layer_idx} uses transformers' {type(allocator).__name__}; the attnbackends "
                                  "implementation needs every layer in the full-attention allocator")
    tokens = allocator.cache_tensor  # [total_tokens, 2, kv_heads, head_dim]
    layers, page = len(allocator.layer_indices), allocator.tokens_per_page
    rows_per_block = 2 * layers * page
    if allocator.block_physical_stride != rows_per_block:
        raise NotImplementedError(f"transformers' block stride {allocator.block_physical_stride} is not "
                                  f"2 * layers * page_size = {rows_per_block}: an untested cache layout")
    rows = tokens.reshape(-1, *tokens.shape[2:])  # [2 * total_tokens, kv_heads, head_dim]
    num_blocks = rows.shape[0] // rows_per_block
    num_pages = (num_blocks - 1) * layers + 1
    first = allocator.layer_indices.index(layer_idx) * 2 * page
    kv_cache = rows[first: first + num_pages * 2 * page].view(num_pages, 2, page, *rows.shape[1:])
    view = TransformersLayerCache(kv_cache, rows_per_block, page, layers, allocator.index,
                                  int(cache.max_batch_tokens), cache)
    views[layer_idx] = view
    return view


def install_transformers_cb_hooks(implementation: str) -> None:
    """Let transformers' continuous batching run the attention implementation ``implementation`` (registered in
    its ``AttentionInterface``) on paged kernels over transformers' own cache. Idempotent; other implementations
    keep transformers' behaviour. Raises NotImplementedError when the hooked names are missing."""
    reason = transformers_cb_hooks_reason()
    if reason is not None:
        raise NotImplementedError(reason)
    from transformers.generation.continuous_batching import cache as cb_cache
    from transformers.generation.continuous_batching import continuous_api, initialization
    from transformers.generation.continuous_batching.cache_allocators import FULL_ATTENTION

    _TRANSFORMERS_OWNED.add(implementation)
    if getattr(cb_cache, "_attnbackends_hooked", False):
        return

    grouping = cb_cache.group_layers_by_attn_type

    def group_layers_by_attn_type(config: Any) -> dict[str, list[int]]:
        if _owned(config):
            return {FULL_ATTENTION: list(range(config.num_hidden_layers))}
        return grouping(config)

    update = cb_cache.PagedAttentionCache.update

    def paged_update(self: Any, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
                     kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        if not _owned(self.config):
            return update(self, key_states, value_states, layer_idx, kwargs)
        allocator = self.layer_to_allocator[layer_idx]
        kwargs["cu_seq_lens_k"] = kwargs["cu_seq_lens_k"][allocator.layer_type].to(torch.int32)
        kwargs["max_length_k"] = kwargs["max_length_k"][allocator.layer_type]
        kwargs[TRANSFORMERS_LAYER_CACHE_KWARG] = _layer_cache(self, layer_idx)
        return key_states, value_states

    switch = continuous_api.ContinuousBatchingManager.switch_to_cb_friendly_attn

    def switch_to_cb_friendly_attn(self: Any, model: Any, auto_switch_to_flash: bool = True) -> None:
        if _owned(model.config):
            return None
        return switch(self, model, auto_switch_to_flash)

    cb_cache.group_layers_by_attn_type = group_layers_by_attn_type
    initialization.group_layers_by_attn_type = group_layers_by_attn_type
    cb_cache.PagedAttentionCache.update = torch.compiler.disable(paged_update)
    continuous_api.ContinuousBatchingManager.switch_to_cb_friendly_attn = switch_to_cb_friendly_attn
    cb_cache._attnbackends_hooked = True


# ===================================================================================== Gluon and TMA descriptors
# Gluon availability and the C launcher behind kernels that take host TMA descriptors (used by ops/launch.py).

try:
    from triton.experimental import gluon as _gluon  # noqa: F401
    from triton.experimental.gluon.language.nvidia import hopper as _gluon_hopper  # noqa: F401

    _GLUON_IMPORT_ERROR: Optional[BaseException] = None
except ImportError as _exc:  # a Triton without Gluon: the Triton kernels serve every GPU
    _GLUON_IMPORT_ERROR = _exc


def gluon_available() -> bool:
    """Whether the installed Triton ships Gluon's Hopper language (``triton.experimental.gluon``)."""
    return _GLUON_IMPORT_ERROR is None


@lru_cache(maxsize=None)
def descriptor_encoder() -> tuple[Optional[Callable[..., list]], Optional[str]]:
    """(Triton's encoder of one host TMA descriptor into launcher arguments, None) or (None, why not)."""
    reason = surface_unsupported_reason("triton_descriptor_launch")
    if reason is not None:
        return None, reason
    try:
        from triton.backends.nvidia.driver import make_tensordesc_arg
    except ImportError as exc:
        return None, f"triton.backends.nvidia.driver.make_tensordesc_arg: {exc}"
    return make_tensordesc_arg, None


def raw_descriptor_launch(compiled: Any, positions: tuple[int, ...]) -> tuple[Optional[tuple], Optional[str]]:
    """(launch, base arguments, descriptor metadata) that launch ``compiled`` with descriptors encoded by the caller,
    or (None, why not)."""
    encode, reason = descriptor_encoder()
    if encode is None:
        return None, reason
    run = compiled.run
    wrapper = getattr(run, "launch", None)
    code, cells = getattr(wrapper, "__code__", None), getattr(wrapper, "__closure__", None)
    if code is None or not cells:
        return None, "the compiled kernel's launcher does not wrap its descriptors"
    free = dict(zip(code.co_freevars, (c.cell_contents for c in cells)))
    raw, indices = free.get("launcher"), free.get("tensordesc_indices")
    if not callable(raw) or indices is None or sorted(indices) != list(positions):
        return None, f"the launcher's descriptor arguments {sorted(indices or ())} are not {list(positions)}"
    if getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1):
        return None, "the kernel needs launch scratch memory"
    metas = getattr(compiled.metadata, "tensordesc_meta", None) or [None] * len(positions)
    base = (compiled.function, run.launch_cooperative_grid, run.launch_pdl, None, None, compiled.packed_metadata,
            None, None, None)
    return (raw, base, tuple(metas)), None
