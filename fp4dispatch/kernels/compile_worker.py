"""A compile worker process (``main``; compile_processes.py starts it with its parent's fp4dispatch and the pipe ``FD``
as the last argument): reads pickled compile jobs on stdin (each an 8-byte little-endian length, then the pickle),
compiles each with ``triton.compile`` into Triton's disk cache, and answers each on ``FD`` with None, or the error
as text; its first answer, "ready", says it can take jobs. A job is ``compile_processes.compile_job``'s tuple. Needs
no GPU: the job names the target. The answers have a pipe of their own, not stdout, so that nothing an import or a
compiler prints can garble them."""
from __future__ import annotations

import importlib
import os
import pickle
import sys

from .cache_keys import settle


def _named(module: str, qualname: str):
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def compile_one(job: tuple) -> None:
    """Compile ``job`` (kernel module and name, source class module and name, signature, constants, attrs, target,
    options, cache-invalidating env vars) as Triton's async compile would have in the parent process."""
    import triton

    module, name, src_module, src_name, signature, constants, attrs, target, options, env_vars = job
    kernel = _named(module, name)
    settle(kernel)  # its cache key as the parent computed it (cache_keys.py), whatever this worker compiled before
    src = _named(src_module, src_name)(kernel, signature, constants, attrs)
    triton.compile(src, target=target, options=options, **({"_env_vars": env_vars} if env_vars is not None else {}))


def main() -> None:
    jobs = sys.stdin.buffer
    answers = os.fdopen(int(sys.argv[-1]), "wb")
    pickle.dump("ready", answers)  # compile_processes.READY: imported, taking jobs
    answers.flush()
    while True:
        head = jobs.read(8)  # each job: its length, then its pickle (a job that fails to unpickle is still read whole)
        if len(head) < 8:  # the parent closed the pipe (it is done, or exiting)
            return
        data = jobs.read(int.from_bytes(head, "little"))
        try:
            job = pickle.loads(data)
        except Exception as e:  # noqa: BLE001 - not rebuilt here (a class this process cannot import)
            answer = f"the job did not unpickle: {type(e).__name__}: {e}"[:2000]
        else:
            try:
                compile_one(job)
                answer = None
            except Exception as e:  # noqa: BLE001 - the parent compiles it itself and reports the real error
                answer = f"{type(e).__name__}: {e}"[:2000]
        pickle.dump(answer, answers)
        answers.flush()


if __name__ == "__main__":
    main()
