"""The public test helpers (fp4dispatch.testing) with odd arguments: each is refused with an InvalidInputError that
names the argument, or (a NumPy int) taken as the int it is."""
from __future__ import annotations

import numpy as np
import pytest

from fp4dispatch.errors import InvalidInputError
from fp4dispatch.testing import FakeBackend, make_nvfp4_inputs


@pytest.mark.parametrize("args, said", [
    pytest.param((-1, 32, 64), r"m must be an int >= 0 \(the M of the M x K by N x K product\); got -1\. Pass e\.g\. "
                 r"make_nvfp4_inputs\(4, 64, 128\)$", id="negative-m"),
    pytest.param((4, 32, 64.0), r"k must be an int >= 0 .*; got 64\.0\.", id="float-k"),
    pytest.param((True, 32, 64), r"m must be an int >= 0 .*; got True\.", id="bool-m"),
    pytest.param((4, 32, "64"), r"k must be an int >= 0 .*; got '64'\.", id="str-k"),
    pytest.param((4, 32, 40), r"k must be a multiple of 16 \(one e4m3 scale per 16 values\); got 40\. Pass k=48$",
                 id="k-not-16"),
])
def test_make_nvfp4_inputs_refuses_sizes_that_are_not_ints_with_a_multiple_of_16_for_k(args, said):
    with pytest.raises(InvalidInputError, match=r"^make_nvfp4_inputs: " + said):
        make_nvfp4_inputs(*args)


@pytest.mark.parametrize("kw, said", [
    pytest.param({"device": "bogus"}, r"device must be None, a torch\.device, a string like 'cuda:0' or 'cpu', or a "
                 r"CUDA index; got 'bogus'$", id="device-name"),
    pytest.param({"device": "meta"}, r"tensors must hold data on a CPU or CUDA device; got device meta\.", id="meta"),
    pytest.param({"seed": None}, r"seed must be an int in \[-2\*\*63, 2\*\*64\) \(torch\.manual_seed's range\); got "
                 r"None\. Pass e\.g\. seed=0$", id="seed-none"),
    pytest.param({"seed": 2**70}, r"seed must be an int in .*; got 1180591620717411303424\.", id="seed-huge"),
])
def test_make_nvfp4_inputs_refuses_a_device_or_seed_it_cannot_use(kw, said):
    with pytest.raises(InvalidInputError, match=r"^make_nvfp4_inputs: " + said):
        make_nvfp4_inputs(4, 32, 64, **kw)


def test_make_nvfp4_inputs_takes_numpy_ints_and_empty_sizes():
    a, b, sa, sb, alpha = make_nvfp4_inputs(np.int64(4), 32, np.int32(64), seed=np.int64(3))
    assert (a.shape, b.shape, alpha.shape) == ((4, 32), (32, 32), (1,))
    assert make_nvfp4_inputs(0, 32, 64)[0].shape == (0, 32)


@pytest.mark.parametrize("kw, said", [
    pytest.param({"crash": "abort"}, r"crash must be None or one of \('exit', 'segv', 'hang'\); got 'abort'$",
                 id="crash"),
    pytest.param({"ops": "w4a16"}, r"ops must be a tuple of op names from \('fp4_mm', 'w4a16', 'grouped', "
                 r"'w4a16_grouped'\); got 'w4a16'\. Pass e\.g\. ops=\('w4a16',\)$", id="ops-str"),
    pytest.param({"ops": ("w4a16_mm",)}, r"ops must be a tuple of op names .*; got \('w4a16_mm',\)\.", id="ops-name"),
    pytest.param({"ops": ()}, r"ops must be a tuple of op names .*; got \(\)\.", id="ops-empty"),
])
def test_fake_backend_refuses_a_crash_or_ops_it_would_silently_ignore(kw, said):
    """A crash it does not know ran without crashing; ops='w4a16' made a backend of the ops 'w', '4', 'a', ...,
    which computes none: a test meaning to script a failure would pass without one."""
    with pytest.raises(InvalidInputError, match=r"^FakeBackend: " + said):
        FakeBackend("x", **kw)
