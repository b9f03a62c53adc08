"""``torch.ops.fp4dispatch.fp4_mm`` / ``fp4_mm_out`` (and ``w4a16_mm``, ``fp4_grouped_mm``, ``w4a16_grouped_mm``,
each with ``_out``): the
calls as torch custom ops, so that ``torch.compile`` (``fullgraph=True``) traces models that call them without a
graph break.

Two ops rather than one with an optional mutated ``out``: a functional op may not return one of its inputs, and
an optional mutated argument is poorly supported by functionalization. ``fp4dispatch.fp4_mm`` routes here (through
``api._traced``) only while compiling; eager calls take the direct path (a custom-op dispatch costs more host
time than the whole dispatcher).

Schema notes: ``alpha`` is ``Tensor?`` plus a Python ``float`` (``alpha_value``) used when the tensor is None, so a
Python-float alpha traces too; ``backend`` is ``str?``; ``out_dtype`` is a ``ScalarType``; the grouped ops take the
caller's ``check_offs``, so a compiled call reads and checks ``offs`` exactly when the eager one would (their fakes
check what needs no values of it).
"""
from __future__ import annotations

import torch

__all__ = ["fp4_mm_op", "fp4_mm_out_op", "w4a16_mm_op", "w4a16_mm_out_op", "fp4_grouped_mm_op",
           "fp4_grouped_mm_out_op", "w4a16_grouped_mm_op", "w4a16_grouped_mm_out_op"]

_LIB = "fp4dispatch"


def _alpha(alpha: torch.Tensor | None, alpha_value: float) -> torch.Tensor | float | None:
    # None and 1.0 both mean "no scaling": keep None so validate reuses its cached device ones-tensor
    if alpha is not None:
        return alpha
    return None if alpha_value == 1.0 else alpha_value


@torch.library.custom_op(f"{_LIB}::fp4_mm", mutates_args=())
def fp4_mm_op(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
              alpha: torch.Tensor | None, alpha_value: float, out_dtype: torch.dtype, scale_layout: str,
              backend: str | None) -> torch.Tensor:
    """Functional fp4_mm: returns a new [M, N] tensor of ``out_dtype``."""
    from . import api

    return api.run_fp4_mm(api.get_dispatcher(), a, b, a_scale, b_scale, _alpha(alpha, alpha_value), out_dtype,
                          None, scale_layout, backend)


@fp4_mm_op.register_fake
def _fp4_mm_fake(a, b, a_scale, b_scale, alpha, alpha_value, out_dtype, scale_layout, backend):
    # Run the real contract checks on the fake tensors: a bad call fails at trace time with the eager message.
    # alpha None goes in as a float: validate caches a real ones-tensor per device, never a fake one.
    from .validate import check_fp4_mm_args

    problem, _ = check_fp4_mm_args(a, b, a_scale, b_scale, alpha if alpha is not None else 1.0, out_dtype, None,
                                   scale_layout)
    return a.new_empty((problem.m, problem.n), dtype=out_dtype)


@torch.library.custom_op(f"{_LIB}::fp4_mm_out", mutates_args=("out",))
def fp4_mm_out_op(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
                  alpha: torch.Tensor | None, alpha_value: float, out: torch.Tensor, scale_layout: str,
                  backend: str | None) -> None:
    """fp4_mm into a preallocated ``out`` (its dtype is the output dtype)."""
    from . import api

    api.run_fp4_mm(api.get_dispatcher(), a, b, a_scale, b_scale, _alpha(alpha, alpha_value), out.dtype, out,
                   scale_layout, backend)


@fp4_mm_out_op.register_fake
def _fp4_mm_out_fake(a, b, a_scale, b_scale, alpha, alpha_value, out, scale_layout, backend):
    from .validate import check_fp4_mm_args

    check_fp4_mm_args(a, b, a_scale, b_scale, alpha if alpha is not None else 1.0, out.dtype, out, scale_layout)


@torch.library.custom_op(f"{_LIB}::w4a16_mm", mutates_args=())
def w4a16_mm_op(a: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, alpha: torch.Tensor | None,
                out_dtype: torch.dtype | None, scale_layout: str, backend: str | None) -> torch.Tensor:
    """Functional w4a16_mm: returns a new [M, N] tensor (a tensor alpha or none; a Python float is traced as a
    constant tensor by torch.compile)."""
    from . import api

    return api.get_dispatcher().w4a16_mm(a, b, b_scale, alpha, out_dtype=out_dtype, scale_layout=scale_layout,
                                         backend=backend)


@w4a16_mm_op.register_fake
def _w4a16_mm_fake(a, b, b_scale, alpha, out_dtype, scale_layout, backend):
    from .validate import check_w4a16_mm_args

    problem, _ = check_w4a16_mm_args(a, b, b_scale, alpha if alpha is not None else 1.0, out_dtype, None,
                                     scale_layout)
    return a.new_empty((problem.m, problem.n), dtype=problem.out_dtype)


