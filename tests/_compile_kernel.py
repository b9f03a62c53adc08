"""A small Triton kernel at module level, for the compile-worker tests (a worker finds a kernel by module and name)."""
import triton
import triton.language as tl


@triton.jit
def scale_kernel(x_ptr, out_ptr, n, FACTOR: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * FACTOR, mask=offs < n)
