"""What the job entrypoints (jobs/*.py) share: running a job under SIGINT/SIGTERM handling and
turning the driver's outcomes into one message on stderr and one exit code.

Exit codes: 2 bad input or output location (nothing ran); 3 another live driver holds the run
(nothing ran); 1 the job failed (committed units stay; rerunning resumes); 128 + signal number after
SIGINT / SIGTERM (committed units stay; `resume` says how to go on).
"""
from __future__ import annotations

import sys
from typing import Callable, TypeVar

from .cluster.driver import Interrupted, JobFailed, RunBusy, StopRequest
from .io.reader import InputError
from .io.writer import OutputError

T = TypeVar("T")


def run_job_guarded(job: Callable[[StopRequest], T], resume: str) -> tuple[int, T | None]:
    """(0, job's result), or (exit code, None) with the reason printed."""
    stop = StopRequest()
    stop.install()
    try:
        return 0, job(stop)
    except (InputError, OutputError) as e:
        print(f"input/output error: {e}", file=sys.stderr)
        return 2, None
    except RunBusy as e:
        print(f"not started: {e}", file=sys.stderr)
        return 3, None
    except JobFailed as e:
        print(f"job failed: {e}\nthe committed units stay; rerun the same command to resume", file=sys.stderr)
        return 1, None
    except Interrupted as e:
        print(f"{e}; uncommitted units left nothing visible.\n{resume}", file=sys.stderr)
        return 128 + e.signum, None
