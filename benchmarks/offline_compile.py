"""Compile Triton / Gluon kernels for a GPU target on a machine without a GPU, and report what the hardware would
get: registers per thread, spill stack, shared memory, and the wgmma instruction shapes.

The kernels' argument types come from real (CPU) arguments, as a launch would pass them; nothing runs.
``ptxas`` and ``cuobjdump`` ship with Triton's NVIDIA backend.

    from benchmarks.offline_compile import compile_call
    report = compile_call(kernel, args, kwargs)   # {"regs": ..., "stack": ..., "shared": ..., "wgmma": {...}}
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections import Counter
from typing import Any

__all__ = ["compile_call", "sm90_target"]

_OPTION_KEYS = ("num_warps", "num_stages", "num_ctas", "maxnreg")
SHARED_LIMIT = {90: 232448}  # bytes of shared memory one block may use (H100 / H200)


def sm90_target():
    """Hopper (H100 / H200)."""
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", 90, 32)


def _tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def _signature(kernel, args: tuple, kwargs: dict) -> tuple[dict, dict, dict]:
    """(signature, constexprs, options) of a launch ``kernel[grid](*args, **kwargs)``."""
    from triton.runtime.jit import mangle_type

    params = kernel.params
    options = {k: kwargs[k] for k in _OPTION_KEYS if k in kwargs}
    signature, constexprs = {}, {}
    positional = list(args)
    for p in params:
        if p.is_constexpr:
            if p.name in kwargs:
                value = kwargs[p.name]
            elif p.has_default:
                value = p.default
            else:
                raise ValueError(f"constexpr {p.name} of {kernel.__name__} has no value")
            signature[p.name] = "constexpr"
            constexprs[(p.num,)] = value
            continue
        if positional:
            value = positional.pop(0)
        elif p.name in kwargs:
            value = kwargs[p.name]
        else:
            raise ValueError(f"argument {p.name} of {kernel.__name__} has no value")
        signature[p.name] = mangle_type(value)
    return signature, constexprs, options


def _ptxas_notes(ptx: str, arch: int) -> list[str]:
    """ptxas's "Potential Performance Loss" and similar notes for this PTX (Triton's own ptxas call hides them)."""
    suffix = "a" if arch >= 90 else ""
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        res = subprocess.run([_tool("ptxas"), f"-arch=sm_{arch}{suffix}", src, "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True)
    text = res.stdout + res.stderr
    return [line.split("info    : ", 1)[-1].strip() for line in text.splitlines()
            if "Performance Loss" in line or "injected" in line]


def compile_call(kernel, args: tuple, kwargs: dict, target=None, keep_asm: bool = False) -> dict[str, Any]:
    """Compile one launch for ``target`` (default sm_90) and report its resources.

    Returns {"kernel", "regs", "stack" (bytes of spill stack per thread), "local", "shared" (bytes, static +
    Triton's), "shared_over_limit" (above what one block may use on the target), "wgmma" {instruction shape:
    count in the PTX}, "ptxas_notes" (ptxas's performance notes, e.g. wgmma serialised), "compile_s"} and, with
    ``keep_asm``, "asm" (ttgir, ptx)."""
    import time

    import triton
    from triton.compiler import ASTSource

    target = target or sm90_target()
    fn = getattr(kernel, "fn", kernel)
    jit = kernel
    signature, constexprs, options = _signature(jit, args, kwargs)
    source_cls = ASTSource
    if getattr(jit, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource

        source_cls = GluonASTSource
    t0 = time.time()
    compiled = triton.compile(source_cls(jit, signature, constexprs), target=target, options=options)
    report: dict[str, Any] = {"kernel": fn.__name__, "compile_s": round(time.time() - t0, 2),
                              "shared": compiled.metadata.shared}
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
        cubin = f.name
    try:
        usage = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", cubin], capture_output=True,
                               text=True, check=True).stdout
    finally:
        os.unlink(cubin)
    for key, field in (("regs", "REG"), ("stack", "STACK"), ("local", "LOCAL")):
        m = re.search(rf"\b{field}:(\d+)", usage)
        report[key] = int(m.group(1)) if m else None
    ptx = compiled.asm["ptx"]
    report["shared_over_limit"] = compiled.metadata.shared > SHARED_LIMIT.get(target.arch, 1 << 30)
    report["ptxas_notes"] = _ptxas_notes(ptx, target.arch)
    report["wgmma"] = dict(Counter(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+\.[\w.]+)", ptx)))
    report["mma_sync"] = len(re.findall(r"\bmma\.sync\.aligned", ptx))
    if keep_asm:
        report["asm"] = {"ttgir": compiled.asm.get("ttgir", ""), "ptx": ptx}
    return report