@torch.library.custom_op(f"{_LIB}::w4a16_mm_out", mutates_args=("out",))
def w4a16_mm_out_op(a: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, alpha: torch.Tensor | None,
                    out: torch.Tensor, scale_layout: str, backend: str | None) -> None:
    """w4a16_mm into a preallocated ``out`` (its dtype is the output dtype)."""
    from . import api

    api.get_dispatcher().w4a16_mm(a, b, b_scale, alpha, out_dtype=out.dtype, out=out, scale_layout=scale_layout,
                                  backend=backend)


@w4a16_mm_out_op.register_fake
def _w4a16_mm_out_fake(a, b, b_scale, alpha, out, scale_layout, backend):
    from .validate import check_w4a16_mm_args

    check_w4a16_mm_args(a, b, b_scale, alpha if alpha is not None else 1.0, out.dtype, out, scale_layout)


@torch.library.custom_op(f"{_LIB}::fp4_grouped_mm", mutates_args=())
def fp4_grouped_mm_op(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
                      alpha: torch.Tensor, offs: torch.Tensor, out_dtype: torch.dtype, scale_layout: str,
                      backend: str | None, check_offs: bool = True) -> torch.Tensor:
    """Functional fp4_grouped_mm."""
    from . import api

    return api.get_dispatcher().fp4_grouped_mm(a, b, a_scale, b_scale, alpha, offs, out_dtype=out_dtype,
                                               scale_layout=scale_layout, backend=backend, check_offs=check_offs)


@fp4_grouped_mm_op.register_fake
def _fp4_grouped_mm_fake(a, b, a_scale, b_scale, alpha, offs, out_dtype, scale_layout, backend, check_offs=True):
    from .validate_grouped import check_fp4_grouped_mm_args

    problem, _ = check_fp4_grouped_mm_args(a, b, a_scale, b_scale, alpha, offs, out_dtype, None, scale_layout,
                                           check_offs, traced=True)
    return a.new_empty((problem.m, problem.n), dtype=out_dtype)


@torch.library.custom_op(f"{_LIB}::fp4_grouped_mm_out", mutates_args=("out",))
def fp4_grouped_mm_out_op(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
                          alpha: torch.Tensor, offs: torch.Tensor, out: torch.Tensor, scale_layout: str,
                          backend: str | None, check_offs: bool = True) -> None:
    """fp4_grouped_mm into a preallocated ``out`` (its dtype is the output dtype)."""
    from . import api

    api.get_dispatcher().fp4_grouped_mm(a, b, a_scale, b_scale, alpha, offs, out_dtype=out.dtype, out=out,
                                        scale_layout=scale_layout, backend=backend, check_offs=check_offs)


@fp4_grouped_mm_out_op.register_fake
def _fp4_grouped_mm_out_fake(a, b, a_scale, b_scale, alpha, offs, out, scale_layout, backend, check_offs=True):
    from .validate_grouped import check_fp4_grouped_mm_args

    check_fp4_grouped_mm_args(a, b, a_scale, b_scale, alpha, offs, out.dtype, out, scale_layout, check_offs,
                              traced=True)


@torch.library.custom_op(f"{_LIB}::w4a16_grouped_mm", mutates_args=())
def w4a16_grouped_mm_op(a: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, alpha: torch.Tensor,
                        offs: torch.Tensor, out_dtype: torch.dtype | None, scale_layout: str,
                        backend: str | None, check_offs: bool = True) -> torch.Tensor:
    """Functional w4a16_grouped_mm."""
    from . import api

    return api.get_dispatcher().w4a16_grouped_mm(a, b, b_scale, alpha, offs, out_dtype=out_dtype,
                                                 scale_layout=scale_layout, backend=backend, check_offs=check_offs)


@w4a16_grouped_mm_op.register_fake
def _w4a16_grouped_mm_fake(a, b, b_scale, alpha, offs, out_dtype, scale_layout, backend, check_offs=True):
    from .validate_grouped import check_w4a16_grouped_mm_args

    problem, _ = check_w4a16_grouped_mm_args(a, b, b_scale, alpha, offs, out_dtype, None, scale_layout, check_offs,
                                             traced=True)
    return a.new_empty((problem.m, problem.n), dtype=problem.out_dtype)


@torch.library.custom_op(f"{_LIB}::w4a16_grouped_mm_out", mutates_args=("out",))
def w4a16_grouped_mm_out_op(a: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, alpha: torch.Tensor,
                            offs: torch.Tensor, out: torch.Tensor, scale_layout: str, backend: str | None,
                            check_offs: bool = True) -> None:
    """w4a16_grouped_mm into a preallocated ``out`` (its dtype is the output dtype)."""
    from . import api

    api.get_dispatcher().w4a16_grouped_mm(a, b, b_scale, alpha, offs, out_dtype=out.dtype, out=out,
                                          scale_layout=scale_layout, backend=backend, check_offs=check_offs)


@w4a16_grouped_mm_out_op.register_fake
def _w4a16_grouped_mm_out_fake(a, b, b_scale, alpha, offs, out, scale_layout, backend, check_offs=True):
    from .validate_grouped import check_w4a16_grouped_mm_args

    check_w4a16_grouped_mm_args(a, b, b_scale, alpha, offs, out.dtype, out, scale_layout, check_offs, traced=True)
