"""A compile worker process (``main``; compile_processes.py starts it, as fp4dispatch/worker_process.py describes):
reads compile jobs on stdin, one frame each, compiles each with ``triton.compile`` into Triton's disk cache, and
answers each on its answer pipe with None, or the error as text; its first answer, "ready", says it can take jobs. A
job is ``compile_processes.compile_job``'s tuple. Needs no GPU: the job names the target."""
from __future__ import annotations

import importlib
import pickle
import sys

from ..errors import describe_failure
from ..worker_process import answer_pipe, log_to_parent, read_frame
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
    log_to_parent()
    answers = answer_pipe()
    pickle.dump("ready", answers)  # compile_processes.READY: imported, taking jobs
    answers.flush()
    while (data := read_frame(sys.stdin.buffer)) is not None:  # None: the parent closed the pipe (done, or exiting)
        try:
            job = pickle.loads(data)
        except Exception as e:  # noqa: BLE001 - not rebuilt here (a class this process cannot import)
            answer = "the job did not unpickle: " + describe_failure(e)
        else:
            try:
                compile_one(job)
                answer = None
            except Exception as e:  # noqa: BLE001 - the parent compiles it itself and reports the real error
                answer = describe_failure(e)
        pickle.dump(answer, answers)
        answers.flush()


if __name__ == "__main__":
    main()
